"""stats(): per-tier hit rates, swaps, utilisation, latency windows; reset_stats()."""

import json

import torch

from cache import KVCache
from cache.stats import OP_KINDS, OpLatencies

from tests.cache.conftest import feed, small_config


def _workload(kv: KVCache) -> None:
    """Cached chains, some demoted to warm, then prefix hits from hot and from warm."""
    for i in range(4):
        sid = kv.open_session()
        feed(kv, sid, list(range(100 * i, 100 * i + 8)), seed=i)
        kv.close_session(sid)
    kv.offload("warm")  # every cached block leaves hot
    for i in (0, 0, 1, 7):  # a warm hit, a hot hit (just promoted), another warm, a miss
        sid = kv.open_session()
        kv.match_prefix(sid, list(range(100 * i, 100 * i + 9)))
        kv.close_session(sid)


def test_hit_rates_per_tier_sum_to_the_prefix_hit_rate():
    kv = KVCache(small_config(warm_bytes=1 << 20))
    _workload(kv)
    st = kv.stats()
    rates = st["hit_rate_by_tier"]
    assert set(rates) == {"hot", "warm", "cold"}
    assert all(0.0 <= r <= 1.0 for r in rates.values())
    lookups = st["prefix_hit_blocks"] + st["prefix_miss_blocks"]
    assert rates["warm"] == st["tier_hits"]["warm"] / lookups > 0
    assert rates["hot"] == st["tier_hits"]["hot"] / lookups > 0
    assert abs(sum(rates.values()) - st["prefix_hit_rate"]) < 1e-12


def test_swaps_count_moves_out_and_back_in():
    kv = KVCache(small_config(warm_bytes=1 << 20))
    _workload(kv)
    s = kv.stats()["swaps"]
    assert s["out"] == 8 and s["in"] == 4 and s["total"] == 12  # 4 blocks promoted back


def test_utilisation_shares_are_in_range():
    kv = KVCache(small_config(warm_bytes=1 << 20))
    _workload(kv)
    sid = kv.open_session()
    feed(kv, sid, list(range(6)))
    u = kv.stats()["utilisation"]
    assert set(u) == {"hot_arena", "hot_tokens", "warm"}
    assert all(0.0 < x <= 1.0 for x in u.values())
    assert u["warm"] == kv.blocks.tiers.warm_used / (1 << 20)


def test_a_cache_without_tiers_reports_zero_for_them():
    kv = KVCache(small_config())
    st = kv.stats()
    assert st["hit_rate_by_tier"] == {"hot": 0.0, "warm": 0.0, "cold": 0.0}
    assert st["swaps"] == {"in": 0, "out": 0, "total": 0} and st["utilisation"]["warm"] == 0.0


def test_latency_windows_count_each_kind_of_operation():
    kv = KVCache(small_config())
    sid = kv.open_session()
    kv.match_prefix(sid, list(range(9)))
    feed(kv, sid, list(range(9)))  # one reserve, one write per layer
    kv.reserve(sid, [9])
    c = kv.config
    for layer in range(c.num_layers):
        kv.append_and_read(sid, layer, torch.randn(c.num_heads, 1, c.head_dim),
                           torch.randn(c.num_heads, 1, c.head_dim))
    other = kv.open_session()
    feed(kv, other, [1, 2])
    step = kv.begin_batch([sid, other], [10, 3])
    for layer in range(c.num_layers):
        k = torch.randn(c.num_heads, 2, c.head_dim)
        kv.append_and_read_batch(step, layer, k, k)
    lat = kv.stats()["latency"]
    assert set(lat) == set(OP_KINDS)
    samples = {kind: lat[kind]["samples"] for kind in OP_KINDS}
    assert samples == {"lookup": 1, "reserve": 5, "write": 4, "append_and_read": 2,
                       "batch_begin": 1, "batch_append_and_read": 2}  # batch: 2 reserves
    for kind in OP_KINDS:
        assert 0.0 < lat[kind]["p50_us"] <= lat[kind]["p99_us"]


def test_a_failed_operation_is_timed_too():
    kv = KVCache(small_config())
    sid = kv.open_session()
    try:
        kv.reserve(sid, [])
    except Exception:  # noqa: BLE001 -- ShapeMismatchError; the point is the sample
        pass
    assert kv.stats()["latency"]["reserve"]["samples"] == 1


def test_the_latency_ring_keeps_the_newest_samples_only():
    lat = OpLatencies(size=8)
    for ns in range(1, 21):
        lat.record("lookup", ns * 1000)
    s = lat.summary()["lookup"]
    assert s["samples"] == 8
    assert s["p50_us"] == 16.5 and 19.9 < s["p99_us"] <= 20.0  # only 13..20 are left
    assert lat.summary()["write"] == {"samples": 0, "p50_us": 0.0, "p99_us": 0.0}


def test_stats_are_json_and_show_the_tunables():
    kv = KVCache(small_config(warm_bytes=1 << 20))
    _workload(kv)
    st = json.loads(json.dumps(kv.stats()))
    assert st["tunables"] == kv.tunables() and st["context_age_s"] >= 0


def test_reset_stats_zeroes_counters_and_windows_and_keeps_sessions_and_blocks():
    kv = KVCache(small_config(warm_bytes=1 << 20))
    _workload(kv)
    keep = kv.open_session()
    feed(kv, keep, list(range(300, 306)))
    before = kv.stats()
    assert before["prefix_hit_blocks"] and before["swaps"]["total"]
    kv.reset_stats()
    st = kv.stats()
    assert st["prefix_hit_blocks"] == st["prefix_miss_blocks"] == st["prefix_lookups"] == 0
    assert st["tier_hits"] == {"hot": 0, "warm": 0, "cold": 0}
    assert st["swaps"] == {"in": 0, "out": 0, "total": 0}
    assert all(v["samples"] == 0 for v in st["latency"].values())
    assert st["context_age_s"] < before["context_age_s"]
    assert keep in kv.sessions() and kv.length(keep) == 6
    assert st["blocks_used"] == before["blocks_used"]
    assert st["tier_bytes"] == before["tier_bytes"]
    sid = kv.open_session()  # the cached chains still hit, counted from zero
    assert kv.match_prefix(sid, list(range(9))) == 8
    assert kv.stats()["prefix_hit_blocks"] == 2


def test_a_batch_after_reset_stats_attends_over_what_was_written():
    kv = KVCache(small_config())
    c = kv.config
    a, b = kv.open_session(), kv.open_session()
    feed(kv, a, [1, 2, 3])
    feed(kv, b, [4, 5, 6, 7, 8])
    for step_no in range(3):
        if step_no == 1:
            kv.reset_stats()  # the tail buffer is rebuilt, not reused under a reset key
        step = kv.begin_batch([a, b], [10 + step_no, 20 + step_no])
        for layer in range(c.num_layers):
            k = torch.randn(c.num_heads, 2, c.head_dim)
            _, tk, _, valid = kv.append_and_read_batch(step, layer, k, k)
    for row, sid in enumerate((a, b)):
        n = kv.length(sid)
        assert valid[row].sum().item() == n
        assert torch.equal(tk[:, row, :n], kv.read(sid, c.num_layers - 1)[0])
