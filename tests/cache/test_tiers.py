"""Hot -> warm -> cold tiers (issue 10 item 1): demotion under pressure, promotion on a prefix
hit, the cooldown (injected clock), stats; the cold tier here is an in-memory stand-in with the
SegmentStore interface (the real store is tested in test_segments.py and test_persist.py)."""

import torch

from cache import KVCache
from tests.cache.conftest import feed, small_config


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class DictStore:
    """The ColdStore interface over a dict (commit is a no-op)."""

    def __init__(self):
        self.items: dict[bytes, tuple[bytes, dict]] = {}

    def put(self, key, payload, meta):
        self.items[key] = (bytes(payload), dict(meta))

    def commit(self):
        pass

    def get(self, key):
        return self.items[key][0]

    def meta(self, key):
        return self.items[key][1]

    def delete(self, key):
        self.items.pop(key, None)

    def keys(self):
        return list(self.items)

    def drop_where(self, pred):
        gone = [k for k, (_, m) in self.items.items() if pred(m)]
        for k in gone:
            del self.items[k]
        return len(gone)

    def keys_hottest_first(self):
        return sorted(self.items, key=lambda k: -int(self.items[k][1].get("last_access", 0)))

    def stats(self):
        n = sum(len(p) for p, _ in self.items.values())
        return {"live_bytes": n, "bytes_on_disk": n}

    def compact(self):
        pass

    def __contains__(self, key):
        return key in self.items

    def __len__(self):
        return len(self.items)


def full_cache(kv, n_prompts, block=8):
    """n one-block prompts, each cached (its session closed)."""
    prompts, written = [], []
    for i in range(n_prompts):
        p = list(range(block * i, block * i + block))
        s = kv.open_session()
        ks, _ = feed(kv, s, p, seed=i)
        kv.close_session(s)
        prompts.append(p)
        written.append(ks)
    return prompts, written


def hit(kv, prompt):
    s = kv.open_session()
    n = kv.match_prefix(s, prompt + [0])
    return s, n


def test_an_evicted_block_goes_warm_and_comes_back_on_a_hit_bit_exact():
    clock = Clock()
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=1 << 20,
                              low_watermark=0.0), clock=clock)  # eviction at allocation only
    cap = kv.arena.num_blocks
    prompts, written = full_cache(kv, cap + 5)  # 5 more than hot holds
    st = kv.stats()
    assert st["evictions"] == 5 and st["swaps_out"]["warm"] == 5
    assert st["tier_bytes"]["warm"] == 5 * kv.arena.block_bytes
    s, n = hit(kv, prompts[0])  # the oldest: demoted first
    assert n == 8
    assert torch.equal(kv.read(s, 1)[0], written[0][1])  # restored bit-exact
    st = kv.stats()
    assert st["tier_hits"]["warm"] == 1 and st["swaps_in"] == 1


def test_without_tiers_an_evicted_block_is_a_miss():
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10))
    prompts, _ = full_cache(kv, kv.arena.num_blocks + 1)
    assert hit(kv, prompts[0])[1] == 0


def test_warm_overflow_goes_cold_and_cold_hits_restore():
    clock, store = Clock(), DictStore()
    block = 2 * 2 * 2 * 8 * 8 * 4  # small_config geometry, block_size 8, fp32
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=3 * block,
                              low_watermark=0.0), clock=clock, store=store)
    prompts, written = full_cache(kv, kv.arena.num_blocks + 6)
    clock.t += 120  # past every cooldown
    st = kv.stats()
    assert st["swaps_out"]["warm"] == 6 and st["swaps_out"]["cold"] == 3 and len(store) == 3
    s, n = hit(kv, prompts[0])
    assert n == 8 and torch.equal(kv.read(s, 0)[0], written[0][0])
    assert kv.stats()["tier_hits"]["cold"] == 1


def test_cooldown_keeps_a_just_demoted_block_warm_while_older_ones_go_cold():
    clock, store = Clock(), DictStore()
    block = 2 * 2 * 2 * 8 * 8 * 4
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=2 * block,
                              cooldown_s=60, low_watermark=0.0), clock=clock, store=store)
    cap = kv.arena.num_blocks
    prompts, _ = full_cache(kv, cap + 1)  # prompt 0 demoted at t=1000
    clock.t += 100
    full_cache_from = [list(range(10_000 + 8 * i, 10_000 + 8 * i + 8)) for i in range(2)]
    for p in full_cache_from[:1]:  # prompt 1 demoted at t=1100
        s = kv.open_session()
        feed(kv, s, p)
        kv.close_session(s)
    clock.t += 10  # prompt 1 is inside its cooldown, prompt 0 is not
    s = kv.open_session()
    feed(kv, s, full_cache_from[1])  # a third demotion: warm holds two, one must go cold
    kv.close_session(s)
    from cache.tiers import TierEntry
    cold = [TierEntry.from_record(store.get(k), store.meta(k), 0).tokens for k in store.keys()]
    assert cold == [prompts[0]]  # the one past its cooldown went


def test_a_version_bump_drops_old_kv_from_every_tier():
    store = DictStore()
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=1 << 20),
                 store=store)
    prompts, _ = full_cache(kv, kv.arena.num_blocks + 3)
    kv.flush()
    assert len([k for k in store.keys() if store.meta(k).get("kind") == "kv"]) > 0
    kv.bump_version()
    assert kv.stats()["tier_bytes"]["warm"] == 0
    assert not [k for k in store.keys() if store.meta(k).get("kind") == "kv"]
    assert hit(kv, prompts[0])[1] == 0


def test_offload_moves_every_cached_block_out_of_hot_and_hits_bring_them_back():
    store = DictStore()
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=1 << 20),
                 store=store)
    prompts, written = full_cache(kv, 4)
    assert kv.offload("warm") == 4 and kv.stats()["blocks_used"] == 0
    s, n = hit(kv, prompts[2])
    assert n == 8 and torch.equal(kv.read(s, 0)[0], written[2][0])
    kv.close_session(s)
    assert kv.offload("cold") == 1 and kv.stats()["tier_bytes"]["warm"] == 0
    s, n = hit(kv, prompts[3])
    assert n == 8 and kv.stats()["tier_hits"]["cold"] == 1


def test_below_the_low_watermark_a_batch_of_evict_batch_blocks_is_demoted():
    kv = KVCache(small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=1 << 20,
                              low_watermark=0.2, evict_batch=4))
    cap = kv.arena.num_blocks  # 32
    prompts, written = full_cache(kv, int(cap * 0.8) + 2)  # the 27th reserve: 6 of 32 free
    st = kv.stats()
    assert st["pressure_demotions"] == 4 and st["evictions"] == 0  # a batch, no allocation eviction
    assert st["swaps_out"]["warm"] == 4
    s, n = hit(kv, prompts[0])  # the LRU ones went first, and they still hit
    assert n == 8 and torch.equal(kv.read(s, 0)[0], written[0][0])


def test_the_configured_policy_is_the_engines():
    from cache.policy import ARCPolicy
    kv = KVCache(small_config(eviction_policy="arc"))
    assert isinstance(kv.policy, ARCPolicy)
