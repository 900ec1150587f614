import pytest
import torch

from cache import (
    CacheConfig,
    CacheFullError,
    ClosedSessionError,
    KVCache,
    LayerIndexError,
    ReservationError,
    ShapeMismatchError,
    StaleSessionError,
    TensorDTypeError,
    UnknownSessionError,
)
from tests.cache.conftest import feed, small_config


def test_round_trip_across_blocks_is_exact(kv):
    s = kv.open_session()
    ks, vs = feed(kv, s, list(range(10)), seed=1)
    k2, v2 = feed(kv, s, [10, 11, 12], seed=2)  # continues the partial third block
    for layer in range(2):
        k, v = kv.read(s, layer)
        assert torch.equal(k, torch.cat([ks[layer], k2[layer]], dim=1))
        assert torch.equal(v, torch.cat([vs[layer], v2[layer]], dim=1))
    assert kv.length(s) == 13


def test_read_mid_step_sees_new_tokens_only_in_written_layers(kv):
    s = kv.open_session()
    feed(kv, s, [1, 2, 3])
    kv.reserve(s, [4])
    kv.write(s, 0, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    assert kv.read(s, 0)[0].shape[1] == 4
    assert kv.read(s, 1)[0].shape[1] == 3


def test_prefix_hit_across_sessions_reuses_blocks(kv):
    prompt = list(range(100, 113))  # 3 full blocks of 4 + 1
    a = kv.open_session()
    ks, _ = feed(kv, a, prompt)
    used = kv.stats()["blocks_used"]
    b = kv.open_session()
    assert kv.match_prefix(b, prompt) == 12
    st = kv.stats()
    assert st["prefix_hit_blocks"] == 3 and st["blocks_used"] == used
    assert st["blocks_shared"] == 3
    assert torch.equal(kv.read(b, 1)[0], ks[1][:, :12])
    # a different token in block 2 stops the chain there
    c = kv.open_session()
    assert kv.match_prefix(c, prompt[:5] + [0] + prompt[6:]) == 4


def test_prefix_blocks_are_shared_only_within_a_namespace(kv):
    """A tenant's session never attaches (nor deduplicates into) another namespace's blocks:
    a serving agent's tenants get no prefix hit on each other's prompts."""
    prompt = list(range(100, 113))  # 3 full blocks of 4 + 1
    feed(kv, kv.open_session(namespace="alice"), prompt)
    used = kv.stats()["blocks_used"]
    for other in ("bob", b"", "alicE"):
        assert kv.match_prefix(kv.open_session(namespace=other), prompt) == 0, other
    assert kv.stats()["prefix_hit_blocks"] == 0
    b = kv.open_session(namespace="bob")
    feed(kv, b, prompt)  # the same tokens in bob's namespace: their own blocks, no dedup
    assert kv.stats()["blocks_used"] == 2 * used and kv.stats()["blocks_shared"] == 0
    assert kv.match_prefix(kv.open_session(namespace="alice"), prompt) == 12
    child = kv.fork(b)
    kv.close_session(b)
    kv.reset_session(child)
    assert kv.match_prefix(child, prompt) == 12  # a fork stays in its parent's namespace
    assert kv.stats()["prefix_hit_blocks"] == 6


def test_prefix_survives_closing_its_session(kv):
    prompt = list(range(9))
    a = kv.open_session()
    feed(kv, a, prompt)
    kv.close_session(a)
    assert kv.stats()["blocks_cached_unreferenced"] == 2
    b = kv.open_session()
    assert kv.match_prefix(b, prompt) == 8
    assert kv.stats()["blocks_cached_unreferenced"] == 0


def test_fork_copy_on_write_never_changes_parent(kv):
    s = kv.open_session()
    ks, vs = feed(kv, s, [1, 2, 3, 4, 5, 6])  # second block partial -> shared after fork
    before = [kv.read(s, layer) for layer in range(2)]
    f = kv.fork(s)
    feed(kv, f, [7, 8], seed=9)
    assert kv.stats()["cow_copies"] == 1
    for layer in range(2):
        k, v = kv.read(s, layer)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    assert kv.length(s) == 6 and kv.length(f) == 8
    assert torch.equal(kv.read(f, 0)[0][:, :6], before[0][0])
    feed(kv, s, [70, 80], seed=3)  # parent now owns its block alone again: no copy
    assert kv.stats()["cow_copies"] == 1
    assert kv.tokens(s) == [1, 2, 3, 4, 5, 6, 70, 80] and kv.tokens(f)[-2:] == [7, 8]


def test_identical_blocks_computed_twice_are_stored_once(kv):
    a, b = kv.open_session(), kv.open_session()
    feed(kv, a, list(range(8)))
    feed(kv, b, list(range(8)))
    st = kv.stats()
    assert st["dedup_blocks"] == 2 and st["blocks_used"] == 2


def test_version_bump_invalidates_kv(kv):
    prompt = list(range(9))
    a = kv.open_session()
    feed(kv, a, prompt)
    b = kv.open_session()
    feed(kv, b, [5, 5, 5, 5, 5])
    kv.close_session(b)
    assert kv.bump_version() == 1
    with pytest.raises(StaleSessionError, match="version 0"):
        kv.read(a, 0)
    with pytest.raises(StaleSessionError):
        kv.reserve(a, [1])
    assert kv.stats()["blocks_used"] == 0  # old blocks are freed, nothing stale is kept
    assert kv.reset_session(a) == prompt
    c = kv.open_session()
    assert kv.match_prefix(c, prompt) == 0  # no hit on K/V of the old weights
    feed(kv, a, prompt)
    d = kv.open_session()
    assert kv.match_prefix(d, prompt) == 8


def test_reclaims_unreferenced_blocks_tails_first():
    kv = KVCache(small_config(pool_bytes=256 << 10))  # 256 slots of 1 KB fp32 blocks
    cap = kv.arena.num_blocks
    a = kv.open_session()
    feed(kv, a, list(range(4 * cap)))  # fills the pool exactly
    kv.close_session(a)
    b = kv.open_session()
    feed(kv, b, [999] * 4)  # needs one block: the chain tail goes, the root stays
    assert kv.stats()["evictions"] == 1
    c = kv.open_session()
    assert kv.match_prefix(c, list(range(4 * cap))) == 4 * (cap - 1)


def test_cache_full_when_everything_pinned_and_nothing_damaged():
    kv = KVCache(small_config(pool_bytes=256 << 10))
    cap = kv.arena.num_blocks
    a = kv.open_session()
    ks, _ = feed(kv, a, list(range(4 * cap - 2)))
    before = kv.stats()["blocks_used"]
    with pytest.raises(CacheFullError, match="holds only blocks of open sessions"):
        kv.reserve(a, [1, 2, 3, 4, 5])  # needs 2 new blocks, only 0 free
    assert kv.stats()["blocks_used"] == before and kv.length(a) == 4 * cap - 2
    assert kv.stats()["alloc_failures"] == 1
    assert torch.equal(kv.read(a, 1)[0], ks[1])
    feed(kv, a, [1, 2])  # the session still works after the refusal
    assert kv.length(a) == 4 * cap


def test_quantized_blocks_and_full_precision_window():
    kv = KVCache(small_config(kv_dtype="int8", fp_window=4))
    s = kv.open_session()
    ks, _ = feed(kv, s, list(range(14)))  # blocks 0,1 leave the window, 2 and 3 stay fp32
    st = kv.stats()
    assert st["quantized_blocks"] == 2 and set(st["bytes_by_dtype"]) == {"int8", "fp32"}
    k, _ = kv.read(s, 0)
    assert torch.equal(k[:, 8:], ks[0][:, 8:])  # window exact
    err = (k[:, :8] - ks[0][:, :8]).abs().max()
    assert 0 < err < 0.05


def test_block_past_error_threshold_stays_full_precision():
    kv = KVCache(small_config(kv_dtype="int4", fp_window=0, requant_error_threshold=1e-6))
    s = kv.open_session()
    ks, _ = feed(kv, s, list(range(8)))
    st = kv.stats()
    assert st["kept_full_precision_blocks"] == 2 and st["quantized_blocks"] == 0
    assert torch.equal(kv.read(s, 1)[0], ks[1])


@pytest.mark.parametrize(
    "k_shape,exc,msg",
    [((2, 3, 8), ShapeMismatchError, r"expected \(2, 2, 8\)"),
     ((3, 2, 8), ShapeMismatchError, "shape"),
     ((2, 2, 7), ShapeMismatchError, "head_dim")],
)
def test_bad_shapes_rejected_and_nothing_stored(kv, k_shape, exc, msg):
    s = kv.open_session()
    ks, _ = feed(kv, s, [1, 2, 3])
    kv.reserve(s, [4, 5])
    with pytest.raises(exc, match=msg):
        kv.write(s, 0, torch.zeros(k_shape), torch.zeros(k_shape))
    assert torch.equal(kv.read(s, 0)[0], ks[0])


def test_error_paths_name_the_problem(kv):
    s = kv.open_session()
    kv.reserve(s, [1])
    with pytest.raises(TensorDTypeError, match="floating-point"):
        kv.write(s, 0, torch.zeros(2, 1, 8, dtype=torch.long), torch.zeros(2, 1, 8))
    with pytest.raises(LayerIndexError, match="2 layers"):
        kv.write(s, 2, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    with pytest.raises(LayerIndexError):
        kv.read(s, -1)
    with pytest.raises(ReservationError, match="not written"):
        kv.reserve(s, [2])
    kv.write(s, 0, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    with pytest.raises(ReservationError, match="already written"):
        kv.write(s, 0, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    kv.write(s, 1, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    with pytest.raises(ReservationError, match="reserve"):
        kv.write(s, 0, torch.zeros(2, 0, 8), torch.zeros(2, 0, 8))
    with pytest.raises(UnknownSessionError, match="never opened"):
        kv.read(42, 0)
    kv.close_session(s)
    with pytest.raises(ClosedSessionError, match="closed"):
        kv.reserve(s, [3])
    with pytest.raises(ShapeMismatchError):
        kv.reserve(kv.open_session(), [])


def test_stats_report_utilisation_and_dtypes(kv):
    s = kv.open_session()
    feed(kv, s, list(range(6)))
    st = kv.stats()
    assert st["blocks_used"] == 2 and st["sessions_open"] == 1
    assert st["bytes_by_dtype"] == {"fp32": 2 * kv.arena.block_bytes}
    assert 0 < st["kv_utilisation"] <= 6 / 8


def test_quantization_reclaims_room_when_the_pool_holds_only_cached_blocks():
    kv = KVCache(small_config(head_dim=64, kv_dtype="int8", fp_window=0, pool_bytes=512 << 10,
                              read_buffer_fraction=0.5))
    for j in range(3):  # 90 blocks: nearly fills the quantized pool's 96 slots
        a = kv.open_session()
        for i in range(30):
            feed(kv, a, list(range(1000 * j + 4 * i, 1000 * j + 4 * i + 4)))
        kv.close_session(a)  # its blocks stay cached, quantized only (evictable)
    assert kv.stats()["read_buffer_bytes"] == 0 and kv.stats()["evictions"] == 0
    b = kv.open_session()
    for i in range(24):  # a and b together overfill the quantized pool: b evicts a's blocks
        feed(kv, b, [7, i % 5, 3, i % 11])
    st = kv.stats()
    assert st["evictions"] > 0 and st["quant_skipped_full"] == 0
    assert st["quantized_blocks"] == 114 and kv.length(b) == 96
    assert st["read_buffer_bytes"] == 24 * kv.arena.block_bytes  # b's decoded buffer


def test_a_growing_session_is_one_run_even_when_others_grow_at_once():
    kv = KVCache(small_config(pool_bytes=1 << 20))
    sids = [kv.open_session() for _ in range(4)]
    for step in range(40):
        for s in sids:
            feed(kv, s, [step], seed=step)
    assert all(len(kv.read_runs(s, 0)) <= 2 for s in sids)
    assert all(sum(k.shape[1] for k, _ in kv.read_runs(s, 1)) == 40 for s in sids)


def test_a_single_run_is_read_as_a_view_of_the_arena(kv):
    s = kv.open_session()
    feed(kv, s, list(range(10)))
    (k, v), = kv.read_runs(s, 0)
    assert k.untyped_storage().data_ptr() == kv.arena.kv.untyped_storage().data_ptr()


def test_fork_of_a_partial_block_copies_on_write():
    kv = KVCache(small_config(block_size=8))
    s = kv.open_session()
    ks, _ = feed(kv, s, [1, 2, 3])
    f = kv.fork(s)
    kf, _ = feed(kv, f, [4, 5, 6], seed=5)
    assert kv.stats()["cow_copies"] == 1
    assert torch.equal(kv.read(s, 0)[0], ks[0])
    assert torch.equal(kv.read(f, 0)[0], torch.cat([ks[0], kf[0]], dim=1))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp32", "int4", "fp16"])
def test_head_major_reads_are_exact_for_real_geometries(kv_dtype):
    cfg = CacheConfig(num_layers=2, num_heads=2, head_dim=64, block_size=32, kv_dtype=kv_dtype,
                      fp_window=1024, pool_bytes=8 << 20)
    kv = KVCache(cfg)
    written = {}
    for i, n in enumerate((70, 33, 5, 100)):
        s = kv.open_session()
        written[s] = feed(kv, s, [i] * n, seed=i)
    for s, (ks, vs) in written.items():
        for layer in range(2):
            k, v = kv.read(s, layer)
            tol = 2e-3 if kv_dtype == "fp16" else 0.0  # fp16 storage: relative rounding
            assert (k - ks[layer]).abs().max() <= tol * (1 + ks[layer].abs().max())
            assert (v - vs[layer]).abs().max() <= tol * (1 + vs[layer].abs().max())


def test_a_partial_last_block_grows_in_place_page_by_page():
    kv = KVCache(small_config(block_size=8, tail_granule=2))
    s = kv.open_session()
    written = [feed(kv, s, [i], seed=i) for i in range(11)]  # one token at a time
    st = kv.stats()
    assert st["tail_moves"] == 0 and len(kv.read_runs(s, 0)) == 1  # grew in place
    assert st["bytes_allocated"] == kv.arena.block_bytes * (8 + 4) / 8  # 8 + 3 tokens -> 8 + 4
    k, _ = kv.read(s, 1)
    assert torch.equal(k, torch.cat([w[0][1] for w in written], dim=1))


def test_a_partial_block_with_no_room_after_it_moves():
    kv = KVCache(small_config(block_size=8, tail_granule=2))
    a = kv.open_session()
    ka, _ = feed(kv, a, [1, 2])  # positions 0..1 of the arena
    taken = kv.arena.allocate(2, after=2)  # someone else holds the next page
    assert taken == 2
    k2, _ = feed(kv, a, [5, 6, 7], seed=3)
    assert kv.stats()["tail_moves"] == 1
    assert torch.equal(kv.read(a, 0)[0], torch.cat([ka[0], k2[0]], dim=1))
    kv.arena.free(taken, 2)
    kv.close_session(a)
    kv.bump_version()
    assert kv.arena.free_pages == kv.arena.num_pages


def test_compaction_restores_one_run_per_session_and_keeps_contents():
    kv = KVCache(small_config(block_size=4, pool_bytes=64 << 10))
    a = kv.open_session()
    ks = [feed(kv, a, [1, 2, 3, 4], seed=1)[0][0]]
    blocker = kv.arena.allocate(4, after=4)  # another party takes the space after a's block
    for i in range(3):
        ks.append(feed(kv, a, [5 + i] * 4, seed=2 + i)[0][0])
    kv.arena.free(blocker, 4)
    assert len(kv.read_runs(a, 0)) == 2
    result = kv.compact()
    assert result == {"moved": 4, "swept": 0}
    assert len(kv.read_runs(a, 0)) == 1
    assert torch.equal(kv.read(a, 0)[0], torch.cat(ks, dim=1))
    st = kv.stats()
    assert st["compactions"] == 1 and st["compacted_blocks"] == 4
    feed(kv, a, [9])  # the session keeps working in its new place
    assert kv.length(a) == 17


def test_three_allocation_failures_in_a_row_trigger_compaction():
    kv = KVCache(small_config(block_size=4, pool_bytes=16 << 10))
    s = kv.open_session()
    feed(kv, s, list(range(4 * kv.arena.num_blocks)))
    for _ in range(3):
        with pytest.raises(CacheFullError):
            kv.reserve(s, [1])
    assert kv.stats()["compactions"] == 1 and kv.stats()["alloc_failures"] == 4


def test_flush_compacts():
    kv = KVCache(small_config())
    kv.flush()
    assert kv.stats()["compactions"] == 1


def test_below_the_low_watermark_compaction_runs_lazily():
    from cache.compaction import COMPACT_EVERY
    kv = KVCache(small_config(block_size=4, pool_bytes=16 << 10, low_watermark=0.5))
    feed(kv, kv.open_session(), list(range(4 * 12)))  # 12 of 16 blocks: below the watermark
    s = kv.open_session()
    for i in range(COMPACT_EVERY - 2):
        feed(kv, s, [i])
        kv.reset_session(s)
    assert kv.stats()["compactions"] == 0  # lazy: not on every reserve
    for i in range(4):
        feed(kv, s, [i])
        kv.reset_session(s)
    assert kv.stats()["compactions"] == 1


def test_cached_prefix_tokens_predicts_match_prefix_without_touching_anything():
    import torch as _t
    from cache import CacheConfig as _C, KVCache as _K
    kv = _K(_C(num_layers=1, num_heads=1, head_dim=4, block_size=4, pool_bytes=1 << 16,
               managed_block_bytes=1 << 12))
    toks = list(range(1, 14))
    sid = kv.open_session(namespace="a")
    kv.reserve(sid, toks)
    kv.write(sid, 0, _t.randn(1, 13, 4), _t.randn(1, 13, 4))
    kv.close_session(sid)
    before = dict(kv.stats())
    assert kv.cached_prefix_tokens(toks + [99], "a") == 12
    assert kv.cached_prefix_tokens(toks, "b") == 0  # another namespace sees nothing
    assert kv.cached_prefix_tokens([7] + toks, "a") == 0
    after = kv.stats()
    assert {k: after[k] for k in ("prefix_lookups", "prefix_hit_blocks")} == \
        {k: before[k] for k in ("prefix_lookups", "prefix_hit_blocks")}
    sid = kv.open_session(namespace="a")
    assert kv.match_prefix(sid, toks + [99]) == 12
    kv.bump_version()
    assert kv.cached_prefix_tokens(toks + [99], "a") == 0  # stale blocks are not a hit
