"""The engine's batch step: one write and one gather per layer; the shared prefix once."""

import pytest
import torch

from cache import CacheFullError, KVCache, ReservationError
from cache.sparsity import SlidingWindow
from tests.cache.conftest import feed, small_config


def test_batch_step_shares_the_common_prefix_and_gathers_each_tail():
    kv = KVCache(small_config())
    a = kv.open_session()
    feed(kv, a, list(range(8)))  # two full blocks
    b, c = kv.fork(a), kv.fork(a)
    feed(kv, b, [50, 51])
    tail_c, _ = feed(kv, c, [60, 61, 62, 63, 64], seed=4)
    step = kv.begin_batch([a, b, c], [1, 2, 3])
    assert sum(n for _, n in step.prefix) == 8  # attended once for all three sessions
    assert step.tail_valid.sum(1).tolist() == [1, 3, 6]  # own tokens + the new one
    H, D = kv.config.num_heads, kv.config.head_dim
    for layer in range(kv.config.num_layers):
        k = torch.randn(H, 3, D)
        prefix, tk, tv, valid = kv.append_and_read_batch(step, layer, k, -k)
        assert torch.equal(tk[:, 0, 0], k[:, 0]) and torch.equal(tk[:, 2, 5], k[:, 2])
        if layer == 0:
            assert torch.equal(tk[:, 2, :5], tail_c[0])
    assert [kv.length(s) for s in (a, b, c)] == [9, 11, 14]
    assert kv.stats()["blocks_shared"] == 2


def test_batch_layers_must_come_in_order():
    kv = KVCache(small_config())
    s = kv.open_session()
    feed(kv, s, [1, 2])
    step = kv.begin_batch([s], [3])
    H, D = kv.config.num_heads, kv.config.head_dim
    with pytest.raises(ReservationError, match="out of order"):
        kv.append_and_read_batch(step, 1, torch.zeros(H, 1, D), torch.zeros(H, 1, D))


def test_a_continuing_step_appends_to_the_tails_instead_of_gathering_them():
    kv = KVCache(small_config())
    a = kv.open_session()
    feed(kv, a, list(range(8)))
    b = kv.fork(a)
    H, D = kv.config.num_heads, kv.config.head_dim
    seen = []
    for step_i in range(3):
        step = kv.begin_batch([a, b], [step_i, 100 + step_i])
        assert step.fresh == (step_i == 0)
        for layer in range(kv.config.num_layers):
            k = torch.full((H, 2, D), float(step_i))
            _, tk, _, valid = kv.append_and_read_batch(step, layer, k, -k)
        seen.append(tk.clone())
    # what the buffer holds equals a fresh gather of the same tokens
    kv.batcher.tails = None
    step = kv.begin_batch([a, b], [7, 8])
    for layer in range(kv.config.num_layers):
        _, tk, _, valid = kv.append_and_read_batch(step, layer, torch.zeros(H, 2, D),
                                                   torch.zeros(H, 2, D))
    assert torch.equal(tk[:, :, :3], seen[-1][:, :, :3])
    kv.reset_session(b)  # blocks move: the next step rebuilds
    feed(kv, b, [1, 2, 3])
    assert kv.begin_batch([a, b], [1, 2]).fresh


def test_without_the_tail_buffer_every_step_gathers():
    kv = KVCache(small_config(batch_tail_buffer=False))
    a, b = kv.open_session(), kv.open_session()
    feed(kv, a, list(range(6)))
    feed(kv, b, [9, 9])  # nothing shared: the tails are the whole sessions
    H, D = kv.config.num_heads, kv.config.head_dim
    for i in range(3):
        step = kv.begin_batch([a, b], [i, i])
        assert step.fresh and not step.prefix
        for layer in range(kv.config.num_layers):
            _, tk, _, valid = kv.append_and_read_batch(step, layer, torch.ones(H, 2, D),
                                                       torch.ones(H, 2, D))
    assert valid.sum(1).tolist() == [9, 5]
    assert torch.equal(tk[:, 0, 6:9], torch.ones(H, 3, D))


