"""Regression tests: a small allocation in a full pool of cached blocks must not flush the
prefix cache (issue 9, "Allocator")."""

from cache import KVCache
from tests.cache.conftest import feed, small_config


def cached_pool(**kw) -> tuple[KVCache, list[list[int]]]:
    """A full-precision arena of 128 slots: 127 unreferenced prefix-cached blocks (one
    session each, closed in a scattered order) and one free slot."""
    kv = KVCache(small_config(block_size=8, pool_bytes=256 << 10, **kw))
    n = kv.arena.num_blocks - 1
    prompts = [list(range(8 * i, 8 * i + 8)) for i in range(n)]
    sids = [kv.open_session() for _ in prompts]
    for s, p in zip(sids, prompts):
        feed(kv, s, p)
    for i in sorted(range(n), key=lambda i: (i % 8, i // 8)):
        kv.close_session(sids[i])
    assert kv.stats()["blocks_cached_unreferenced"] == n
    return kv, prompts


def cached_hits(kv: KVCache, prompts: list[list[int]]) -> int:
    """How many of the prompts still find their block in the prefix cache."""
    hits = 0
    for p in prompts:
        s = kv.open_session()
        hits += kv.match_prefix(s, p + [0]) == len(p)
        kv.close_session(s)
    return hits


def test_small_reserve_takes_the_free_slot_instead_of_evicting():
    kv, prompts = cached_pool()
    feed(kv, kv.open_session(), [900, 901, 902])
    st = kv.stats()
    assert st["evictions"] == 0 and st["eviction_collateral"] == 0
    assert cached_hits(kv, prompts) == len(prompts)


def test_small_reserve_in_a_completely_full_pool_evicts_one_block():
    kv, prompts = cached_pool()
    feed(kv, kv.open_session(), [800] * 8)  # takes the last free slot
    feed(kv, kv.open_session(), [900, 901, 902])
    st = kv.stats()
    assert st["evictions"] == 1 and st["eviction_collateral"] == 1
    assert cached_hits(kv, prompts) == len(prompts) - 1


def test_quantizing_in_a_full_quantized_pool_evicts_one_block():
    kv = KVCache(small_config(block_size=8, pool_bytes=256 << 10, kv_dtype="int8",
                              fp_window=0))
    prompts = []
    while kv.qpool.has_room("int8"):  # 1-block sessions: quantized at once, then cached
        prompts.append(list(range(8 * len(prompts), 8 * len(prompts) + 8)))
        s = kv.open_session()
        feed(kv, s, prompts[-1])
        kv.close_session(s)
    assert kv.stats()["evictions"] == 0
    feed(kv, kv.open_session(), list(range(5000, 5008)))
    st = kv.stats()
    assert st["quantized_blocks"] == len(prompts) + 1 and st["quant_skipped_full"] == 0
    assert st["evictions"] == 1 and st["eviction_collateral"] == 1
    assert cached_hits(kv, prompts) == len(prompts) - 1


def test_eviction_collateral_counts_the_blocks_one_allocation_evicted():
    """Issue 22 0d: the counter was set to max(x, 1) after any eviction, so "collateral <= 1"
    could not fail. Cached slots of one page (2 tokens) each, scattered over an 8-page arena
    (placement takes the middle of the largest gap); a 4-token block needs two adjacent free
    pages, so its allocation evicts victims until two of them neighbour: at least 2."""
    import torch

    from cache.manager import BlockManager
    from cache.policy import make_policy
    from cache.prefix import ROOT
    from cache.token_arena import TokenArena

    arena = TokenArena(4, 1, 1, 4, 2, torch.float32, page=2)
    m = BlockManager(arena, make_policy("lru", arena.num_blocks))
    for i in range(arena.num_pages):
        b = m.new(2)
        b.tokens = [2 * i, 2 * i + 1]
        m.register(b, ROOT)
        m.unref(b)  # a cached, unreferenced prefix entry
    assert arena.free_pages == 0 and m.counters["evictions"] == 0
    m.new(1)  # one page: one victim is enough
    assert m.counters["evictions"] == 1 and m.counters["eviction_collateral"] == 1
    m.new(4)  # two adjacent pages
    evicted = m.counters["evictions"] - 1
    assert evicted >= 2 and m.counters["eviction_collateral"] == evicted
    m.new(2)  # one page: the max over allocations stays
    assert m.counters["eviction_collateral"] == evicted
