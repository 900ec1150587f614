"""experiments.serve_soak: the load's mix, and a short soak of a real server (the byte model,
its CLI, over HTTP) after which its resources are back where they started -- threads, open
fds, KV sessions and referenced blocks -- and nothing failed. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from experiments import serve_soak as ss
from federation.deploy.flwr_sandbox import alive


def test_the_load_mixes_every_kind_and_fits_the_byte_models_context():
    shape, cfg = ss.SHAPES["byte"], ss.SoakConfig(seed=3)
    jobs = ss.load_jobs(shape, cfg, 300)
    assert {j.kind for j in jobs} == {k for k, _ in cfg.mix}
    for j in jobs:
        if j.kind == "invalid":
            assert j.expect == 400 and j.body["max_tokens"] < 0
            continue
        assert j.expect == 200
        if j.kind == "cancel":
            assert j.body["stream"] and j.cancel_after >= 1
        if j.kind == "chat":
            assert j.path == "/v1/chat/completions" and "prompt" not in j.body
        else:
            assert len(j.body["prompt"]) + j.body["max_tokens"] <= 128
            assert all(4 <= t < shape.vocab for t in j.body["prompt"])
    heads = {tuple(j.body["prompt"][: shape.prefix]) for j in jobs if "prompt" in j.body}
    assert len(heads) < 200  # shared prefixes: the prefix cache gets hits and evicts
    assert ss.load_jobs(shape, cfg, 300) == jobs  # seeded


def test_probe_prompts_are_never_load_prompts():
    shape, cfg = ss.SHAPES["byte"], ss.SoakConfig()
    fresh, cached = ss.probe_prompts(shape, cfg.seed)
    assert len(fresh) == len(cached) == shape.probe_prompt and fresh[0] != cached[0]
    loads = {tuple(j.body["prompt"][:8]) for j in ss.load_jobs(shape, cfg, 200) if "prompt" in j.body}
    assert tuple(fresh[:8]) not in loads and tuple(cached[:8]) not in loads


@pytest.mark.slow
def test_a_short_soak_returns_the_servers_resources_to_where_they_started(tmp_path, capsys):
    result = ss.main(["--model", "byte", "--requests", "50", "--clients", "3",
                      "--probe-repeats", "2", "--sample-s", "0.5", "--out", str(tmp_path),
                      "--json"])
    assert result["requests"] == 50 and result["failed"] == 0, result["errors"]
    assert result["cancelled"] > 0 and result["by_kind"].get("n", 0) > 0
    assert result["threads"]["end"] == result["threads"]["start"]
    assert result["fds"]["end"] == result["fds"]["start"]
    end = result["metrics"]["end"]
    assert end["fedkv_requests_running"] == end["fedkv_requests_waiting"] == 0
    assert end["fedkv_kv_sessions_open"] == 0 and end["fedkv_kv_blocks_referenced"] == 0
    for name in ("start", "end", "restarted"):
        p = result["probe"][name]
        assert p["failed"] == 0 and p["cached"]["failed"] == 0
        assert min(p["cached"]["cached_tokens"]) > 0  # the cached probe is a prefix hit
        assert max(p["cached_tokens"]) == 0  # the fresh probe is not
    assert set(result["ratio_end_vs_restarted"]) == set(result["ratio_end_vs_start"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["requests"] == 50
    assert len(result["server_pids"]) == 2  # the soaked server and the restarted one
    assert not any(alive(p) for p in result["server_pids"])  # both stopped
