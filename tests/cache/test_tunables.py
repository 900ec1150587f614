"""Runtime tunables: validation of every knob, and changes that take effect on a live engine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from cache import CacheConfig, ConfigError, KVCache
from cache.policy import POLICIES, ARCPolicy
from cache.prefetch import PREFETCH_MODES
from cache.tunables import TUNABLES, UnknownTunableError, validate_tunable

from tests.cache.conftest import feed, small_config
from tests.cache.test_properties import TightPoolMachine

DEFAULTS = {"warmup_ratio": 0.3, "evict_batch": 16, "prefetch_degree": 2,
            "prefetch_mode": "none", "coherence_protocol": 2, "low_watermark": 0.2, "cooldown_s": 60.0,
            "eviction_policy": "lru"}

GOOD = [("warmup_ratio", 0.0, 0.0), ("warmup_ratio", "1", 1.0), ("warmup_ratio", 0.5, 0.5),
        ("evict_batch", 1, 1), ("evict_batch", "24", 24), ("prefetch_degree", 0, 0),
        ("prefetch_degree", "64", 64), ("coherence_protocol", 1, 1),
        ("coherence_protocol", "2", 2), ("low_watermark", 0.0, 0.0),
        ("low_watermark", "0.5", 0.5), ("cooldown_s", 0, 0.0), ("cooldown_s", "2.5", 2.5),
        *[("eviction_policy", name, name) for name in POLICIES],
        *[("prefetch_mode", name, name) for name in PREFETCH_MODES]]

BAD = [("warmup_ratio", 1.5), ("warmup_ratio", -0.1), ("warmup_ratio", "nan"),
       ("warmup_ratio", "lots"), ("warmup_ratio", True), ("evict_batch", 0),
       ("evict_batch", -3), ("evict_batch", 2.5), ("evict_batch", "2.5"), ("evict_batch", True),
       ("evict_batch", None), ("prefetch_degree", -1), ("prefetch_degree", 65),
       ("coherence_protocol", 0), ("coherence_protocol", 3), ("coherence_protocol", "strong"),
       ("low_watermark", 1.0), ("low_watermark", -0.01), ("cooldown_s", -1),
       ("cooldown_s", "inf"), ("eviction_policy", "fifo"), ("eviction_policy", 3),
       ("prefetch_mode", "random"), ("prefetch_mode", 2)]


def test_defaults_are_the_documented_ones():
    assert KVCache(small_config()).tunables() == DEFAULTS
    assert list(TUNABLES) == list(DEFAULTS)


@pytest.mark.parametrize("key,value,parsed", GOOD)
def test_a_good_value_is_set_and_read_back(key, value, parsed):
    kv = KVCache(small_config())
    old = kv.set_tunable(key, value)
    assert old == DEFAULTS[key]
    assert kv.tunables()[key] == parsed and getattr(kv.config, key) == parsed
    assert type(kv.tunables()[key]) is type(DEFAULTS[key])


@pytest.mark.parametrize("key,value", BAD)
def test_a_bad_value_names_key_value_and_what_is_allowed_and_changes_nothing(key, value):
    kv = KVCache(small_config())
    with pytest.raises(ConfigError) as e:
        kv.set_tunable(key, value)
    msg = str(e.value)
    assert key in msg and repr(value) in msg and TUNABLES[key].allowed in msg
    assert kv.tunables() == DEFAULTS


@pytest.mark.parametrize("key,value", BAD)
def test_the_config_refuses_the_same_values(key, value):
    with pytest.raises(ConfigError, match=key):
        small_config(**{key: value})


def test_an_unknown_key_is_refused_with_the_known_ones():
    kv = KVCache(small_config())
    with pytest.raises(UnknownTunableError) as e:
        kv.set_tunable("kv_dtype", "int8")  # a config field, but not a runtime knob
    for name in TUNABLES:
        assert name in str(e.value)
    assert isinstance(e.value, ConfigError) and kv.config.kv_dtype == "fp32"


def test_validate_parses_command_line_strings():
    assert validate_tunable("evict_batch", " 24 ") == 24
    assert validate_tunable("eviction_policy", "arc") == "arc"


def _cache_with_cached_blocks(n_sessions: int = 4, **kw) -> KVCache:
    """A cache with a warm tier and ``2 * n_sessions`` cached unreferenced blocks."""
    kv = KVCache(small_config(pool_bytes=64 << 10, warm_bytes=1 << 20, low_watermark=0.0,
                              **kw))
    for i in range(n_sessions):
        sid = kv.open_session()
        feed(kv, sid, list(range(100 * i, 100 * i + 8)), seed=i)  # two full blocks
        kv.close_session(sid)
    return kv


def _one_reserve(kv: KVCache, first: int) -> None:
    sid = kv.open_session()
    feed(kv, sid, [first, first + 1])
    kv.close_session(sid)


def test_evict_batch_sets_how_many_blocks_one_pressure_round_demotes():
    kv = _cache_with_cached_blocks(6)
    kv.set_tunable("low_watermark", 0.999)  # anything allocated is pressure now
    kv.set_tunable("evict_batch", 3)
    _one_reserve(kv, 5000)
    assert kv.stats()["pressure_demotions"] == 3
    kv.set_tunable("evict_batch", 5)
    _one_reserve(kv, 6000)
    assert kv.stats()["pressure_demotions"] == 8


def test_low_watermark_zero_means_no_pressure_round():
    kv = _cache_with_cached_blocks(3)
    _one_reserve(kv, 5000)
    assert kv.stats()["pressure_demotions"] == 0


def test_a_policy_switch_carries_the_cached_blocks_in_eviction_order():
    kv = _cache_with_cached_blocks(4)
    order = kv.policy.victims(len(kv.policy))
    assert len(order) == 8
    kv.set_tunable("eviction_policy", "arc")  # ARC admits them into T1: same LRU order
    assert isinstance(kv.policy, ARCPolicy) and kv.policy.victims(8) == order
    for name in POLICIES:
        kv.set_tunable("eviction_policy", name)
        assert isinstance(kv.policy, POLICIES[name]) and len(kv.policy) == 8
        assert set(kv.policy.victims(100)) == set(order)


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"lru"}))
def test_after_a_switch_the_carried_blocks_are_evicted_and_still_hit(name):
    kv = _cache_with_cached_blocks(4)
    kv.set_tunable("eviction_policy", name)
    kv.set_tunable("low_watermark", 0.999)
    kv.set_tunable("evict_batch", 4)
    _one_reserve(kv, 5000)
    st = kv.stats()
    assert st["pressure_demotions"] == 4 and st["swaps"]["out"] >= 4
    for i in range(4):  # every chain is found again: in hot, or promoted from warm
        sid = kv.open_session()
        assert kv.match_prefix(sid, list(range(100 * i, 100 * i + 9))) == 8
        kv.close_session(sid)
    assert kv.stats()["tier_hits"]["warm"] >= 1


def test_blocks_referenced_during_a_switch_become_evictable_under_the_new_policy():
    kv = _cache_with_cached_blocks(1)
    sid = kv.open_session()
    assert kv.match_prefix(sid, list(range(9))) == 8  # the two cached blocks, referenced
    assert len(kv.policy) == 0
    kv.set_tunable("eviction_policy", "lfu")
    kv.close_session(sid)
    assert len(kv.policy) == 2


def test_cooldown_reaches_the_tiers():
    kv = _cache_with_cached_blocks(1)
    kv.set_tunable("cooldown_s", 0.5)
    assert kv.blocks.tiers.cooldown_s == 0.5


def test_prefetch_degree_and_coherence_protocol_are_stored_for_their_modules():
    kv = KVCache(small_config(prefetch_degree=4, coherence_protocol=1))
    assert kv.config.prefetch_degree == 4 and kv.config.coherence_protocol == 1
    kv.set_tunable("coherence_protocol", 2)
    kv.set_tunable("prefetch_degree", 0)
    assert kv.tunables()["coherence_protocol"] == 2 and kv.config.prefetch_degree == 0


def test_warmup_ratio_is_read_by_the_next_warm_start(tmp_path):
    cfg = small_config(warm_bytes=1 << 20)
    kv = KVCache.open(tmp_path, cfg)
    sid = kv.open_session()
    feed(kv, sid, list(range(8)))
    kv.close_session(sid)
    kv.set_tunable("warmup_ratio", 0.0)  # nothing is prewarmed at the next open
    kv.close()
    kv2 = KVCache.open(tmp_path, cfg)
    try:
        assert cfg.warmup_ratio == 0.0 and kv2.stats()["tier_bytes"]["warm"] == 0
    finally:
        kv2.close()


def test_config_keeps_validating_its_other_fields():
    with pytest.raises(ConfigError, match="warm_bytes"):
        CacheConfig(num_layers=1, num_heads=1, head_dim=8, warm_bytes=-1)


class TunablesMachine(TightPoolMachine):
    """The session workloads of test_properties on a tight pool with a warm tier, while the
    tunables change under them (policy switches, eviction batches, watermarks) and the
    statistics context is reset: the same invariants hold (the cached blocks are exactly the
    policy's keys, nothing leaks, no stale or wrong K/V)."""

    CONFIG = dict(TightPoolMachine.CONFIG, warm_bytes=16 << 10)

    @rule(name=st.sampled_from(sorted(POLICIES)))
    def switch_policy(self, name):
        before = set(self.kv.policy.victims(len(self.kv.policy)))
        self.kv.set_tunable("eviction_policy", name)
        assert set(self.kv.policy.victims(len(self.kv.policy))) == before

    @rule(n=st.integers(1, 8))
    def evict_batch(self, n):
        self.kv.set_tunable("evict_batch", n)

    @rule(w=st.sampled_from([0.0, 0.5, 0.99]))
    def low_watermark(self, w):
        self.kv.set_tunable("low_watermark", w)

    @rule()
    def reset_stats(self):
        self.kv.reset_stats()
        st_ = self.kv.stats()
        assert st_["prefix_hit_blocks"] == 0 and st_["swaps"]["total"] == 0


TunablesMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                             deadline=None)
TestTunablesMachine = TunablesMachine.TestCase