def test_a_reset_and_refilled_session_is_gathered_again_not_served_from_the_old_tails():
    """Issue 22 0a: reset_session + refill to the same length (its first block a prefix hit,
    so the same block as before) must not continue the tail buffer built before the reset."""
    kv = KVCache(small_config())
    c = kv.config
    H, D = c.num_heads, c.head_dim
    a, b = kv.open_session(), kv.open_session()
    feed(kv, a, list(range(100, 106)))
    feed(kv, b, list(range(6)), seed=1)
    for i in range(2):
        step = kv.begin_batch([a, b], [i, i])
        for layer in range(c.num_layers):
            kv.append_and_read_batch(step, layer, torch.randn(H, 2, D), torch.randn(H, 2, D))
    kv.reset_session(b)
    assert kv.match_prefix(b, list(range(6)) + [0]) == 4
    feed(kv, b, [60, 61, 62, 63], seed=2)  # 8 tokens again, 4 of them new K/V
    step = kv.begin_batch([a, b], [9, 9])
    for layer in range(c.num_layers):
        _, tk, tv, valid = kv.append_and_read_batch(step, layer, torch.randn(H, 2, D),
                                                    torch.randn(H, 2, D))
        assert valid.sum(1).tolist() == [9, 9]
        for row, sid in enumerate((a, b)):  # the 8 tokens before the step, as written
            k, v = kv.read(sid, layer)
            assert torch.equal(tk[:, row, :8], k[:, :8]) and torch.equal(tv[:, row, :8], v[:, :8])


def _full_arena():
    """A 4-block full-precision arena: a holds 1 full block, b 2; one block free."""
    kv = KVCache(small_config(pool_bytes=4 << 10, managed_block_bytes=4 << 10))
    assert kv.arena.num_blocks == 4
    a, b = kv.open_session(), kv.open_session()
    feed(kv, a, [1, 2, 3, 4])
    feed(kv, b, [5, 6, 7, 8, 9, 10, 11, 12])
    return kv, a, b


def test_a_refused_batch_reserves_nothing():
    """Issue 22 0b: begin_batch is all-or-nothing. a's new block fits, b's does not: the
    refusal must leave a without a reservation (it used to stay wedged until reset) and the
    block it took free again."""
    kv, a, b = _full_arena()
    free, used = kv.arena.free_pages, kv.stats()["blocks_used"]
    for _ in range(4):  # the third failure in a row compacts and retries: still refused
        with pytest.raises(CacheFullError):
            kv.begin_batch([a, b], [20, 21])
        assert kv.arena.free_pages == free and kv.stats()["blocks_used"] == used
        assert kv.tokens(a) == [1, 2, 3, 4] and kv.length(b) == 8
    feed(kv, a, [20])  # every member decodes normally
    assert kv.tokens(a) == [1, 2, 3, 4, 20]
    kv.reset_session(a)
    feed(kv, b, [21])
    assert kv.length(b) == 9


def test_a_batch_refused_for_a_sparse_member_reserves_nothing():
    kv = KVCache(small_config())
    a = kv.open_session()
    s = kv.open_session(SlidingWindow(4))
    feed(kv, a, [1, 2, 3, 4])
    feed(kv, s, [1, 2, 3])
    used = kv.stats()["blocks_used"]
    with pytest.raises(ReservationError, match="sparsity"):
        kv.begin_batch([a, s], [5, 6])
    assert kv.stats()["blocks_used"] == used
    feed(kv, a, [5])
    feed(kv, s, [6])
    assert kv.length(a) == 5 and kv.length(s) == 4


def _batch_outputs(kv: KVCache, sids: list[int], steps: int) -> list[torch.Tensor]:
    """Attention outputs of ``steps`` batched decode steps (seeded q, k, v), every layer."""
    from cache.attention import attend_shared
    c = kv.config
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(steps):
        step = kv.begin_batch(sids, [i] * len(sids))
        for layer in range(c.num_layers):
            q, k, v = (torch.randn(c.num_heads, len(sids), c.head_dim, generator=g)
                       for _ in range(3))
            out.append(attend_shared(q, *kv.append_and_read_batch(step, layer, k, v)))
    return out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("fp_blocks", [6, 7])
def test_quantized_batch_whose_read_buffers_do_not_all_fit_decodes_as_with_room(dtype, fp_blocks):
    """Issue 22 0c: two sessions of 3 quantized blocks each need 8 full-precision blocks for
    their read buffers and new blocks; with 6 or 7, reserving one member dropped the other's
    buffers and the batch died in tail_positions with a raw torch RuntimeError. It must decode
    what a cache with room decodes."""
    outs = []
    for blocks in (fp_blocks, 32):
        kv = KVCache(small_config(kv_dtype=dtype, fp_window=0, pool_bytes=64 << 10,
                                  read_buffer_fraction=blocks * 1024 / (64 << 10)))
        assert kv.arena.num_blocks == blocks
        a, b = kv.open_session(), kv.open_session()
        feed(kv, a, list(range(12)))
        feed(kv, b, list(range(100, 112)), seed=1)
        fork = kv.fork(a)  # a shared prefix too
        outs.append(_batch_outputs(kv, [a, b, fork], steps=3))
        assert [kv.length(s) for s in (a, b, fork)] == [15, 15, 15]
        assert (kv.stats()["transient_reads"] > 0) == (blocks == fp_blocks)  # decoded per layer
    for tight, roomy in zip(*outs):
        assert torch.allclose(tight, roomy, atol=1e-6)


