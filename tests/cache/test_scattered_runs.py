"""A context scattered block by block over the arena -- what a long-running server's churned
prefix cache leaves a new sequence (``experiments.serve_soak``) -- is attended in a few
matmuls, not two per block, and gives the same result as dense attention; a context of a
few long runs is still attended in place (no copy).

Structure, not time: the tests count ``torch.matmul``/``torch.cat`` calls of one decode step.
"""

from __future__ import annotations

import math

import pytest
import torch

from cache.attention import attend, attend_shared
from tests.cache.test_attention import TOL, dense

Hk, G, D, BLOCK = 3, 3, 16, 16


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _scattered(n_blocks: int, run_blocks: int = 1, seed: int = 0):
    """(k, v) of ``n_blocks`` blocks and their runs as views of an arena where every run of
    ``run_blocks`` blocks is followed by a gap (another session's block)."""
    g = torch.Generator().manual_seed(seed)
    arena = torch.randn(2, Hk, 2 * n_blocks * BLOCK, D, generator=g)
    size = run_blocks * BLOCK
    runs = [(arena[0, :, s : s + size], arena[1, :, s : s + size])
            for s in range(0, 2 * n_blocks * BLOCK, 2 * size)][: n_blocks // run_blocks]
    k = torch.cat([k for k, _ in runs], 1)
    v = torch.cat([v for _, v in runs], 1)
    return k, v, runs


class _Count:
    def __init__(self, monkeypatch, *names: str):
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            real = getattr(torch, name)

            def counted(*a, _real=real, _name=name, **kw):
                self.calls[_name] += 1
                return _real(*a, **kw)
            monkeypatch.setattr(torch, name, counted)


@pytest.mark.parametrize("group", [G, 1])
def test_one_query_over_one_block_runs_is_a_few_matmuls(monkeypatch, group):
    k, v, runs = _scattered(34)
    q = torch.randn(Hk, group, 1, D, generator=torch.Generator().manual_seed(1))
    count = _Count(monkeypatch, "matmul")
    out = attend(q, runs)
    # two for the gathered prefix, two for the tails: not two per run
    assert count.calls["matmul"] <= 4, f"{count.calls['matmul']} matmuls for {len(runs)} runs"
    monkeypatch.undo()
    ref, _ = dense(q, k, v)
    assert (out - ref).abs().max() < TOL


def test_a_shared_prefix_of_one_block_runs_is_a_few_matmuls(monkeypatch):
    k, v, runs = _scattered(34)
    B, T = 2, 5
    g = torch.Generator().manual_seed(2)
    q = torch.randn(Hk, G, B, D, generator=g)
    tail_k, tail_v = torch.randn(Hk, B, T, D, generator=g), torch.randn(Hk, B, T, D, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    count = _Count(monkeypatch, "matmul")
    out = attend_shared(q, runs, tail_k, tail_v, valid)
    # two for the gathered prefix, two for the tails: not two per run
    assert count.calls["matmul"] <= 4, f"{count.calls['matmul']} matmuls for {len(runs)} runs"
    monkeypatch.undo()
    for b in range(B):
        ref, _ = dense(q[:, :, b : b + 1], torch.cat([k, tail_k[:, b]], 1),
                       torch.cat([v, tail_v[:, b]], 1))
        assert (out[:, :, b : b + 1] - ref).abs().max() < TOL


def test_a_few_long_runs_are_attended_in_place(monkeypatch):
    k, v, runs = _scattered(32, run_blocks=16)  # two runs of 256 tokens: no copy
    q = torch.randn(Hk, G, 1, D, generator=torch.Generator().manual_seed(3))
    count = _Count(monkeypatch, "cat")
    out = attend(q, runs)
    assert count.calls["cat"] <= 1  # the scores of the runs, never their K/V
    monkeypatch.undo()
    ref, _ = dense(q, k, v)
    assert (out - ref).abs().max() < TOL
    assert math.isfinite(float(out.sum()))


# -- a churned cache, end to end (tiny Llama) ---------------------------------------------------
def _churned(model, blocks: int, seed: int = 0):
    """A pool of ``blocks`` full of one-block prefix-cache entries closed in random order, so
    a new sequence fed block by block lands wherever the least recently used entry was:
    scattered."""
    import random

    from cache import CacheFullError, KVCache
    base = model.cache_config()
    kv = KVCache(model.cache_config(pool_bytes=blocks * base.block_bytes_fp32))
    rng, c, sids = random.Random(seed), kv.config, []
    while True:
        sid = kv.open_session()
        try:
            kv.reserve(sid, [rng.randrange(4, 128) for _ in range(c.block_size)])
        except CacheFullError:
            kv.close_session(sid)
            break
        for layer in range(c.num_layers):
            kv.write(sid, layer, *torch.randn(2, c.num_heads, c.block_size, c.head_dim))
        sids.append(sid)
    rng.shuffle(sids)
    for sid in sids:
        kv.close_session(sid)
    return kv


def _arena_runs(kv, sid: int) -> int:
    starts = [b.start for b in kv.session_table.get(sid).blocks]
    B = kv.config.block_size
    return 1 + sum(b != a + B for a, b in zip(starts, starts[1:]))


@torch.no_grad()
def test_a_churned_cache_decodes_a_new_sequence_as_a_fresh_cache_does(monkeypatch):
    from cache import KVCache
    from tests.tiny_models import tiny_llama
    model = tiny_llama()
    B = model.cache_config().block_size
    prompt = [int(t) for t in torch.randint(4, 128, (12 * B,),
                                            generator=torch.Generator().manual_seed(4))]
    out = {}
    for name, kv in (("fresh", KVCache(model.cache_config(
            pool_bytes=40 * model.cache_config().block_bytes_fp32))), ("churned", _churned(model, 40))):
        sid = kv.open_session()
        for i in range(0, len(prompt), B):  # block by block: each goes where a victim was
            logits = model.forward_cached(prompt[i : i + B], kv, sid)[-1]
        toks, calls = [], []
        for _ in range(6):
            toks.append(int(logits.argmax()))
            count = _Count(monkeypatch, "matmul")
            logits = model.forward_batch([toks[-1]], kv, [sid])[0]
            monkeypatch.undo()
            calls.append(count.calls["matmul"])
        out[name] = (toks, logits, max(calls), _arena_runs(kv, sid), len(kv.read_runs(sid, 0)))
    assert out["fresh"][3] == 1 and out["churned"][3] >= 8  # the churned one is scattered
    assert out["churned"][0] == out["fresh"][0]
    assert (out["churned"][1] - out["fresh"][1]).abs().max() < 1e-4
    assert out["churned"][2] <= out["fresh"][2], "a matmul pair per scattered run each step"
    assert out["churned"][4] == 1  # read_runs: one gathered run, not a view per block



def test_a_prompt_reserved_at_once_in_a_churned_arena_lies_in_one_run():
    """Several new blocks reserved together in an arena full of one-block cached entries and
    an open session's block go end to end (``BlockManager.room_for_run``): one run, no more
    evictions than blocks, every victim inside the run, the open session's block not in it
    (which run: ``test_the_run_made_is_the_one_whose_youngest_occupant_is_oldest``)."""
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    kv = _churned(model, 60)
    c, m = kv.config, kv.blocks
    B, N = c.block_size, 12

    def one_block(toks: list[int]) -> int:
        sid = kv.open_session()
        kv.reserve(sid, toks)
        for layer in range(c.num_layers):
            kv.write(sid, layer, *torch.zeros(2, c.num_heads, B, c.head_dim))
        return sid

    filler = []
    while m.arena.free_run(B) is not None:  # the free slots filled, then cached too
        filler.append(one_block([7 + len(filler)] * B))
    for f in filler:
        kv.close_session(f)
    held = one_block([5] * B)  # an open session's block: not movable, not evictable
    fixed = kv.session_table.get(held).blocks[0].start
    at = {m.index[k].start: m.index[k] for k in m.index}
    cached, before = set(m.index), kv.stats()["evictions"]
    sid = kv.open_session()
    kv.reserve(sid, list(range(4, 4 + N * B)))
    assert _arena_runs(kv, sid) == 1
    start = kv.session_table.get(sid).blocks[0].start
    assert not start <= fixed < start + N * B
    gone = cached - set(m.index)
    assert kv.stats()["evictions"] - before == len(gone) <= N
    for was, b in at.items():  # the evicted ones lay inside the run, none elsewhere
        if b.hash not in m.index:
            assert start <= was and was + b.capacity <= start + N * B
    assert kv.stats()["eviction_collateral"] <= 1


def test_the_run_made_is_the_one_whose_youngest_occupant_is_oldest():
    """``TokenArena.oldest_run`` over one-block slots: the run whose most recently used
    occupant is the least recent; free slots rank below all; an immovable block (not in the
    ranks) is never inside; no more than ``most`` tokens of evictable blocks are."""
    from cache.token_arena import TokenArena

    a = TokenArena(num_blocks=8, layers=1, heads=1, block=4, dim=2, dtype=torch.float32)
    assert sorted(a.allocate(4) for _ in range(8)) == list(range(0, 32, 4))
    rank = {0: 5, 4: 0, 8: 1, 16: 2, 20: 3, 24: 7, 28: 6}  # slot 12: an open session's
    ranks = [(start, 4, r) for start, r in rank.items()]
    assert a.oldest_run(8, ranks, most=8) == 4  # slots 4 and 8: youngest rank 1
    assert a.oldest_run(12, ranks, most=12) == 0  # 0-8 (youngest 5) beat 16-24 and 20-28 (7)
    assert a.oldest_run(20, ranks, most=20) is None  # every 5-slot run holds slot 12
    a.free(16, 4)
    ranks = [r for r in ranks if r[0] != 16]
    assert a.oldest_run(8, ranks, most=4) == 16  # at most one eviction: the free slot and 20
    assert a.placeable(4) == 1 and a.placeable(8) == 0


def _scattered_session(store=None, gather: bool = True, spans: bool = False):
    """A session of 6 blocks in an arena whose free slots alternate with other sessions'
    blocks (every other one-block session closed, its block evicted for this one's), its last
    two blocks written at once with ``append_and_read`` (``store``, ``gather``;
    ``append_and_read_spans`` with ``spans``): scattered positions. Returns (cache, sid, the runs that read returned, the bf16 K/V it was fed per
    layer)."""
    from cache import KVCache
    from tests.cache.conftest import feed, small_config

    kv = KVCache(small_config(block_size=8, pool_bytes=256 << 10))
    kv.blocks.room_for_run = lambda tokens: None  # placed block by block: where victims were
    others = [kv.open_session() for _ in range(kv.arena.num_blocks)]
    for i, s in enumerate(others):
        feed(kv, s, list(range(8 * i, 8 * i + 8)))
    for s in others[1::2]:
        kv.close_session(s)
    a, c, g = kv.open_session(), kv.config, torch.Generator().manual_seed(5)
    fed: dict[int, list] = {layer: [] for layer in range(c.num_layers)}
    for i, n in enumerate((8, 8, 8, 8, 16)):
        kv.reserve(a, list(range(9000 + 8 * i, 9000 + 8 * i + n)))
        for layer in range(c.num_layers):
            k, v = (torch.randn(c.num_heads, n, c.head_dim, generator=g).bfloat16() for _ in "kv")
            fed[layer].append((k, v))
            if n == 16 and spans:
                runs = kv.append_and_read_spans(a, layer, k, v, store=store)
            elif n == 16:
                runs = kv.append_and_read(a, layer, k, v, store=store, gather=gather)
            else:
                kv.write(a, layer, k, v)
    return kv, a, runs, fed


def test_a_kernel_reads_the_runs_as_they_lie_and_the_store_writes_what_write_does():
    """``append_and_read(..., gather=False)`` hands back every arena run of a scattered context
    (the fused kernels read a list of runs in place: no copy), ``gather`` one copy of them;
    a ``StepStore`` leaves the arena as the indexed store does, from bf16 rows too."""
    from tests.cache.test_batch import eager_store

    stored = []

    def store(*args):
        stored.append(args[1].tolist())  # the positions it was handed
        eager_store(*args)

    kv, a, gathered, fed = _scattered_session()
    kv2, a2, as_they_lie, _ = _scattered_session(store=store, gather=False)
    assert len(stored) == kv.config.num_layers and len(stored[0]) == 16  # the scattered write
    assert len(gathered) == 1 and len(as_they_lie) == 6  # one run per block: they alternate
    last = kv.config.num_layers - 1
    for i, runs in enumerate((gathered, as_they_lie)):
        for j in (0, 1):
            want = torch.cat([kv_[j] for kv_ in fed[last]], 1).float()
            assert torch.equal(torch.cat([r[j] for r in runs], 1), want), (i, j)
    for layer in range(kv.config.num_layers):
        assert torch.equal(torch.cat(kv.read(a, layer)), torch.cat(kv2.read(a2, layer)))


def test_spans_name_the_runs_in_order_and_a_block_to_decode_gives_none():
    """``append_and_read_spans`` writes as ``append_and_read`` does and names the context's
    arena runs, in position order, by (start, length) over the layer's whole K/V -- the rows
    they name are the K/V fed; with a block that must be decoded first it gives None."""
    from cache import KVCache
    from tests.cache.conftest import feed, small_config

    kv, a, spans, fed = _scattered_session(spans=True)
    kv2, a2, _, _ = _scattered_session()
    last = kv.config.num_layers - 1
    assert spans.runs.dtype == torch.long and spans.runs.shape == (6, 2)  # one per block
    assert spans.k.shape[1] == kv.arena.kv.shape[3]  # the layer's whole arena, not a copy
    assert spans.k.data_ptr() == kv.arena.kv[last, 0].data_ptr()
    for j, whole in enumerate((spans.k, spans.v)):
        got = torch.cat([whole[:, s : s + n] for s, n in spans.runs.tolist()], 1)
        assert torch.equal(got, torch.cat([kv_[j] for kv_ in fed[last]], 1).float())
    for layer in range(kv.config.num_layers):
        assert torch.equal(torch.cat(kv.read(a, layer)), torch.cat(kv2.read(a2, layer)))

    # quantized blocks with no room left for their read buffers (test_batch's tight arena)
    q = KVCache(small_config(kv_dtype="int8", fp_window=0, pool_bytes=64 << 10,
                             read_buffer_fraction=6 * 1024 / (64 << 10)))
    sa = q.open_session()
    for i, sid in enumerate([sa, q.open_session(), q.open_session()]):
        feed(q, sid, list(range(100 * i, 100 * i + 12)), seed=i)  # the first one's decoded now
    assert q.reads.plan(q.session_table.get(sa))[0][0] is None
    q.reserve(sa, [99])
    c, got = q.config, []
    for layer in range(c.num_layers):
        got.append(q.append_and_read_spans(sa, layer, *torch.randn(2, c.num_heads, 1, c.head_dim)))
    assert got == [None] * c.num_layers and q.length(sa) == 13  # written all the same


def test_a_gather_follows_a_block_that_moved_at_the_same_length():
    """A step's gather positions are worked out once and kept (``BlockTable.gather``); a block
    that changes place (compaction, demotion: the plan's generation moves) is read from its
    new place, also by a read at the same length as the last."""
    kv, a, _, _ = _scattered_session()
    layers, t = range(kv.config.num_layers), kv.session_table.get(a)
    want = [torch.cat(kv.read(a, layer)) for layer in layers]
    assert t.gather is not None and t.gather[1] is not None  # scattered: gathered, kept
    b, c = t.blocks[2], t.blocks[3]  # two full blocks trade places, as a move would
    kb, kc = (kv.arena.block(x.start, x.capacity).clone() for x in (b, c))
    kv.arena.block(b.start, b.capacity).copy_(kc)
    kv.arena.block(c.start, c.capacity).copy_(kb)
    b.start, c.start = c.start, b.start
    kv.blocks.generation += 1
    for layer in layers:
        assert torch.equal(torch.cat(kv.read(a, layer)), want[layer])


def test_an_arena_step_names_the_runs_and_the_row_and_commits_once():
    """``arena_step``: a one-token step of a scattered session names each arena run of its
    context, the new token's row in the last; ``commit_arena_step`` makes the token complete,
    and refuses a second time. A block that must be decoded first gives None."""
    from cache import KVCache
    from cache.errors import ReservationError
    from tests.cache.conftest import feed, small_config

    kv, a, _, fed = _scattered_session()
    n = kv.length(a)
    assert kv.arena_step(a) is None  # nothing reserved
    kv.reserve(a, [7])
    step = kv.arena_step(a)
    assert step.kv.data_ptr() == kv.arena.kv.data_ptr() and len(step.runs) == 7
    start, m = step.runs[-1]
    assert start <= step.row < start + m and sum(k for _, k in step.runs) == n + 1
    last = kv.config.num_layers - 1
    got = torch.cat([step.kv[last, 0, :, s : s + k] for s, k in step.runs], 1)
    assert torch.equal(got[:, :n], torch.cat([k for k, _ in fed[last]], 1).float())
    kv.commit_arena_step(a)
    assert kv.length(a) == n + 1
    with pytest.raises(ReservationError, match="no one-token step"):
        kv.commit_arena_step(a)

    q = KVCache(small_config(kv_dtype="int8", fp_window=0, pool_bytes=64 << 10,
                             read_buffer_fraction=6 * 1024 / (64 << 10)))
    sa = q.open_session()
    for i, sid in enumerate([sa, q.open_session(), q.open_session()]):
        feed(q, sid, list(range(100 * i, 100 * i + 12)), seed=i)  # the first one's decoded now
    q.reserve(sa, [99])
    assert q.arena_step(sa) is None
