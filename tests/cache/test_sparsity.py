"""KV sparsification policies (cache.sparsity): what each keeps, monotone drops, argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.sparsity import (
    POLICY_NAMES, SlidingWindow, SparsityPolicy, TimeDecay, TopKRetention, policy_for,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def one_hot_attn(n: int, focus: int, heads: int = 2, weight: float = 1.0) -> torch.Tensor:
    """[heads, 1, n]: one query putting ``weight`` on ``focus`` and the rest evenly elsewhere."""
    attn = torch.full((heads, 1, n), (1.0 - weight) / max(1, n - 1))
    attn[:, :, focus] = weight
    return attn


def uniform_attn(n: int, heads: int = 2, queries: int = 1) -> torch.Tensor:
    return torch.full((heads, queries, n), 1.0 / n)


def decode(policy: SparsityPolicy, n_steps: int, attn_at=uniform_attn, layer: int = 0) -> list[torch.Tensor]:
    """One query per step, like a decode loop; returns every step's keep mask."""
    masks = []
    for n in range(1, n_steps + 1):
        policy.observe(layer, attn_at(n))
        masks.append(policy.keep(layer, n))
    return masks


# ---- sliding window ---------------------------------------------------------------------------

def test_window_keeps_exactly_sinks_plus_window():
    keep = SlidingWindow(window=5, sinks=2).keep(0, 20)
    assert keep.dtype == torch.bool and keep.shape == (20,)
    assert torch.nonzero(keep).flatten().tolist() == [0, 1, 15, 16, 17, 18, 19]


def test_window_keeps_everything_while_short():
    assert SlidingWindow(window=8, sinks=4).keep(0, 10).all()


def test_window_without_sinks_is_a_plain_window():
    keep = SlidingWindow(window=3, sinks=0).keep(0, 10)
    assert torch.nonzero(keep).flatten().tolist() == [7, 8, 9]


def test_window_drops_are_monotone_across_steps():
    masks = decode(SlidingWindow(window=4, sinks=1), 30)
    for before, after in zip(masks, masks[1:]):
        assert not (after[: before.numel()] & ~before).any()


# ---- top-k retention (H2O) ----------------------------------------------------------------------

def test_topk_keeps_the_highest_attention_positions():
    n, heavy = 40, {7, 13, 21}
    policy = TopKRetention(budget=len(heavy) + 2 + 4, recent=4, sinks=2)

    def attn_at(m: int) -> torch.Tensor:
        a = torch.full((2, 1, m), 0.01)
        for h in heavy:
            if h < m:
                a[:, :, h] = 1.0
        return a / a.sum(-1, keepdim=True)

    keep = decode(policy, n, attn_at)[-1]
    kept = set(torch.nonzero(keep).flatten().tolist())
    assert kept == {0, 1} | heavy | set(range(n - 4, n))


def test_topk_keeps_everything_within_budget():
    policy = TopKRetention(budget=12, recent=4, sinks=2)
    assert all(m.all() for m in decode(policy, 12))
    assert int(decode(TopKRetention(budget=12, recent=4, sinks=2), 13)[-1].sum()) == 12


def test_topk_never_resurrects_a_dropped_position():
    policy = TopKRetention(budget=6, recent=2, sinks=1)
    decode(policy, 10)
    dropped = ~policy.keep(0, 10)
    assert dropped.any()
    # now all attention lands on the dropped positions: they must stay dropped
    attn = torch.zeros(2, 1, 11)
    attn[:, :, torch.nonzero(dropped).flatten()] = 1.0
    policy.observe(0, attn / attn.sum(-1, keepdim=True))
    assert not (policy.keep(0, 11)[:10] & dropped).any()


def test_layers_are_independent():
    policy = TopKRetention(budget=6, recent=2, sinks=1)
    decode(policy, 20, lambda m: one_hot_attn(m, focus=min(m - 1, 5)), layer=0)
    decode(policy, 20, lambda m: one_hot_attn(m, focus=min(m - 1, 9)), layer=1)
    assert policy.keep(0, 20)[5] and not policy.keep(0, 20)[9]
    assert policy.keep(1, 20)[9] and not policy.keep(1, 20)[5]


def test_scores_grow_when_n_jumps_past_the_last_observation():
    policy = TopKRetention(budget=5, recent=2, sinks=1)
    policy.observe(0, one_hot_attn(4, focus=2))
    keep = policy.keep(0, 9)  # five new positions nobody has attended yet
    assert keep.shape == (9,) and int(keep.sum()) == 5 and keep[2]


# ---- time decay ---------------------------------------------------------------------------------

def observe_only(policy: SparsityPolicy, n_steps: int, attn_at) -> torch.Tensor:
    """Observe one query per step without dropping anything, then ask once what stays."""
    for n in range(1, n_steps + 1):
        policy.observe(0, attn_at(n))
    return policy.keep(0, n_steps)


def old_burst_then_recent(old: int, new: int, n: int):
    """Queries old+1..old+5 look at ``old`` (5 units in all); the last 3 queries put 0.9 on
    ``new`` (2.7 units, plus the 1 unit of its own step); every other query looks at itself."""
    def attn_at(m: int) -> torch.Tensor:
        if old < m - 1 <= old + 5:
            return one_hot_attn(m, old)
        if m > n - 3:
            return one_hot_attn(m, new, weight=0.9)
        return one_hot_attn(m, m - 1)
    return attn_at


