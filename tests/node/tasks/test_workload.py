"""The serving workload: shapes from a Mooncake-format trace or synthetic, always in context."""

import json

import pytest

from node.tasks.workload import WorkloadConfig, load_conversations, plan_turns

HELDOUT = bytes(range(32, 127)) * 20


def _trace(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return p


def test_a_trace_groups_requests_into_conversations_by_their_first_two_blocks(tmp_path):
    p = _trace(tmp_path, [
        {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 300, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 3, "input_length": 50, "output_length": 5, "hash_ids": [0, 9]},
    ])
    convs = load_conversations(p)
    assert [c.turns for c in convs] == [[(100, 10), (190, 20)], [(50, 5)]]


def test_turns_interleave_sessions_and_fit_the_context(tmp_path):
    cfg = WorkloadConfig(sessions=3, max_turns=3, max_reply=8, context_budget=72)
    turns = plan_turns(cfg, HELDOUT, seed=1)
    assert {t.session for t in turns} == {0, 1, 2}
    firsts = [next(i for i, t in enumerate(turns) if t.session == s) for s in range(3)]
    assert firsts == [0, 1, 2]  # turn 1 of every session arrives before any turn 2
    for s in range(3):
        mine = [t for t in turns if t.session == s]
        assert sum(len(t.text) + t.reply_bytes for t in mine) <= 72
        assert all(t.text and t.text in HELDOUT and 1 <= t.reply_bytes <= 8 for t in mine)


def test_the_same_seed_gives_the_same_workload_and_a_trace_shapes_it(tmp_path):
    rows = [{"timestamp": i, "input_length": 1000 * (i + 1), "output_length": 10,
             "hash_ids": [0, 1] + list(range(2, 3 + i))} for i in range(4)]
    p = _trace(tmp_path, rows)
    cfg = WorkloadConfig(sessions=2, max_turns=4)
    a, b = plan_turns(cfg, HELDOUT, 7, p), plan_turns(cfg, HELDOUT, 7, p)
    assert a == b
    assert sum(t.session == 0 for t in a) == 4  # the one conversation has 4 turns


def test_bad_workloads_are_refused(tmp_path):
    with pytest.raises(ValueError, match="invalid workload"):
        plan_turns(WorkloadConfig(sessions=-1), HELDOUT, 0)
    with pytest.raises(ValueError, match="no requests"):
        load_conversations(_trace(tmp_path, []))
