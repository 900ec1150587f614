"""The prefetch experiment: the quick replay on a small synthetic trace in Mooncake's format
(outputs, JSON last, every mode vs none), the replay's bookkeeping invariants, the tier model's
capacity, a missing trace, and the real Mooncake trace when ``$FEDKV_SERVE_TRACE`` names one."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from cache.prefetch import PREFETCH_MODES, PrefetchLedger
from experiments import prefetch as pf
from experiments.eviction import load_trace, unique_blocks
from node.tasks.workload import find_trace

MOONCAKE = find_trace() or Path("no-trace")  # $FEDKV_SERVE_TRACE: a Mooncake trace, when given


def write_conversations(path: Path, requests: int = 200, seed: int = 0) -> Path:
    """Mooncake-format lines: multi-turn chats behind one shared system block (id 0); each
    turn re-sends the chat so far plus 1-3 new blocks; a few one-off requests in between."""
    rng = random.Random(seed)
    fresh = iter(range(1, 10**6))
    chats: list[list[int]] = []
    with path.open("w") as fh:
        for t in range(requests):
            if rng.random() < 0.1:
                ids = [0] + [next(fresh) for _ in range(rng.randint(2, 6))]
            else:
                if not chats or rng.random() < 0.2:
                    chats.append([0])
                chat = rng.choice(chats[-12:])
                chat.extend(next(fresh) for _ in range(rng.randint(1, 3)))
                ids = list(chat)
            fh.write(json.dumps({"timestamp": t, "input_length": 512 * len(ids),
                                 "output_length": 100, "hash_ids": ids}) + "\n")
    return path


def test_quick_replay_writes_outputs_and_prints_every_mode_last(tmp_path, capsys):
    trace = write_conversations(tmp_path / "chats.jsonl")
    res = pf.main(["--trace", str(trace), "--quick", "--json", "--out", str(tmp_path / "out")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(printed["modes"]) == set(PREFETCH_MODES)
    for mode, d in printed["modes"].items():
        assert {"stalls", "accuracy", "wasted_fraction", "stall_reduction"} <= set(d), mode
    none, seq = printed["modes"]["none"], printed["modes"]["sequential"]
    assert none["stalls"] > 50 and none["issued"] == 0 and none["accuracy"] is None
    # a chat re-reads its history in order: the chain prefetcher removes most of the stalls
    assert seq["stalls"] < none["stalls"] / 2 and seq["wasted_fraction"] < 0.3
    assert printed["target"]["met"] == (printed["target"]["best_stall_reduction"] >= 0.5
                                        and printed["target"]["best_wasted_fraction"] <= 0.3)
    run = Path(res["run_dir"])
    rows = list(csv.DictReader((run / "points.csv").open()))
    assert list(rows[0]) == pf.COLUMNS and [r["mode"] for r in rows][0] == "none"
    assert "Target" in (run / "summary.md").read_text()
    assert (run / "stalls.png").stat().st_size > 1000
    assert json.loads((run / "results.json").read_text())["modes"] == printed["modes"]


keys = st.integers(0, 30).map(lambda i: i.to_bytes(2, "little"))


@settings(max_examples=40, deadline=None)
@given(trace=st.lists(st.lists(keys, min_size=1, max_size=8), min_size=1, max_size=40),
       mode=st.sampled_from(["none", "sequential", "heat", "hybrid"]),
       hot=st.integers(1, 6), warm=st.integers(0, 6), latency=st.integers(1, 3))
def test_every_access_is_a_hit_a_stall_or_a_compute_and_every_prefetch_is_settled(
        trace, mode, hot, warm, latency):
    r = pf.replay(trace, pf.TierModel(hot, warm, latency=latency), mode)
    assert r.hits + r.stalls + r.computed == r.accesses == sum(map(len, trace))
    assert r.computed == unique_blocks(trace)  # cold keeps everything: computed once each
    led = r.ledger
    assert led.issued == led.used + led.wasted and not led.pending
    assert r.late <= led.used


def test_prefetched_blocks_take_hot_room_and_their_eviction_is_waste():
    led = PrefetchLedger()
    tiers = pf.TieredBlocks(pf.TierModel(hot_blocks=2, warm_blocks=1), led)
    for k in (b"a", b"b", b"c", b"d"):
        tiers.bring_in(k)
    assert tiers.hot == {b"c", b"d"} and tiers.tier_of(b"b") == "warm"
    assert tiers.tier_of(b"a") == "cold"
    tiers.bring_in(b"a")  # a prefetch: evicts c, the LRU one
    led.issue(b"a", 1)
    assert tiers.hot == {b"d", b"a"}
    tiers.bring_in(b"e")
    tiers.bring_in(b"f")  # a leaves hot unused
    assert len(tiers.hot) == 2 and led.wasted == 1


def test_a_missing_trace_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(pf.TraceNotFoundError, match="trace not found"):
        pf.resolve_trace(str(tmp_path / "nope.jsonl"))
    with pytest.raises(SystemExit):
        pf.main(["--trace", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)])
    assert "trace not found" in capsys.readouterr().err
    assert not (tmp_path / "prefetch").exists()


@pytest.mark.parametrize("flag", [["--degree", "0"], ["--hot-frac", "1.5"], ["--latency", "0"]])
def test_bad_flags_are_refused(tmp_path, flag):
    trace = write_conversations(tmp_path / "t.jsonl", requests=5)
    with pytest.raises(SystemExit):
        pf.main(["--trace", str(trace), "--out", str(tmp_path), *flag])


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="no Mooncake trace ($FEDKV_SERVE_TRACE)")
def test_on_the_mooncake_conversation_trace_sequential_removes_most_stalls(tmp_path, capsys):
    res = pf.main(["--trace", str(MOONCAKE), "--limit", "200", "--modes", "none", "sequential",
                   "--out", str(tmp_path)])
    seq = res["modes"]["sequential"]
    assert res["modes"]["none"]["stalls"] > 100
    assert seq["stall_reduction"] > 0.5 and seq["wasted_fraction"] < 0.3
    assert len(load_trace(MOONCAKE, 200)) == res["requests"] == 200
