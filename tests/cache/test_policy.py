"""Eviction policies: the engine's contract (a set of evictable keys), each policy's order, the
hybrid's formula, ARC against a sequence worked by hand from Megiddo & Modha's algorithm, and
the adaptive policy choosing its half life."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.policy import (
    EVICT_BATCH, POLICIES, AdaptivePolicy, ARCPolicy, HybridPolicy, LFUPolicy, LRUPolicy,
    make_policy,
)


def k(x: object) -> bytes:
    return str(x).encode()


class Cache:
    """A tiny slot cache driving a policy the way the engine does (hit -> remove -> release)."""

    def __init__(self, policy, capacity: int) -> None:
        self.policy, self.capacity, self.cached = policy, capacity, set()
        self.hits = 0

    def access(self, key: bytes) -> None:
        if key in self.cached:
            self.hits += 1
            self.policy.hit(key)
            self.policy.remove(key)
        else:
            if len(self.cached) >= self.capacity:
                (v,) = self.policy.victims(1)
                self.policy.remove(v)
                self.cached.discard(v)
            self.cached.add(key)
        self.policy.insert(key)

    def run(self, keys) -> "Cache":
        for x in keys:
            self.access(k(x))
        return self


def test_registry_and_batch_constant():
    assert set(POLICIES) == {"lru", "lfu", "hybrid", "arc", "adaptive"}
    assert EVICT_BATCH == 16
    for name in POLICIES:
        p = make_policy(name, 64)
        p.insert(k("a"), parent=None)
        assert k("a") in p and len(p) == 1
    assert isinstance(make_policy("lru", 8), LRUPolicy)
    with pytest.raises(ValueError):
        make_policy("mru", 8)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victims_contract(name):
    p = make_policy(name, 8)
    for x in "abcdef":
        p.insert(k(x))
    p.remove(k("c"))
    p.hit(k("zz"))  # a hit on a key never inserted (referenced elsewhere) is no candidate
    got = p.victims(EVICT_BATCH)
    assert len(got) == 5 and len(set(got)) == 5
    assert set(got) == {k(x) for x in "abdef"}
    assert p.victims(2) == got[:2]  # best first, nothing removed by asking
    assert len(p) == 5 and k("c") not in p
    assert p.victims(0) == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_chain_tail_before_root(name):
    """Released tail first (the engine's order), a fresh chain leaves tail first."""
    p = make_policy(name, 64)
    chain = [k(i) for i in range(6)]
    for x, parent in zip(reversed(chain), reversed([None, *chain[:-1]])):
        p.insert(x, parent=parent)
    assert p.victims(6) == chain[::-1]


def test_lfu_order_and_recency_ties():
    p = LFUPolicy()
    c = Cache(p, 10).run(["a", "b", "c", "d", "b", "b", "c"])
    assert c.hits == 3
    # a, d once (a older), c twice, b three times
    assert p.victims(4) == [k("a"), k("d"), k("c"), k("b")]


def test_lfu_counts_survive_eviction():
    p = LFUPolicy()
    Cache(p, 2).run(["a", "a", "a", "b", "c", "a"])  # a evicted? no: b goes, a is frequent
    assert k("a") in p and p.victims(1) != [k("a")]


def test_hybrid_formula_on_a_small_example():
    p = HybridPolicy(half_life=2.0)
    p.insert(k("a"))  # tick 1: a's first use (a miss)
    p.insert(k("b"))  # tick 2
    p.hit(k("a"))     # tick 3: a used again
    assert p.score(k("a")) == pytest.approx(2 ** (-(3 - 1) / 2) + 1)  # 1.5
    assert p.score(k("b")) == pytest.approx(2 ** (-(3 - 2) / 2))
    p.remove(k("a"))
    p.insert(k("a"))  # tick 4: released; the access was counted by hit
    assert p.score(k("a")) == pytest.approx(1.5 * 2 ** -0.5)
    assert p.score(k("b"), at=4) == pytest.approx(0.5)
    assert p.victims(2) == [k("b"), k("a")]


def test_hybrid_interpolates_lru_and_lfu():
    seq = ["a", "a", "a", "b", "c"]  # a frequent but old; c most recent
    lfu_like = HybridPolicy(half_life=1e9)
    lru_like = HybridPolicy(half_life=0.1)
    Cache(lfu_like, 10).run(seq)
    Cache(lru_like, 10).run(seq)
    assert lfu_like.victims(3) == [k("b"), k("c"), k("a")]
    assert lru_like.victims(3) == [k("a"), k("b"), k("c")]


def arc_state(p: ARCPolicy) -> tuple:
    names = lambda d: "".join(x.decode() for x in d)  # noqa: E731
    return names(p.t1), names(p.t2), names(p.b1), names(p.b2), p.p


def test_arc_worked_example_from_the_paper():
    """c = 4, derived by hand from ARC(c) in Megiddo & Modha (FAST 2003, Fig. 4); lists LRU
    first. The engine evicts before it admits, so REPLACE sees p before a ghost hit adapts it;
    the sequence below gives the same result either way."""
    p = ARCPolicy(4)
    c = Cache(p, 4)
    c.run("ab")
    assert arc_state(p) == ("ab", "", "", "", 0.0)
    c.run("a")  # hit in T1 -> T2
    assert arc_state(p) == ("b", "a", "", "", 0.0)
    c.run("cd")
    c.run("e")  # case IV: |T1| = 3 > p = 0 -> T1's LRU b to B1
    assert arc_state(p) == ("cde", "a", "b", "", 0.0)
    c.run("b")  # case II, ghost hit in B1: p += max(|B2|/|B1|, 1) = 1; c to B1; b to T2
    assert arc_state(p) == ("de", "ab", "c", "", 1.0)
    c.run("fghi")  # a scan: T1 churns, B1 trimmed to |T1| + |B1| <= c, T2 untouched
    assert arc_state(p) == ("hi", "ab", "fg", "", 1.0)
    c.run("h")  # hit in T1 -> T2; now |T1| = 1 <= p
    c.run("j")  # case IV: REPLACE takes T2's LRU a (|T1| = 1 is not > p = 1)
    assert arc_state(p) == ("ij", "bh", "fg", "a", 1.0)
    c.run("a")  # case III, ghost hit in B2: p -= max(|B1|/|B2|, 1) -> 0; i to B1
    assert arc_state(p) == ("j", "bha", "fgi", "", 0.0)
    assert c.hits == 2  # a and h; ghost hits are misses


def test_arc_scan_does_not_flush_t2():
    p = ARCPolicy(8)
    c = Cache(p, 8)
    c.run(["h1", "h2", "h3", "h1", "h2", "h3"])
    c.run([f"s{i}" for i in range(100)])  # one long scan
    assert {k("h1"), k("h2"), k("h3")} <= set(p.t2)
    lru = Cache(LRUPolicy(), 8).run(["h1", "h2", "h3", "h1", "h2", "h3"] + [f"s{i}" for i in range(100)])
    assert not ({k("h1"), k("h2"), k("h3")} & lru.cached)


def test_arc_referenced_keys_are_not_ghosts():
    p = ARCPolicy(4)
    p.insert(k("a"))
    p.hit(k("a"))
    p.remove(k("a"))  # referenced again after the hit: resident, not a candidate
    assert k("a") in p.t2 and k("a") not in p and not p.b2
    p.remove(k("a"))  # now freed
    assert k("a") in p.b2 and k("a") not in p.t2


def _phases(n_phases: int, size: int, reps: int) -> list[str]:
    """Working sets that change: recency wins, stale frequency loses."""
    return [f"p{ph}-{i}" for ph in range(n_phases) for _ in range(reps) for i in range(size)]


def _hot_and_scan(n: int) -> list[str]:
    """A small hot set among a stream of one-off keys: frequency wins."""
    out = []
    for i in range(n):
        out += [f"hot{i % 40}", f"scan{i}a", f"scan{i}b", f"scan{i}c"]
    return out


def test_adaptive_goes_frequency_heavy_when_frequency_wins():
    p = AdaptivePolicy(capacity=64, sample_rate=1.0, window=200, start=0)  # starts LRU-like
    hits = Cache(p, 64).run(_hot_and_scan(3000)).hits
    assert p.half_life >= 8 * 64
    assert hits > 0.9 * Cache(LFUPolicy(), 64).run(_hot_and_scan(3000)).hits
    assert Cache(LRUPolicy(), 64).run(_hot_and_scan(3000)).hits == 0


def test_adaptive_leaves_lfu_when_working_sets_change():
    p = AdaptivePolicy(capacity=64, sample_rate=1.0, window=200, start=len(AdaptivePolicy.factors) - 1)
    Cache(p, 64).run(_phases(40, 48, 3))
    assert p.half_life <= 2 * 64


def test_adaptive_beats_lru_and_lfu_on_a_mixed_workload():
    seq = _hot_and_scan(1500) + _phases(20, 48, 3) + _hot_and_scan(1500)
    hits = {name: Cache(make_policy(name, 64), 64).run(seq).hits for name in ("lru", "lfu")}
    adaptive = Cache(AdaptivePolicy(capacity=64, sample_rate=1.0, window=200), 64).run(seq).hits
    assert adaptive > max(hits.values())


ops = st.lists(st.tuples(st.sampled_from(["insert", "remove", "hit", "victims"]),
                         st.integers(0, 7), st.integers(0, 10)), max_size=80)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(seq=ops)
def test_every_policy_is_a_set_of_evictable_keys(name, seq):
    p = make_policy(name, 4)
    model: set[bytes] = set()
    for op, x, n in seq:
        key = k(x)
        if op == "insert" and key not in model:  # the engine inserts only unreferenced keys
            p.insert(key, parent=k(n % 8) if n % 2 else None)
            model.add(key)
        elif op == "remove":
            p.remove(key)
            model.discard(key)
        elif op == "hit":
            p.hit(key)
        elif op == "victims":
            got = p.victims(n)
            assert len(got) == len(set(got)) == min(n, len(model))
            assert set(got) <= model
        assert len(p) == len(model)
        assert all((key in p) == (key in model) for key in map(k, range(8)))


def test_adaptive_evicts_leaves_before_their_roots():
    """With ``parent`` info a chain's leaf goes before the blocks it hangs from even when
    newer (a request's partial last block is never reproduced by a longer next turn)."""
    p = AdaptivePolicy(capacity=64)
    p.insert(k("leaf"), parent=k("mid"))  # the engine's order: tail first
    p.insert(k("mid"), parent=k("root"))
    p.insert(k("root"))
    p.insert(k("x"))  # newest, but nobody's parent: a leaf too
    assert p.victims(4) == [k("leaf"), k("x"), k("mid"), k("root")]
    q = AdaptivePolicy(capacity=64)
    q.insert(k("a"))
    q.insert(k("b"), parent=k("a"))  # a stops being a leaf: b (newer) goes first
    assert q.victims(2) == [k("b"), k("a")]
    r = AdaptivePolicy(capacity=64, leaf_penalty=0.0)
    r.insert(k("a"))
    r.insert(k("b"), parent=k("a"))
    assert r.victims(2) == [k("a"), k("b")]  # no penalty: plain recency
