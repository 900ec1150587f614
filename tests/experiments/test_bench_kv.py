"""experiments.bench_kv in its tiny mode: one JSON object as the last line, every key there,
every figure finite. Never asserts timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]

TOP_KEYS = {
    "block_size", "bytes_per_token", "int8_vs_fp16", "int4_vs_fp16", "slot_bytes_per_token",
    "by_block_size", "decode_tokens_per_s", "fedkv_fp32_vs_hf", "fedkv_fp32_vs_no_cache",
    "quality", "prefix_sharing", "pool_utilisation", "pool_utilisation_live_sessions",
    "targets_met", "config", "checkpoint", "notes",
    # issue 9
    "decode_tokens_per_s_4096", "decode_4096", "arena_bytes_per_token", "arena_ratios",
    "eviction_collateral", "eviction_scenario", "batched",
    # issue 10
    "restore_vs_recompute",
}
BATCHED = ("fedkv_batched", "fedkv_batched_no_tail_buffer", "fedkv_sequential", "hf_batched")
DECODE = {"fedkv_fp32", "fedkv_int8", "fedkv_int4", "hf_dynamic_cache", "naive_concat",
          "no_cache"}


def _numbers(x, path=""):
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    cache = tmp_path_factory.mktemp("ckpt")
    env = {**os.environ, "FEDKV_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_kv", "--tiny", "--json", "--seed", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last), proc.stdout


def test_last_line_is_json_with_every_key(result):
    r, stdout = result
    assert TOP_KEYS <= set(r), TOP_KEYS - set(r)
    assert r["mode"] == "tiny" and r["block_size"] == 32
    assert set(r["bytes_per_token"]) == {"fp32", "fp16", "int8", "int4"}
    assert set(r["decode_tokens_per_s"]) == DECODE
    assert {"16", "32"} <= set(r["by_block_size"])
    for dt in ("int8", "int4"):
        assert {"top1_agreement", "ppl_delta"} <= set(r["quality"][dt])
    assert {"bytes_shared", "bytes_ideal", "bytes_unshared", "ratio"} <= set(r["prefix_sharing"])
    assert "pool_utilisation" in r["notes"]
    assert len(stdout.strip().splitlines()) > 1  # human-readable lines come first


def test_every_figure_is_finite(result):
    r, _ = result
    bad = [(p, v) for p, v in _numbers(r) if not math.isfinite(v)]
    assert not bad
    nulls = [k for k, v in r.items() if v is None]
    assert not nulls


def test_figures_are_consistent(result):
    r, _ = result
    b = r["bytes_per_token"]
    assert b["fp32"] == 2 * b["fp16"]
    assert b["int4"] < b["int8"] < b["fp16"]
    assert r["int8_vs_fp16"] == pytest.approx(b["int8"] / b["fp16"])
    for v in r["decode_tokens_per_s"].values():
        assert v > 0
    for dt in ("int8", "int4"):
        q = r["quality"][dt]
        assert 0.0 <= q["top1_agreement"] <= 1.0
        # later tokens really read quantized blocks (none skipped for lack of pool space)
        assert q["quantized_blocks"] == q["expected_quantized_blocks"] > 0
    assert r["quality"]["positions_reading_quantized_blocks"] > 0
    ps = r["prefix_sharing"]
    assert ps["bytes_ideal"] <= ps["bytes_shared"] < ps["bytes_unshared"]
    assert ps["ratio"] == pytest.approx(ps["bytes_shared"] / ps["bytes_ideal"])
    # sharing keeps one copy of the prefix: exactly the block-granular ideal
    # the prefix is stored once: never more than whole blocks per tail, never below exact
    assert ps["ratio_vs_block_granular_ideal"] <= 1.0 + 1e-9
    assert ps["ratio"] >= 1.0 - 1e-9
    assert 0.0 < r["pool_utilisation"] <= 1.0
    assert 0.0 < r["pool_utilisation_live_sessions"] <= 1.0
    # the cached fedkv decode computes the same logits as the torch.cat cache and no cache
    for v in r["decode_consistency"].values():
        assert v < 1e-3
    assert r["checkpoint"]["cached"] is False


def test_issue9_keys_have_sane_types(result):
    r, _ = result
    long = r["decode_tokens_per_s_4096"]
    assert set(long) == DECODE
    assert all(isinstance(v, float) and v > 0 for v in long.values())
    d4 = r["decode_4096"]
    assert d4["context"] > r["config"]["context"]
    assert isinstance(d4["no_cache_steps"], int) and isinstance(d4["decode_steps"], int)
    assert 1 <= d4["no_cache_steps"] <= d4["decode_steps"]
    assert set(d4["samples"]) == DECODE
    for v in d4["decode_consistency"].values():
        assert v < 1e-3
    arena = r["arena_bytes_per_token"]
    assert set(arena) == {"lm_model", "bench_model"}
    for geom, per in arena.items():
        assert set(per) == {"fp32", "fp16", "int8", "int4"}, geom
        assert all(isinstance(v, (int, float)) and v > 0 for v in per.values())
        # a block never costs less than its format bytes, and int4 <= int8 <= fp16 < fp32
        assert per["int4"] <= per["int8"] <= per["fp16"] < per["fp32"]
        assert set(r["arena_ratios"][geom]) == {"int8_vs_fp16", "int4_vs_fp16"}
    assert arena["bench_model"]["int8"] >= r["bytes_per_token"]["int8"]
    assert r["by_block_size"]["32"]["arena_bytes_per_token"] == arena["bench_model"]
    ec = r["eviction_collateral"]
    assert isinstance(ec, int) and not isinstance(ec, bool) and ec >= 0
    sc = r["eviction_scenario"]
    assert sc["reserve_tokens"] == 3 and sc["free_full_slots_before"] == 1
    assert sc["cached_blocks_before"] > 1 and sc["evictions"] >= ec
    assert all(isinstance(v, bool) for v in r["targets_met"].values())
    assert "eviction_collateral <= 1" in r["targets_met"]


def test_batched_section(result):
    r, _ = result
    bt = r["batched"]
    assert set(BATCHED) | {"kv_bytes"} <= set(bt)
    assert set(bt["kv_bytes"]) == set(BATCHED)
    for k in BATCHED:
        for v in (bt[k], bt["kv_bytes"][k]):
            assert isinstance(v, (int, float)) and not isinstance(v, bool), k
            assert math.isfinite(v) and v > 0, k
        assert len(bt["samples"][k]) == bt["repeats"]
    assert bt["sessions"] == 4 and bt["steps"] == 8  # tiny mode stays small
    # one copy of the shared prefix: fedkv holds less than the padded HF batch
    # the same blocks, plus the batch's tail buffer
    assert bt["kv_bytes"]["fedkv_batched"] > bt["kv_bytes"]["fedkv_sequential"]
    assert bt["kv_bytes"]["fedkv_batched"] < bt["kv_bytes"]["hf_batched"]
    assert bt["kv_bytes_fedkv_vs_hf"] == pytest.approx(
        bt["kv_bytes"]["fedkv_batched"] / bt["kv_bytes"]["hf_batched"])
    assert 0.0 < bt["tokens_held_fedkv_vs_hf"] < 1.0
    # batched and one-at-a-time decode feed the same greedy tokens
    assert bt["tokens_agree"] is True
    assert {"fedkv_batched >= 3x hf_batched", "batched kv_bytes fedkv <= 1/8 hf"} <= set(
        r["targets_met"])


def test_uses_only_the_public_cache_api():
    src = (ROOT / "experiments" / "bench_kv.py").read_text()
    for private in ("kv.pool", "kv.fresh", "kv.layout", "kv._", ".pool.", "._sessions"):
        assert private not in src, private


def test_bad_flags_rejected():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_kv", "--tiny", "--block-size", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert proc.returncode != 0


def test_restore_vs_recompute_section(result):
    r = result[0]["restore_vs_recompute"]
    for key in ("warm_speedup", "cold_speedup", "cold_speedup_incl_open"):
        assert r[key] is not None and r[key] > 0
    assert set(r["seconds_median"]) == {"recompute", "warm", "cold", "cold_open"}
    assert r["prefix_tokens"] > 0 and len(r["samples"]["warm"]) == r["repeats"]