def test_time_decay_prefers_recent_attention_over_old():
    n, old, new = 40, 5, 20
    attn_at = old_burst_then_recent(old, new, n)
    keep_decay = observe_only(TimeDecay(budget=2, half_life=2.0, recent=1, sinks=0), n, attn_at)
    keep_plain = observe_only(TopKRetention(budget=2, recent=1, sinks=0), n, attn_at)
    assert keep_decay[new] and not keep_decay[old]
    assert keep_plain[old] and not keep_plain[new]  # the control: without decay the burst wins


def test_time_decay_weighs_queries_in_one_batch_by_age():
    # one observe() with 2 queries: the newer query's target must outscore the older one's
    attn = torch.zeros(1, 2, 6)
    attn[0, 0, 1] = 1.0
    attn[0, 1, 2] = 1.0
    policy = TimeDecay(budget=3, half_life=1.0, recent=2, sinks=0)
    policy.observe(0, attn)
    keep = policy.keep(0, 6)
    assert keep[2] and not keep[1]


def test_time_decay_with_huge_half_life_matches_topk():
    attn_at = old_burst_then_recent(5, 20, 40)
    a = observe_only(TimeDecay(budget=3, half_life=1e12, recent=1, sinks=1), 40, attn_at)
    b = observe_only(TopKRetention(budget=3, recent=1, sinks=1), 40, attn_at)
    assert torch.equal(a, b)


# ---- policy_for ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8, 1.0])
def test_policy_for_keeps_the_fraction_at_full_context(name: str, fraction: float):
    context = 64
    policy = policy_for(name, fraction, context)
    assert isinstance(policy, SparsityPolicy)
    keep = decode(policy, context)[-1]
    assert int(keep.sum()) == round(fraction * context)


def test_policy_for_builds_the_named_class():
    assert isinstance(policy_for("window", 0.5, 256), SlidingWindow)
    assert type(policy_for("topk", 0.5, 256)) is TopKRetention
    decay = policy_for("decay", 0.5, 256, half_life=10)
    assert isinstance(decay, TimeDecay) and decay.half_life == 10.0


# ---- bad arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: SlidingWindow(window=0), "window"),
    (lambda: SlidingWindow(window=4, sinks=-1), "sinks"),
    (lambda: SlidingWindow(window=2.5), "window must be an int"),
    (lambda: TopKRetention(budget=0), "budget"),
    (lambda: TopKRetention(budget=10, recent=8, sinks=4), "cannot hold"),
    (lambda: TopKRetention(budget=10, recent=-1, sinks=0), "recent"),
    (lambda: TimeDecay(budget=32, half_life=0), "half_life"),
    (lambda: TimeDecay(budget=32, half_life=float("nan")), "half_life"),
    (lambda: TimeDecay(budget=32, half_life=float("inf")), "half_life"),
    (lambda: policy_for("lru", 0.5, 64), "unknown sparsity policy"),
    (lambda: policy_for("topk", 0.0, 64), "kept_fraction"),
    (lambda: policy_for("topk", 1.5, 64), "kept_fraction"),
    (lambda: policy_for("topk", 0.5, 0), "context"),
])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("policy", [SlidingWindow(window=4), TopKRetention(budget=24),
                                    TimeDecay(budget=24, half_life=8.0)])
def test_bad_calls_raise_value_error(policy):
    with pytest.raises(ValueError, match="attn"):
        policy.observe(0, torch.ones(3, 3))
    with pytest.raises(ValueError, match="layer"):
        policy.keep(-1, 3)
    policy.keep(0, 8)
    with pytest.raises(ValueError, match="positions only grow"):
        policy.keep(0, 5)


def test_attention_over_fewer_positions_than_seen_is_rejected():
    policy = TopKRetention(budget=24)
    policy.observe(0, uniform_attn(10))
    with pytest.raises(ValueError, match="positions only grow"):
        policy.observe(0, uniform_attn(9))


# ---- properties ---------------------------------------------------------------------------------

@st.composite
def heavy_hitter_policies(draw):
    sinks = draw(st.integers(0, 4))
    recent = draw(st.integers(0, 6))
    budget = draw(st.integers(max(1, sinks + recent), 20))
    if draw(st.booleans()):
        return TopKRetention(budget=budget, recent=recent, sinks=sinks)
    return TimeDecay(budget=budget, recent=recent, sinks=sinks,
                     half_life=draw(st.floats(0.5, 100.0)))


@settings(max_examples=60, deadline=None)
@given(policy=heavy_hitter_policies(), steps=st.integers(1, 50), seed=st.integers(0, 2**16),
       batch=st.integers(1, 4))
def test_budget_sinks_recent_and_monotone_hold_for_any_attention(policy, steps, seed, batch):
    g = torch.Generator().manual_seed(seed)
    n, previous = 0, torch.ones(0, dtype=torch.bool)
    for _ in range(steps):
        n += int(torch.randint(1, batch + 1, (1,), generator=g))
        t = min(n, batch)
        attn = torch.softmax(3 * torch.randn(2, t, n, generator=g), dim=-1)
        policy.observe(0, attn)
        keep = policy.keep(0, n)
        assert keep.shape == (n,)
        assert not (keep[: previous.numel()] & ~previous).any(), "a dropped position came back"
        if n > policy.budget:
            assert int(keep.sum()) <= policy.budget
        assert keep[: min(policy.sinks, n)].all(), "a sink was dropped"
        assert keep[max(0, n - policy.recent):].all(), "one of the newest was dropped"
        previous = keep


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 12), sinks=st.integers(0, 4), n=st.integers(1, 60))
def test_window_keeps_min_of_n_and_its_size(window, sinks, n):
    keep = decode(SlidingWindow(window=window, sinks=sinks), n)[-1]
    assert int(keep.sum()) == min(n, window + sinks)
    assert keep[: min(sinks, n)].all() and keep[max(0, n - window):].all()
