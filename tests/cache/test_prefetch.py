"""Prefetch engine (issue 11 item 2): each mode on synthetic access streams whose right answer
is known, the accounting, bad arguments, and prefetching into a real KVCache with a warm tier
and a cold store (a prefetched block's match_prefix is a hot hit)."""

from __future__ import annotations

import random

import pytest
import torch

from cache import KVCache
from cache.prefetch import (
    PREFETCH_MODES, AccuracyWindow, HeatPrefetcher, HybridPrefetcher, LstmConfig, LstmPrefetcher,
    NoPrefetch, PrefetchError, PrefetchLedger, SequentialPrefetcher, make_prefetcher,
    prefetch_after_lookup, prefetch_into_hot,
)
from cache.prefix import ROOT, block_hash
from tests.cache.conftest import feed, small_config


def chain(n: int, tag: str = "c") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


# == sequential ================================================================================
def test_sequential_predicts_the_next_blocks_of_a_chain_it_has_seen():
    p = SequentialPrefetcher(degree=2)
    keys = chain(20)
    for k in keys:  # first pass: nothing is known ahead of the chain's end
        p.observe(k)
        assert p.predict() == []
    for i, k in enumerate(keys[:-2]):  # the conversation comes back
        p.observe(k)
        assert p.predict() == keys[i + 1 : i + 3]


def test_sequential_stride_skips_ahead_and_resident_blocks_are_not_fetched():
    p = SequentialPrefetcher(degree=2, stride=3)
    keys = chain(20)
    for k in keys:
        p.observe(k)
    p.observe(keys[5])
    assert p.predict() == [keys[8], keys[9]]
    assert p.predict(resident={keys[8]}) == [keys[9]]
    p.observe(keys[18])  # two steps before the end: the window runs off the chain
    assert p.predict() == []


def test_sequential_follows_a_loop_once():
    p = SequentialPrefetcher(degree=4)
    for k in ["a", "b", "c", "a"]:
        p.observe(k)
    assert p.predict() == ["b", "c"]  # not round the loop again


# == heat ======================================================================================
def hot_set_stream(n: int, hot: list[str], share: float, seed: int = 0) -> list[str]:
    """``share`` of the accesses go to ``hot`` (uniformly), the rest to one-off blocks."""
    rng = random.Random(seed)
    return [rng.choice(hot) if rng.random() < share else f"once{i}" for i in range(n)]


def test_heat_predicts_the_hot_set_not_the_one_off_blocks():
    hot = chain(4, "h")
    p = HeatPrefetcher(degree=2, seed=1)
    preds = []
    for k in hot_set_stream(2000, hot, 0.5):
        p.observe(k)
        preds += p.predict()
    assert len(preds) > 1000
    assert sum(k in hot for k in preds) / len(preds) > 0.99  # blocks used once never qualify


def test_heat_skips_resident_blocks_and_the_block_just_used():
    p = HeatPrefetcher(degree=2, sample=64)
    for k in ["x", "y", "z"] * 20:
        p.observe(k)
    assert sorted(p.predict()) == ["x", "y"]  # z was just accessed
    assert p.predict(resident={"x", "y"}) == []


def test_heat_table_and_sample_ring_stay_bounded():
    p = HeatPrefetcher(degree=1, history=100, recent=50)
    for i in range(500):
        p.observe(i)
    assert len(p.heat) == 100 and len(p._recent) == 50
    assert set(p._recent) == set(range(450, 500))


# == hybrid ====================================================================================
def test_hybrid_switches_to_the_mode_that_predicts_better():
    h = HybridPrefetcher(degree=2, seed=0)

    def run(stream):
        for k in stream:
            h.observe(k)
            h.predict()

    conv = chain(300)
    run(conv)
    run(conv)  # a replayed chain: sequential is right, heat is not
    assert h.active == "sequential"
    assert h.scores["sequential"].accuracy > 0.9
    run(hot_set_stream(600, chain(2, "h"), 0.5))  # a hot set among one-offs: heat wins
    assert h.active == "heat"
    assert h.scores["heat"].accuracy > h.scores["sequential"].accuracy
    run(conv)
    run(conv)
    assert h.active == "sequential" and h.switches >= 2


