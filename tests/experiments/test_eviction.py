"""The eviction experiment: the generated run's outputs, Bélády as an upper bound, prefix hits
bounded by block hits, trace parsing, and the Mooncake reference figures (skipped without
``$FEDKV_SERVE_TRACE``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from cache.policy import POLICIES
from experiments import eviction as ev
from node.tasks.workload import find_trace

MOONCAKE = find_trace() or Path("no-trace")  # $FEDKV_SERVE_TRACE: a Mooncake trace, when given


@pytest.fixture(scope="module")
def small_trace() -> ev.Trace:
    return ev.generated_trace(ev.GenConfig(requests=400))


def test_generated_run_writes_outputs_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    res = ev.main(["--quick", "--json", "--limit", "500", "--workers", "1", "--out", str(tmp_path)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["capacities"] == res["capacities"] and len(printed["capacities"]) >= 4
    assert {"belady", "arc", "oracle_dead", *POLICIES} <= set(printed["policies"])
    for name, d in printed["policies"].items():
        assert len(d["block_hit"]) == len(d["prefix_hit"]) == len(printed["capacities"]), name
    assert set(printed["ratio_to_belady"]) == {*POLICIES, "oracle_dead"}
    assert "hybrid_vs_lru_block_hit_gain" in printed["claims"]
    assert "best_online_ge_arc_every_capacity" in printed["targets"]
    run = Path(res["run_dir"])
    rows = list(csv.DictReader((run / "points.csv").open()))
    assert list(rows[0]) == ev.COLUMNS and len(rows) == len(printed["policies"]) * len(printed["capacities"])
    assert "Bélády" in (run / "summary.md").read_text()
    assert (run / "hit_ratio.png").stat().st_size > 1000


def test_belady_bounds_every_policy_and_prefix_bounds_block(small_trace):
    caps = ev.default_capacities(small_trace)
    results = ev.run_all(small_trace, caps, [*POLICIES, *ev.OFFLINE])
    for c in caps:
        best = results["belady"][c]
        for name in [*POLICIES, "oracle_dead"]:
            r = results[name][c]
            assert r.block_hits <= best.block_hits, (name, c)
            assert r.prefix_hits <= r.block_hits, (name, c)
            assert r.accesses == best.accesses
    lru = [results["lru"][c].block_hit for c in caps]
    assert lru == sorted(lru) and lru[-1] > lru[0]  # more room, more hits


def test_belady_keeps_part_of_a_loop_lru_thrashes():
    """A 5-block loop in 4 slots: LRU never hits, MIN keeps 3 of the 5 blocks each turn."""
    loop = [[bytes([i])] for i in range(5)] * 6  # a 5-block loop in a 4-slot cache
    assert ev.simulate(loop, 4, "lru").block_hits == 0
    assert ev.belady(loop, 4).block_hits >= 18


def test_prefix_hit_stops_at_the_first_miss():
    a, b, c, d = (bytes([i]) for i in range(4))
    trace = [[a, b, c], [a, d, c]]  # second request: a hit, d miss, c hit
    r = ev.simulate(trace, 10, "lru")
    assert (r.block_hits, r.prefix_hits, r.accesses) == (2, 1, 6)


def test_lis_and_jsonl_parsing(tmp_path):
    lis = tmp_path / "t.lis"
    lis.write_text("10 3 0 0\n11 2 0 0\n")
    assert [len(r) for r in ev.load_trace(lis)] == [3, 2]
    assert ev.load_trace(lis)[1] == ev.load_trace(lis)[0][1:]
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"hash_ids": [0, 1, 2]}\n{"hash_ids": [0, 5]}\n')
    t = ev.load_trace(jl)
    assert t[0][0] == t[1][0] and t[1][1] not in t[0]


def test_dead_block_oracle_evicts_never_reused_blocks_first():
    a, b, c, d = (bytes([i]) for i in range(4))
    trace = [[a], [b], [c], [a]]  # b and c are never used again: a must survive in 2 slots
    assert ev.simulate(trace, 2, "lru").block_hits == 0
    r = ev.simulate(trace, 2, "oracle_dead", policy=ev.DeadBlockOracle(trace), batch=1)
    assert r.block_hits == 1


def test_requests_longer_than_the_cache_bypass():
    trace = [[bytes([i]) for i in range(10)]] * 2
    for name in POLICIES:
        r = ev.simulate(trace, 4, name)
        assert r.block_hits <= 4 and r.accesses == 20


@pytest.mark.skipif(not MOONCAKE.exists(), reason="no Mooncake trace ($FEDKV_SERVE_TRACE)")
def test_mooncake_reference_figures_at_1000_blocks():
    """The issue's plain-simulator figures: LRU / ARC / Bélády = 0.045 / 0.053 / 0.191. Our MIN
    keeps the running request's blocks (pinned) and so lands a little lower (0.179)."""
    trace = ev.load_trace(MOONCAKE)
    assert len(trace) > 12_000
    assert ev.simulate(trace, 1000, "lru").block_hit == pytest.approx(0.045, abs=0.005)
    assert ev.simulate(trace, 1000, "arc").block_hit == pytest.approx(0.053, abs=0.006)
    assert ev.belady(trace, 1000).block_hit == pytest.approx(0.191, abs=0.02)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="no Mooncake trace ($FEDKV_SERVE_TRACE)")
def test_mooncake_adaptive_beats_arc_on_a_slice():
    trace = ev.load_trace(MOONCAKE, limit=3000)
    cap = max(1, ev.unique_blocks(trace) // 50)
    assert ev.simulate(trace, cap, "adaptive").block_hits > ev.simulate(trace, cap, "arc").block_hits