def _run_step(kv, step, n):
    """Write random K/V for the step's ``n`` rows in every layer; the last layer's tails."""
    c = kv.config
    for layer in range(c.num_layers):
        out = kv.append_and_read_batch(step, layer, torch.randn(c.num_heads, n, c.head_dim),
                                       torch.randn(c.num_heads, n, c.head_dim))
    return out


def _assert_tails_hold_the_sessions(kv, step, out):
    """Each row's slot holds its session's tokens as the cache has them (last layer)."""
    _, tk, tv, valid = out
    layer = kv.config.num_layers - 1
    for r, sid in enumerate(step.sids):
        slot = r if step.rows is None else int(step.rows[r])
        k, v = kv.read(sid, layer)
        n = int(valid[slot].sum())
        assert n == int(step.tail_valid[r].sum())
        assert torch.equal(tk[:, slot, :n], k[:, k.shape[1] - n:])
        assert torch.equal(tv[:, slot, :n], v[:, v.shape[1] - n:])


def test_a_session_joining_a_running_batch_is_gathered_alone_into_a_free_slot():
    """A sequence finishing and another joining cost one row's gather, not the batch's."""
    kv = KVCache(small_config())
    a, b, c = kv.open_session(), kv.open_session(), kv.open_session()
    feed(kv, a, [1, 2, 3, 4, 5])
    feed(kv, b, [6, 7, 8], seed=1)
    feed(kv, c, [9, 10, 11, 12, 13, 14, 15], seed=2)
    for _ in range(2):
        step = kv.begin_batch([a, b], [0, 0])
        _run_step(kv, step, 2)
    step = kv.begin_batch([b, c], [0, 0])  # a left, c joined
    assert step.gather == [1] and not step.fresh  # c alone is gathered
    assert step.rows is not None and int(step.rows[0]) == 1  # b stays in its slot
    _assert_tails_hold_the_sessions(kv, step, _run_step(kv, step, 2))
    step = kv.begin_batch([c, b], [0, 0])  # the rows in another order: both continue
    assert step.gather == []
    _assert_tails_hold_the_sessions(kv, step, _run_step(kv, step, 2))
    step = kv.begin_batch([a, b, c], [0, 0, 0])  # a comes back: its slot went to c
    assert step.gather[:1] == [0]
    _assert_tails_hold_the_sessions(kv, step, _run_step(kv, step, 3))


def test_more_sessions_than_slots_rebuild_the_buffer():
    kv = KVCache(small_config())
    sids = [kv.open_session() for _ in range(8)]
    for i, s in enumerate(sids):
        feed(kv, s, [i, i + 1], seed=i)
    step = kv.begin_batch(sids[:1], [0])
    _run_step(kv, step, 1)
    slots = kv.batcher.tails.kv.shape[3]
    assert slots < len(sids)  # the spare slots cannot take all eight
    step = kv.begin_batch(sids, [0] * len(sids))
    assert step.fresh and step.rows is None
    _assert_tails_hold_the_sessions(kv, step, _run_step(kv, step, len(sids)))


def test_a_rebuilt_buffer_lies_in_the_kept_memory_when_it_fits():
    """A rebuild takes the kept buffer's memory instead of tens of MB faulted in anew, and
    the tails it gathers there are the sessions' own (nothing left from the old buffer)."""
    kv = KVCache(small_config())
    sids = [kv.open_session() for _ in range(8)]
    for i, s in enumerate(sids):
        feed(kv, s, [10 * i + t for t in range(6)], seed=i)
    step = kv.begin_batch(sids, [0] * len(sids))
    _run_step(kv, step, len(sids))
    memory = kv.batcher.tails.kv.untyped_storage().data_ptr()
    held = kv.stats()["batch_tail_buffer_bytes"]
    step = kv.begin_batch(sids[2:3], [0])  # alone: its whole blocks are the prefix, a new key
    assert step.fresh
    out = _run_step(kv, step, 1)
    assert kv.batcher.tails.kv.untyped_storage().data_ptr() == memory
    assert kv.stats()["batch_tail_buffer_bytes"] == held  # what is held, not the smaller view
    _assert_tails_hold_the_sessions(kv, step, out)
    step = kv.begin_batch(sids, [0] * len(sids))  # all eight again, longer now
    _assert_tails_hold_the_sessions(kv, step, _run_step(kv, step, len(sids)))


