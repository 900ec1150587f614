"""A node's serving pass: what it reports, under both stale-K/V policies."""

import math

import numpy as np
import pytest

from node.cache_node import SERVE_PROMPT, CacheNode, NodeSpec
from node.tasks.workload import WorkloadConfig

WORK = WorkloadConfig(sessions=3, max_turns=2)


def _write_back(node: CacheNode) -> None:
    delta = np.random.default_rng(node.version).normal(0, 0.05, node.layout.size)
    node.apply_mean_update(delta, node.version + 1)


@pytest.fixture(scope="module")
def node_pair():
    return CacheNode(NodeSpec(0, 5, "lm")), CacheNode(NodeSpec(0, 5, "lm", kv_stale_versions=1))


def test_invalidate_recomputes_the_prompt_after_a_write_back_and_serves_no_stale_kv(node_pair):
    node = node_pair[0]
    first = node.serve_between_rounds(WORK, seed=1)
    assert first.turns >= 3 and first.sessions == 3 and first.decode_tokens > 0
    assert first.recomputed_tokens == 0 and first.invalidated_blocks == 0
    # sessions 2 and 3 take the system prompt's full blocks from the prefix cache
    full = (len(SERVE_PROMPT) - 1) // 16 * 16
    assert first.prefix_hit_tokens == 2 * full
    assert math.isclose(first.ppl, first.ppl_fresh, rel_tol=1e-4)
    _write_back(node)
    after = node.serve_between_rounds(WORK, seed=2)
    assert after.invalidated_blocks > 0
    assert after.recomputed_tokens == full  # the prompt cached under the old version
    assert after.stale_tokens_served == 0
    assert math.isclose(after.ppl, after.ppl_fresh, rel_tol=1e-4)  # no stale K/V reached a token
    again = node.serve_between_rounds(WORK, seed=3)
    assert again.recomputed_tokens == 0 and again.invalidated_blocks == 0


def test_keep_1_serves_the_old_prompt_kv_and_shows_its_cost(node_pair):
    node = node_pair[1]
    node.serve_between_rounds(WORK, seed=1)
    _write_back(node)
    after = node.serve_between_rounds(WORK, seed=2)
    assert after.recomputed_tokens == 0 and after.invalidated_blocks == 0
    assert after.stale_tokens_served > 0
    assert after.ppl != after.ppl_fresh  # attention over K/V the new weights did not compute
    _write_back(node)  # two versions later the prompt's K/V are no longer servable
    later = node.serve_between_rounds(WORK, seed=3)
    assert later.invalidated_blocks > 0


def test_digits_serves_nothing_and_zero_sessions_serve_nothing():
    assert CacheNode(NodeSpec(0, 3, "digits")).serve_between_rounds(WORK) is None