# == lstm ======================================================================================
def run_lstm(p: LstmPrefetcher, pattern: list[str], repeats: int) -> None:
    for _ in range(repeats):
        for k in pattern:
            p.observe(k)
            p.predict()


def test_lstm_learns_a_repeating_pattern_and_retrains_when_it_changes():
    p = LstmPrefetcher(degree=2, config=LstmConfig(seed=0))
    keys = chain(6, "k")
    run_lstm(p, keys, 60)
    assert p.trainings == 1 and p.accuracy > 0.9  # 100 % measured; target > 70 %
    first = p.trainings
    run_lstm(p, [keys[i] for i in (0, 2, 4, 1, 3, 5)], 6)
    assert p.trainings > first  # its accuracy fell below 70 %: it retrained
    run_lstm(p, [keys[i] for i in (0, 2, 4, 1, 3, 5)], 60)
    assert p.accuracy > 0.7
    p.observe(keys[0])
    assert p.predict() == [keys[2], keys[4]]


def test_lstm_heads_predict_the_next_degree_blocks():
    p = LstmPrefetcher(degree=3, config=LstmConfig(seed=1))
    keys = chain(10, "k")
    run_lstm(p, keys, 30)
    p.observe(keys[2])
    assert p.predict() == keys[3:6]
    assert p.predict(resident={keys[4]}) == [keys[3], keys[5]]


def test_lstm_on_an_unpredictable_stream_backs_off_instead_of_retraining_every_access():
    cfg = LstmConfig(seed=0, retrain_every=64, epochs=5)
    p = LstmPrefetcher(degree=2, config=cfg)
    rng = random.Random(0)
    keys = chain(200, "r")
    for _ in range(3000):
        p.observe(rng.choice(keys))
        p.predict()
    assert 2 <= p.trainings <= 8  # 64, 128, 256, ... apart; 46 without the back-off
    assert p.accuracy < 0.7


def test_lstm_training_leaves_the_global_torch_state_alone():
    torch.manual_seed(123)
    expect = torch.rand(3)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    p = LstmPrefetcher(degree=2)
    run_lstm(p, chain(5), 20)
    assert p.trainings >= 1
    assert torch.equal(torch.rand(3), expect) and torch.get_num_threads() == threads


# == accounting and arguments ==================================================================
def test_ledger_counts_used_wasted_and_leftover_bytes():
    led = PrefetchLedger()
    led.issue("a", 100)
    led.issue("b", 50)
    led.issue("a", 100)  # already pending: not issued twice
    assert led.access("a") and not led.access("a") and not led.access("zz")
    led.issue("c", 50)
    led.evicted("b")
    led.evicted("zz")  # never prefetched: nothing
    led.close()  # c was never used
    assert (led.issued, led.used, led.wasted) == (3, 1, 2)
    assert led.issued_bytes == 200 and led.used_bytes == 100 and led.wasted_bytes == 100
    assert led.accuracy == pytest.approx(1 / 3) and led.wasted_fraction == 0.5


def test_accuracy_window_counts_hits_within_the_horizon_only():
    w = AccuracyWindow(horizon=2, window=10)
    w.record(["a", "b"])
    for k in ["x", "a", "y"]:  # a within 2, b never: expires at the third access
        w.observe(k)
    assert list(w.results) == [True, False] and w.accuracy == 0.5


@pytest.mark.parametrize("mode", PREFETCH_MODES)
def test_make_prefetcher_builds_every_mode(mode):
    p = make_prefetcher(mode, degree=3)
    assert p.name == mode and p.degree == 3 and p.stats()["issued"] == 0