def test_tails_decoded_per_row_leave_no_unwritten_memory_behind_a_shorter_tail(monkeypatch):
    """Quantized members are decoded row by row into an uninitialized buffer: a shorter
    tail's padding must be zeroed (masked is not enough: 0 x NaN is NaN)."""
    def run(poison: bool) -> list[torch.Tensor]:
        kv = KVCache(small_config(kv_dtype="int8", fp_window=0, pool_bytes=64 << 10,
                                  read_buffer_fraction=5 * 1024 / (64 << 10)))
        a, b = kv.open_session(), kv.open_session()
        feed(kv, a, list(range(12)))
        feed(kv, b, list(range(100, 104)), seed=1)
        real = torch.empty
        if poison:
            monkeypatch.setattr(torch, "empty", lambda *x, **k: (
                t.fill_(float("nan")) if (t := real(*x, **k)).is_floating_point() else t))
        out = _batch_outputs(kv, [a, b], steps=2)
        monkeypatch.undo()
        assert kv.stats()["transient_reads"] > 0  # the decode-per-row path ran
        return out
    got, want = run(True), run(False)
    assert all(torch.isfinite(g).all() and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("joins_later", [False, True])  # gathered into slots 0.. / a free slot
def test_bf16_tails_hold_the_arena_values_rounded_once(joins_later):
    """``batch_tail_dtype="bf16"``: the tail copy is the arena's K/V rounded to bf16 (bf16
    values come back exactly), both where tails are gathered and where a step appends."""
    kv = KVCache(small_config(batch_tail_dtype="bf16"))
    H, D = kv.config.num_heads, kv.config.head_dim
    a, b = kv.open_session(), kv.open_session()
    feed(kv, a, list(range(5)), seed=1)
    feed(kv, b, [7, 8, 9], seed=2)
    sids = [a] if joins_later else [a, b]
    for step_no in range(2):
        if joins_later and step_no == 1:
            sids = [a, b]
        step = kv.begin_batch(sids, [1] * len(sids))
        seen = []
        for layer in range(kv.config.num_layers):
            k = torch.randn(H, len(sids), D)
            _, tk, tv, valid = kv.append_and_read_batch(step, layer, k, -k)
            assert tk.dtype == tv.dtype == torch.bfloat16
            seen.append((tk.clone(), valid.clone()))
        for layer, (tk, valid) in enumerate(seen):  # the step committed: the arena has it all
            for row, sid in enumerate(sids):
                own_k = torch.cat([rk for rk, _ in kv.read_runs(sid, layer)], dim=1)  # fp32
                n = int(valid[row].sum())  # its own tokens past a shared prefix, the new one
                assert n >= 2
                assert torch.equal(tk[:, row, :n], own_k[:, -n:].to(torch.bfloat16))


def test_a_tail_dtype_it_does_not_know_is_refused():
    from cache import ConfigError

    with pytest.raises(ConfigError, match="batch_tail_dtype must be one of"):
        small_config(batch_tail_dtype="fp16")


def eager_store(arena, pos, k, v, tails, slots, at, rows):
    """A ``StepStore`` doing what the eager path does, by the contract's words."""
    arena[0].index_copy_(1, pos, k.to(arena.dtype))
    arena[1].index_copy_(1, pos, v.to(arena.dtype))
    for i in range(len(slots)):
        tails[0, slots[i], :, at[i]] = k[:, rows[i]].to(tails.dtype)
        tails[1, slots[i], :, at[i]] = v[:, rows[i]].to(tails.dtype)


def _joining_and_leaving(store):
    """Steps over sessions that continue, join and leave: the tails take appends and gathers."""
    torch.manual_seed(3)
    kv = KVCache(small_config())
    a = kv.open_session()
    feed(kv, a, list(range(8)))
    b, c = kv.fork(a), kv.fork(a)
    feed(kv, b, [50, 51])
    feed(kv, c, [60, 61, 62], seed=4)
    H, D = kv.config.num_heads, kv.config.head_dim
    seen = []
    for members in ([a, b], [a, b], [a, b, c], [b, c], [a, b, c]):
        step = kv.begin_batch(members, [7] * len(members))
        for layer in range(kv.config.num_layers):
            k = torch.randn(H, len(members), D)
            prefix, tk, tv, valid = kv.append_and_read_batch(step, layer, k, -k, store=store)
            seen.append([p.clone() for run in prefix for p in run] + [tk.clone(), tv.clone(),
                                                                       valid.clone()])
    return seen, kv.batcher.arena.kv.clone()


def test_a_fused_store_leaves_what_the_indexed_stores_leave():
    """``append_and_read_batch(store=...)``: the store writes the arena and the continuing
    rows' tails, the joining rows are still gathered -- every layer reads the same K/V."""
    calls = []

    def recording(*args):
        calls.append([a.shape for a in args])
        eager_store(*args)
    fused, arena = _joining_and_leaving(recording)
    plain, arena_plain = _joining_and_leaving(None)
    assert calls and any(shapes[5][0] > 0 for shapes in calls)  # some steps appended
    assert any(shapes[5][0] == 0 for shapes in calls)  # and some only gathered
    assert torch.equal(arena, arena_plain)
    for got, want in zip(fused, plain, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
