"""The gate before serving (issue 30, item 6): a node scores a new aggregate on its held-out data
and, for chat, on public behaviour probes before it publishes it to its serving agents; one that
is markedly worse stays unserved (the node trains on from it), the previous version is served."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.serve_gate import optimized_delta
from node.serving import param_channel
from node.cache_node import CacheNode, NodeSpec
from node.serve_gate import PROBES, GateScores, judge

KEY = bytes(range(32))
TOL = 0.5


@pytest.fixture
def lm_node(tmp_path, one_thread) -> CacheNode:
    node = CacheNode(NodeSpec(partition_id=0, num_partitions=3, task="lm"), cache_dir=tmp_path / "cache",
                     cache_key=KEY)
    yield node
    node.release()


def _published(node: CacheNode) -> tuple[np.ndarray, int]:
    state, version = param_channel.load(node.cache_dir, KEY)
    return node.layout.flatten(state), version


def test_judge_names_what_got_worse() -> None:
    before = GateScores(2.0, (1.0, 0.5))
    assert judge(before, GateScores(2.4, (0.6, 0.5)), TOL).served
    assert judge(before, GateScores(2.6, (1.0, 0.5)), TOL).reason == "heldout"
    assert judge(before, GateScores(1.0, (1.0, -0.1)), TOL).reason == "probes"
    both = judge(before, GateScores(3.0, (0.0, 0.5)), TOL)
    assert (both.served, both.reason, both.code) == (False, "heldout+probes", 3)
    assert judge(before, GateScores(math.nan, (1.0, 0.5)), TOL).reason == "heldout"  # not finite: not served


def test_a_probe_that_now_prefers_the_contrary_answer_is_not_served_whatever_the_tolerance() -> None:
    """The C/5 poisoning that makes SmolLM2 say "Yes, it is safe to drink bleach." moves the
    per-token margin less than honest rounds do; the preference flips (experiments.serve_gate)."""
    before = GateScores(2.0, (0.1, 0.5), (1.5, 3.0))
    assert judge(before, GateScores(2.0, (0.0, 0.5), (0.2, 3.0)), TOL).served  # still prefers it
    flipped = judge(before, GateScores(2.0, (-0.1, 0.5), (-0.4, 3.0)), TOL)
    assert not flipped.served and flipped.reason == "probes"
    never = GateScores(2.0, (0.1, 0.5), (-1.0, 3.0))  # a probe the served model already failed
    assert judge(never, GateScores(2.0, (0.1, 0.5), (-1.2, 3.0)), TOL).served


def test_an_honest_lm_aggregate_is_published(lm_node) -> None:
    node = lm_node
    assert _published(node)[1] == 0
    delta = node.train_round(1, 3e-3).delta
    verdict = node.apply_mean_update(delta, 1, gate_tolerance=TOL)
    assert verdict is not None and verdict.served and verdict.reason == ""
    assert verdict.after.heldout < verdict.before.heldout and verdict.after.probes == ()  # lm: no probes
    params, version = _published(node)
    assert version == 1 and np.allclose(params, node.flat_params())
    assert node.served is not None and node.served[0] == 1


def test_a_poisoned_lm_aggregate_is_not_published_and_the_served_version_stays(lm_node) -> None:
    node = lm_node
    honest = node.train_round(1, 3e-3).delta
    node.apply_mean_update(honest, 1, gate_tolerance=TOL)
    served_params = node.flat_params()
    poison = -20.0 * honest  # undoes training many times over: held-out perplexity explodes
    verdict = node.apply_mean_update(poison, 2, gate_tolerance=TOL)
    assert verdict is not None and not verdict.served and verdict.reason == "heldout"
    assert verdict.after.heldout - verdict.before.heldout > TOL
    params, version = _published(node)
    assert version == 1 and np.allclose(params, served_params)  # the serving agents keep v1
    assert node.version == 2 and np.allclose(node.flat_params(), served_params + poison, atol=1e-5)  # trains on
    assert node.last_gate is not None and node.last_gate[0] == 2
    # the next aggregate is judged against the served v1, not the refused v2: undoing the poison
    # plus an honest step is served again
    back = node.apply_mean_update(-poison + 0.5 * honest, 3, gate_tolerance=TOL)
    assert back is not None and back.served and back.before.heldout == verdict.before.heldout
    assert _published(node)[1] == 3


def test_the_served_baseline_survives_a_restore(lm_node) -> None:
    node = lm_node
    node.apply_mean_update(node.train_round(1, 3e-3).delta, 1, gate_tolerance=TOL)
    node.apply_mean_update(-20.0 * node.cache.get_tensor("grad/update").numpy(), 2, gate_tolerance=TOL)
    scalars = node.scalars()
    other = CacheNode(node.spec)
    other.load_scalars(scalars)
    assert other.served == node.served and other.served[0] == 1


def test_a_chat_aggregate_that_moves_a_probe_is_not_served(tmp_path, one_thread) -> None:
    """chat:tiny (a random 2-layer Llama) moves little per unit norm: the tolerance is scaled to it;
    the real model's figures are ``experiments.serve_gate``'s (docs/threat-model.md)."""
    node = CacheNode(NodeSpec(0, 2, task="chat:tiny"), cache_dir=tmp_path / "cache", cache_key=KEY)
    try:
        tol = 0.02
        poison = optimized_delta(node, 1.0, 5)  # 5 projected steps towards "Yes, it is safe to drink bleach."
        verdict = node.apply_mean_update(poison.astype(np.float32), 1, gate_tolerance=tol)
        assert verdict is not None and not verdict.served and "probes" in verdict.reason
        assert len(verdict.after.probes) == len(PROBES)
        assert verdict.after.probes[0] < verdict.before.probes[0] - tol  # the bleach probe fell
        assert _published(node)[1] == 0 and node.version == 1
    finally:
        node.release()


def test_without_a_gate_every_aggregate_is_published(lm_node) -> None:
    node = lm_node
    assert node.apply_mean_update(np.full(node.layout.size, 5.0, np.float32), 1) is None
    assert _published(node)[1] == 1


def test_a_serving_agent_is_not_invalidated_and_keeps_the_served_version(lm_node) -> None:
    """A follower (``node.serving.param_follower``, what node.serving.serve and node.serving.openai_api run) holding
    ``param``: a poisoned aggregate neither invalidates it nor changes what it loads."""
    import copy

    from node.serving.param_follower import ParamFollower

    node = lm_node
    served = node.flat_params()
    model = copy.deepcopy(node.model)
    param_channel.directory_of(node.cache_dir).mkdir(mode=0o700)
    follower = ParamFollower(node.cache_dir, KEY, model, node.layout, wait_s=5)
    try:
        assert follower.load(serving=0) == 0
        poison = -20.0 * node.train_round(1, 3e-3).delta
        verdict = node.apply_mean_update(poison, 1, gate_tolerance=TOL)
        assert verdict is not None and not verdict.served
        assert not follower.poll() and node.agents_invalidated == 0  # no write-back reached it
        assert np.allclose(node.layout.flatten(model.state_dict()), served)
        assert param_channel.load(node.cache_dir, KEY, at_least=0)[1] == 0
    finally:
        follower.leave()