@pytest.mark.parametrize("make", [
    lambda: make_prefetcher("oracle"),
    lambda: make_prefetcher("sequential", degree=0),
    lambda: make_prefetcher("heat", degree=1.5),
    lambda: NoPrefetch(degree=True),
    lambda: SequentialPrefetcher(stride=0),
    lambda: SequentialPrefetcher(stride=1.5),
    lambda: HeatPrefetcher(sample=0),
    lambda: HeatPrefetcher(half_life=-1),
    lambda: HybridPrefetcher(margin=1.0),
    lambda: LstmConfig(threshold=1.5),
    lambda: LstmConfig(min_history=5),
    lambda: LstmConfig(epochs=0),
    lambda: AccuracyWindow(0, 10),
])
def test_bad_arguments_raise_prefetch_error(make):
    with pytest.raises(PrefetchError):
        make()


# == a live KVCache ============================================================================
BLOCK = 8
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 8 * 4  # small_config geometry, fp32


def cached_prompts(kv: KVCache, n: int) -> tuple[list[list[int]], list]:
    """``n`` one-block prompts computed and released (cached) in order."""
    prompts, written = [], []
    for i in range(n):
        p = list(range(BLOCK * i, BLOCK * i + BLOCK))
        s = kv.open_session()
        written.append(feed(kv, s, p, seed=i)[0])
        kv.close_session(s)
        prompts.append(p)
    return prompts, written


def tier_reads(kv: KVCache) -> tuple[int, int, int]:
    st = kv.blocks.tiers.stats
    return st.swaps_in, st.warm_hits, st.cold_hits


@pytest.fixture
def tiered(tmp_path):
    cfg = small_config(block_size=BLOCK, pool_bytes=64 << 10, warm_bytes=3 * BLOCK_BYTES,
                       low_watermark=0.0, cooldown_s=0.0)
    kv = KVCache.open(tmp_path / "cache", cfg)
    yield kv
    kv.release()


def test_a_prefetched_block_is_a_hot_hit_for_match_prefix(tiered):
    kv = tiered
    cap = kv.arena.num_blocks
    prompts, written = cached_prompts(kv, cap + 6)  # 6 demoted: 3 stay warm, 3 go cold
    hashes = [block_hash(ROOT, p, kv.version) for p in prompts]
    tiers = kv.blocks.tiers
    cold, warm = hashes[0], hashes[5]
    assert cold not in tiers.warm and cold in kv.store and warm in tiers.warm
    assert cold not in kv.blocks.index and warm not in kv.blocks.index
    led = PrefetchLedger()
    evictions = kv.stats()["evictions"]
    assert prefetch_into_hot(kv.blocks, [cold, warm, hashes[-1], b"never-seen"], led) == [cold, warm]
    assert led.issued == 2 and led.issued_bytes == 2 * BLOCK_BYTES
    assert kv.stats()["evictions"] == evictions + 2  # they took hot room from other blocks
    before = tier_reads(kv)
    for i in (0, 5):
        s = kv.open_session()
        assert kv.match_prefix(s, prompts[i] + [0]) == BLOCK
        assert torch.equal(kv.read(s, 1)[0], written[i][1])  # the right bytes, bit-exact
        kv.close_session(s)
    assert tier_reads(kv) == before  # no tier restore on the critical path


