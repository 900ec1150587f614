"""Regression tests: a small allocation in a full pool of cached blocks must not flush the
prefix cache (issue 9, "Allocator")."""

from cache import KVCache
from tests.cache.conftest import feed, small_config


def cached_pool(**kw) -> tuple[KVCache, list[list[int]]]:
    """16 slabs x 8 full-size slots: 127 unreferenced prefix-cached blocks (one session each)
    and one free full-size slot. Sessions close slot-major (slot 0 of every slab, then slot 1,
    ...), so LRU order is scattered across slabs as after a real workload."""
    kv = KVCache(small_config(block_size=8, pool_bytes=256 << 10, **kw))
    per_slab = kv.pool.classes[kv.fresh].slots_per_slab
    n = kv.pool.num_slabs * per_slab - 1
    prompts = [list(range(8 * i, 8 * i + 8)) for i in range(n)]
    sids = [kv.open_session() for _ in prompts]
    for s, p in zip(sids, prompts):
        feed(kv, s, p)  # session i's block lands in slab i // 8, slot i % 8
    for i in sorted(range(n), key=lambda i: (i % per_slab, i // per_slab)):
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


def test_small_reserve_takes_the_free_full_slot_instead_of_evicting():
    kv, prompts = cached_pool()
    s = kv.open_session()
    feed(kv, s, [900, 901, 902])  # a 3-token tail: its own slot class has no slab
    st = kv.stats()
    assert st["evictions"] <= 1 and st["eviction_collateral"] <= 1
    assert cached_hits(kv, prompts) >= len(prompts) - 1


def test_small_reserve_in_a_completely_full_pool_evicts_one_block():
    kv, prompts = cached_pool()
    feed(kv, kv.open_session(), [800] * 8)  # takes the last free slot
    feed(kv, kv.open_session(), [900, 901, 902])
    st = kv.stats()
    assert st["evictions"] == 1 and st["eviction_collateral"] == 1
    assert cached_hits(kv, prompts) == len(prompts) - 1


def test_quantizing_in_a_full_pool_evicts_at_most_one_slab():
    # 1-block sessions stay fp32 (they never leave the 8-token window); the session below
    # quantizes its first block, which needs an int8 slot and so a slab of its own
    kv, prompts = cached_pool(kv_dtype="int8", fp_window=8)
    per_slab = kv.pool.classes[kv.fresh].slots_per_slab
    s = kv.open_session()
    feed(kv, s, list(range(1000, 1016)))
    st = kv.stats()
    assert st["quantized_blocks"] == 1 and st["quant_skipped_full"] == 0
    assert st["eviction_collateral"] <= per_slab  # the cheapest slab, not LRU until one empties
    assert st["evictions"] <= per_slab + 1
    assert cached_hits(kv, prompts) >= len(prompts) - per_slab - 1


def test_allocation_tries_every_class_before_evicting():
    kv, _ = cached_pool()
    kv.close_session(kv.open_session())
    free_full = kv.pool.free_slots(kv.fresh)
    s = kv.open_session()
    feed(kv, s, [1])  # 1-token tail: no slab for any tail class, one free full slot
    assert kv.pool.location(kv._sessions[s].blocks[0])[0] == kv.fresh
    assert kv.pool.free_slots(kv.fresh) == free_full - 1 and kv.stats()["evictions"] == 0
