"""experiments.serve_load: the workload keeps the trace's shared prefixes, the pool is sized
as documented, every backend runs behind one driver, and the JSON has the issue's shape."""

from __future__ import annotations

import csv
import json
import types

import pytest
import torch

from experiments import serve_load as sl
from experiments import single_stream

pytest.importorskip("transformers")


def test_trace_requests_share_the_prefixes_the_trace_shares(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 16 * 100, "output_length": 160, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 16 * 100, "output_length": 16, "hash_ids": [0, 1, 9]},
            {"timestamp": 0, "input_length": 16 * 40, "output_length": 16, "hash_ids": [5]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = sl.LoadConfig(scale=16, block_tokens=32, max_prompt=192, max_new=8)
    a, b, c = sl.trace_requests(trace, 10, cfg, vocab=500, seed=0)
    assert len(a.prompt) == len(b.prompt) == 100 and len(c.prompt) == 40
    assert a.prompt[:64] == b.prompt[:64] and a.prompt[64:] != b.prompt[64:]
    assert a.prompt[:32] != c.prompt[:32]
    assert (a.max_tokens, b.max_tokens) == (8, 4)  # 160 // 16 capped at 8; 16 // 16 raised to 4
    assert all(4 <= t < 500 for t in a.prompt)


def test_the_pool_holds_a_share_of_the_offered_load_but_always_the_largest_request():
    reqs = [sl.Req(tuple(range(90)), 10), sl.Req(tuple(range(40)), 10)]
    offered, pool = sl.pool_tokens(reqs, 16, sl.LoadConfig(pool_share=0.25), block=16)
    assert offered == 16 * 75 and pool == 300
    offered, pool = sl.pool_tokens(reqs, 1, sl.LoadConfig(pool_share=0.25), block=16)
    assert pool == 100 + 32 > offered * 0.25


def test_summarize_percentiles_and_throughput():
    recs = [sl.Record(0.1 * i, 0.01 * i, 10, False) for i in range(1, 101)]
    s = sl.summarize(recs, wall_s=10.0)
    assert s["tokens_per_s"] == pytest.approx(100.0)
    assert s["ttft_p50_s"] == pytest.approx(5.05) and s["ttft_p99_s"] == pytest.approx(9.901)
    assert s["tpot_p50_s"] == pytest.approx(0.505)


def test_the_hf_baseline_streams_greedy_tokens_like_generate(one_thread):
    served = sl.load_served("tiny", seed=0)
    prompt = tuple(range(5, 25))
    backend = sl.HFSequentialBackend(served.hf)
    try:
        (h,) = backend.submit(sl.GenerationRequest(prompt, 6))
        got = list(h.tokens(timeout=60))
    finally:
        backend.close()
    want = served.hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              min_new_tokens=6)[0, len(prompt):].tolist()
    assert got == want and h.finish_reason == "length"


def test_the_json_has_the_issue_shape_and_nothing_is_dropped(tmp_path, one_thread, capsys):
    res = sl.main(["--models", "tiny", "--clients", "1,3", "--quick", "--json",
                   "--out", str(tmp_path)])
    m = res["model"]["tiny"]
    assert set(m) >= {"by_clients", "dropped_requests", "preempted", "resumed", "overcommit"}
    assert set(m["by_clients"]) == {"1", "3"}
    for cell in m["by_clients"].values():
        assert set(cell) == set(sl.SYSTEMS) | set(sl.CONTENDERS)  # skips without their paths
        for system in sl.SYSTEMS:
            figures = cell[system]
            assert set(figures) == {*sl.METRICS, "dtype"} and figures["tokens_per_s"] > 0
    assert m["dropped_requests"] == 0 and m["preempted"] == m["resumed"]
    rows = list(csv.DictReader(open(next(tmp_path.glob("serve_load/*/serve_load.csv")))))
    for row in rows:  # each scheduler cell says how long its forwards took, the longest apart
        if row["system"] == "fedkv_scheduler":
            assert int(row["forwards"]) > 0
            assert 0 < float(row["forward_s_max"]) <= float(row["forward_s_sum"])
        else:
            assert row["forward_s_max"] == "nan"
    assert m["overcommit"] > 1  # the pool holds a share of the load at 3 clients
    one = m["single_fresh"]  # one client, a fresh prompt: every backend's TTFT and decode
    assert (one["prompt_tokens"], one["new_tokens"]) == (128, 16)
    assert all("skipped" in one[c] for c in sl.CONTENDERS)
    for system in ("fedkv_scheduler", "hf_sequential"):
        assert one[system]["ttft_s"] > 0 and one[system]["decode_tokens_per_s"] > 0
        assert [x["tokens"] for x in one[system]["samples"]] == [16]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
    run = next((tmp_path / "serve_load").iterdir())
    assert {p.name for p in run.iterdir()} >= {"serve_load.csv", "serve_load.png", "summary.md",
                                               "serve_load.json"}


class _Clocked:
    """A backend on a fake clock: the first token 0.2 s after submit, then one per 0.05 s."""

    def __init__(self, now: list[float]):
        self.now, self.closed = now, False

    def submit(self, request):
        steps = [0.2] + [0.05] * (request.max_tokens - 1)

        def tokens(timeout=None):
            for dt in steps:
                self.now[0] += dt
                yield 1
        return [types.SimpleNamespace(tokens=tokens, finish_reason="length")]

    def close(self):
        self.closed = True


def test_single_stream_times_the_first_token_and_the_decode_apart():
    now, made = [0.0], []

    def make(system):
        made.append(_Clocked(now))
        return made[-1]
    cfg = single_stream.SingleConfig(prompt_tokens=8, new_tokens=5, repeats=2, settle_s=0.0)
    out = single_stream.run(make, ("a", "b"), cfg, vocab=100, seed=0, clock=lambda: now[0])
    assert len(made) == 4 and all(b.closed for b in made)  # a fresh backend per request
    for s in ("a", "b"):
        assert out[s]["ttft_s"] == pytest.approx(0.2)
        assert out[s]["decode_tokens_per_s"] == pytest.approx(4 / 0.2)  # 4 tokens after the first
    p = [single_stream.fresh_prompt(8, 100, seed) for seed in range(3)]
    assert len(set(p)) == 3 and all(4 <= t < 100 for t in p[0])  # never the same prompt twice


def test_the_pool_is_sized_in_the_k_v_format_the_models_cache_stores():
    """An int8 or bf16 model's cache stores bf16 K/V: its pool of ``pool_tokens`` takes half
    the bytes an fp32 model's does, so both hold the tokens the settings state."""
    from node.models import precision
    from tests.tiny_models import tiny_llama

    fp32 = tiny_llama()
    for dtype in ("int8", "bfloat16"):
        m = precision.convert(tiny_llama(), dtype)
        assert m.cache_config().kv_dtype == "bf16"
        assert 2 * sl.bytes_per_token(m, None) == sl.bytes_per_token(fp32, None)


def test_contenders_started_before_an_interrupt_are_stopped(monkeypatch, tmp_path):
    """An interrupt (Ctrl-C, SIGTERM through ``sigterm_unwinds``) while llama.cpp starts must
    not leave vLLM's server, already up, serving."""
    from experiments import serve_contenders as sc

    class Server:
        start_s, closed = 1.0, False

        def report(self):
            return {}

        def close(self):
            self.closed = True

    up = Server()

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(sc, "_vllm", lambda *a: up)
    monkeypatch.setattr(sc, "_llamacpp", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sc.start("smollm2", None, 16, tmp_path)
    assert up.closed