def test_the_hook_prefetches_the_rest_of_a_conversation_after_its_first_block(tiered):
    kv = tiered
    prompt = list(range(3 * BLOCK))
    s = kv.open_session()
    feed(kv, s, prompt)
    kv.close_session(s)
    hashes, parent = [], ROOT
    for i in range(3):
        hashes.append(block_hash(parent, prompt[i * BLOCK : (i + 1) * BLOCK], kv.version))
        parent = hashes[-1]
    p = SequentialPrefetcher(degree=2)
    assert prefetch_after_lookup(kv.blocks, p, hashes) == []  # learns the chain; all hot already
    assert kv.offload("cold") == 3
    s = kv.open_session()
    assert kv.match_prefix(s, prompt[:BLOCK] + [0]) == BLOCK  # the first block: a tier read
    kv.close_session(s)
    assert prefetch_after_lookup(kv.blocks, p, hashes[:1]) == hashes[1:]
    before = tier_reads(kv)
    s = kv.open_session()
    assert kv.match_prefix(s, prompt + [0]) == 3 * BLOCK
    assert tier_reads(kv) == before  # blocks 2 and 3 were already hot
    kv.close_session(s)
    prefetch_after_lookup(kv.blocks, p, hashes)
    assert p.ledger.used == 2 and p.ledger.wasted == 0


def test_an_unused_prefetch_that_leaves_hot_is_counted_wasted(tiered):
    kv = tiered
    prompts, _ = cached_prompts(kv, kv.arena.num_blocks + 2)
    h = block_hash(ROOT, prompts[0], kv.version)
    p = NoPrefetch()
    prefetch_into_hot(kv.blocks, [h], p.ledger)
    cached_prompts_from = kv.arena.num_blocks + 2
    for i in range(kv.arena.num_blocks + 1):  # enough new blocks to push it out again
        q = list(range(BLOCK * (cached_prompts_from + i), BLOCK * (cached_prompts_from + i + 1)))
        s = kv.open_session()
        feed(kv, s, q)
        kv.close_session(s)
    prefetch_after_lookup(kv.blocks, p, [])
    assert (p.ledger.issued, p.ledger.used, p.ledger.wasted) == (1, 0, 1)


def test_prefetch_needs_a_tier_below_hot():
    kv = KVCache(small_config())
    with pytest.raises(PrefetchError, match="no warm tier"):
        prefetch_into_hot(kv.blocks, [b"x"])


def test_the_engine_prefetches_after_each_lookup_when_a_mode_is_set():
    """prefetch_mode=sequential: a returning conversation's next blocks come back to hot
    right after a lookup touches its first ones, so the next lookup finds them hot."""
    cfg = small_config(block_size=BLOCK, pool_bytes=64 << 10, warm_bytes=64 * BLOCK_BYTES,
                       low_watermark=0.0, cooldown_s=0.0, prefetch_mode="sequential")
    kv = KVCache(cfg)

    def run(tokens: list[int]) -> int:
        sid = kv.open_session()
        n = kv.match_prefix(sid, tokens)
        feed(kv, sid, tokens[n:])
        kv.close_session(sid)
        return n

    chat = list(range(1000, 1000 + 8 * BLOCK))  # 8 blocks; the chain is learned as they register
    run(chat)
    run(list(range((kv.arena.num_blocks - 2) * BLOCK)))  # fills hot: the chat goes to warm
    assert run(chat[: 2 * BLOCK + 1]) == 2 * BLOCK  # 2 blocks from warm; blocks 3-4 prefetched
    p = kv.stats()["prefetch"]
    assert p["mode"] == "sequential" and p["issued"] >= 2
    chain = [ROOT]
    for i in range(8):
        chain.append(block_hash(chain[-1], chat[i * BLOCK : (i + 1) * BLOCK], kv.version))
    assert [h in kv.blocks.index for h in chain[1:]] == [True] * 4 + [False] * 4  # 3, 4 fetched
    assert run(chat[: 4 * BLOCK + 1]) == 4 * BLOCK
    assert kv.stats()["prefetch"]["used"] >= 2  # ... and the lookup used them


def test_no_prefetcher_runs_unless_a_mode_is_set():
    kv = KVCache(small_config(block_size=BLOCK, warm_bytes=8 * BLOCK_BYTES))
    sid = kv.open_session()
    kv.match_prefix(sid, list(range(3 * BLOCK)))
    assert kv.prefetcher is None and kv.stats()["prefetch"] is None
