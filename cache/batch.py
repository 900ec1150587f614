"""BatchStep: one decode step of B sessions as index tensors (one write, one gather per layer).

Built once per step by ``Batcher.begin`` (``KVCache.begin_batch``): the arena position of
each session's new token (one ``index_copy_`` per layer writes all of them), the runs of the
longest block prefix the sessions share (attended once for the whole batch,
:func:`cache.attention.attend_shared`), and each session's remaining tokens as a padded
position matrix (one gather per layer). ``Batcher`` plans and runs those steps over the
session table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from cache.attention import scattered
from cache.errors import ReservationError, ShapeMismatchError
from cache.session_table import check_layer

if TYPE_CHECKING:
    from cache.config import CacheConfig
    from cache.manager import BlockManager
    from cache.session_table import BlockTable, SessionTable
    from cache.steps import ReadPlanner
    from cache.token_arena import TokenArena


@dataclass
class BatchStep:
    sids: list[int]
    write_pos: torch.Tensor
    """[B] arena token positions of the new tokens."""
    prefix: list[tuple[int, int]]
    """(arena start, tokens) per run of the shared prefix."""
    tail_pos: torch.Tensor | None
    """[B, T] arena positions of each session's own tokens (new one included), padded; None
    when a member holds quantized blocks: the tails are decoded per layer."""
    tail_valid: torch.Tensor
    """[B, T] bool: which tail positions hold a token."""
    written: int = 0
    """Layers written so far; the step commits after the last one."""
    tails: "TailBuffer | None" = None
    """Where this step's tails are read from when the previous step's are still valid."""
    fresh: bool = True
    """True: gather the tails from the arena (and fill ``tails``); False: append to them."""


def shared_prefix_blocks(tables: list) -> int:
    """Full blocks, counted from the start, that every table holds (the same records)."""
    first = tables[0].blocks
    n = min(len(t.blocks) for t in tables)
    for t in tables:
        full = t.length // t.block_size  # a partial block is about to be written into
        n = min(n, full)
        for i in range(n):
            if t.blocks[i] is not first[i]:
                n = i
                break
    return n


def tail_positions(starts: list[list[int]], lengths: list[int], block: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded [B, T] arena positions of ``lengths[i]`` tokens in the blocks starting at ``starts[i]``."""
    T = max(lengths)
    pos = torch.zeros(len(starts), T, dtype=torch.long)
    valid = torch.zeros(len(starts), T, dtype=torch.bool)
    offs = torch.arange(block)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        p = (torch.tensor(s).view(-1, 1) + offs).flatten()[:n]
        pos[i, :n], valid[i, :n] = p, True
    return pos, valid


@dataclass
class TailBuffer:
    """The batch's tails, kept from one step to the next: ``[layers, 2, heads, B, cap, dim]``.

    A step that continues the previous one (same sessions, same shared prefix, every session
    one token longer, no block moved, nothing quantized, no session released -- a session
    reset and refilled to the same length holds other K/V behind the same first tail block,
    so ``BlockTable.releases`` is part of the key) appends its new tokens here -- one
    indexed store per layer -- instead of gathering every tail again; anything else rebuilds
    it. A copy of the tails only (the prefix is read in place); a member's quantized blocks
    are decoded into it, so it costs their full-precision bytes while the batch runs."""

    key: tuple
    kv: torch.Tensor
    valid: torch.Tensor
    lengths: list[int]

    @classmethod
    def empty(cls, key: tuple, layers: int, heads: int, n: int, cap: int, dim: int,
              dtype: torch.dtype) -> "TailBuffer":
        return cls(key, torch.zeros(layers, 2, heads, n, cap, dim, dtype=dtype),
                   torch.zeros(n, cap, dtype=torch.bool), [0] * n)

    def continues(self, key: tuple, lengths: list[int]) -> bool:
        """The step after the one this buffer holds, with room for it."""
        return (key == self.key and all(n == m + 1 for n, m in zip(lengths, self.lengths))
                and max(lengths) <= self.kv.shape[4])


TAIL_ROOM = 16
"""Decode steps a batch's tail buffer has room for before it is gathered again."""


class Batcher:
    """Batched decode steps (``KVCache.begin_batch``, ``append_and_read_batch``) over the
    session table; keeps the tail buffer one step may hand to the next. ``reserve(sid,
    tokens)`` and ``commit(table)`` are the engine's single-session steps."""

    def __init__(self, config: "CacheConfig", arena: "TokenArena", blocks: "BlockManager",
                 sessions: "SessionTable", reads: "ReadPlanner",
                 reserve: Callable[[int, list[int]], None],
                 commit: Callable[["BlockTable"], None]) -> None:
        self.config, self.arena, self.blocks = config, arena, blocks
        self.sessions, self.reads, self.reserve, self.commit = sessions, reads, reserve, commit
        self.tails: TailBuffer | None = None
        """The last step's tails, kept when ``batch_tail_buffer`` is on."""

    def begin(self, sids: list[int], tokens: list[int]) -> BatchStep:
        if len(sids) != len(tokens) or len(set(sids)) != len(sids) or not sids:
            raise ShapeMismatchError(
                f"begin_batch needs one token per distinct session, got {len(sids)} sessions "
                f"and {len(tokens)} tokens")
        tables = [self.sessions.get(s) for s in sids]  # unknown, closed, stale: before reserving
        if any(t.sparsity is not None for t in tables):
            raise ReservationError("sessions with a sparsity policy cannot be batched")
        for t in tables:
            if t.pending:
                raise ReservationError(
                    f"session {t.sid}: {t.pending} reserved tokens are not written yet")
        done: list[tuple[BlockTable, int]] = []
        try:
            for t, tok in zip(tables, tokens):
                held = len(t.blocks)
                self.reserve(t.sid, [tok])
                done.append((t, held))
            return self._plan(sids, tables)
        except BaseException:
            for t, held in reversed(done):
                self.sessions.unreserve(t, held)
            raise

    def _plan(self, sids: list[int], tables: list[BlockTable]) -> BatchStep:
        """The step's write positions, shared prefix runs and tails. When every member's
        blocks are in the full-precision arena they are gathered from it (a prefix scattered
        over many short runs -- ``cache.attention.scattered`` -- is no shared prefix: it goes
        to the tails, gathered once and appended to step by step, instead of a matmul pair per
        run every step); when a member holds
        quantized blocks the tails are decoded per layer instead (``transient``: no shared
        prefix, ``stats()['transient_reads']``), as ``read_runs`` does for one session."""
        B = self.config.block_size
        resident = all([self.reads.in_arena(t) for t in tables])
        shared = shared_prefix_blocks(tables) if resident else 0
        prefix, left = [], shared
        for start, nb, _ in (self.reads.plan(tables[0]) if shared else []):
            if left <= 0:
                break
            prefix.append((start, min(nb, left) * B))
            left -= nb
        if scattered([n for _, n in prefix]):  # gathered once into the tails, not per step
            shared, prefix = 0, []
        lengths = [t.length + 1 - shared * B for t in tables]
        write = torch.tensor([t.blocks[t.length // B].start + t.length % B for t in tables])
        key = (tuple(sids), shared, self.blocks.generation, self.blocks.counters["quantized_blocks"],
               tuple(t.blocks[shared].id if len(t.blocks) > shared else -1 for t in tables),
               tuple(t.releases for t in tables))
        buf = self.tails if self.config.batch_tail_buffer else None
        if buf is not None and buf.continues(key, lengths):
            step = BatchStep(list(sids), write, prefix, torch.empty(0), buf.valid, tails=buf,
                             fresh=False)
        else:
            if resident:
                pos, valid = tail_positions(
                    [[b.start for b in t.blocks[shared:]] for t in tables], lengths, B)
            else:
                pos = None
                valid = torch.arange(max(lengths)) < torch.tensor(lengths).view(-1, 1)
            c = self.config
            buf = TailBuffer.empty(key, c.num_layers, c.num_heads, len(sids),
                                   max(lengths) + TAIL_ROOM, c.head_dim, self.arena.kv.dtype)
            self.tails = buf if c.batch_tail_buffer else None  # kept only when reused
            step = BatchStep(list(sids), write, prefix, pos, valid, tails=buf)
        step.tails.lengths = lengths
        step.tails.key = key
        return step

    def append_and_read(self, step: BatchStep, layer: int, k: torch.Tensor, v: torch.Tensor):
        check_layer(layer, self.config.num_layers)
        c = self.config
        want = (c.num_heads, len(step.sids), c.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ShapeMismatchError(f"k, v must be {want}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if step.written != layer:
            raise ReservationError(f"batch step: layer {layer} written out of order")
        kv = self.arena.kv[layer]
        kv[0].index_copy_(1, step.write_pos, k.to(kv.dtype))
        kv[1].index_copy_(1, step.write_pos, v.to(kv.dtype))
        prefix = [self.arena.run(layer, start, n) for start, n in step.prefix]
        tk, tv, valid = self._tails_of(step, layer, k, v)
        step.written += 1
        if step.written == c.num_layers:
            for sid in step.sids:
                t = self.sessions.get(sid)
                t.written = set(range(c.num_layers))
                self.commit(t)
        return prefix, tk, tv, valid

    def _tails_of(self, step: BatchStep, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Tail K, V [H, B, T, D] and mask [B, T]: gathered (one index_select for K and V
        together, 9x faster than on the [H, N, D] views) into the step's buffer, or the new
        token appended to the buffer the previous step left."""
        buf, c = step.tails, self.config
        T = max(buf.lengths)
        if step.fresh and step.tail_pos is None:  # quantized blocks among the tails: decode
            for row, sid in enumerate(step.sids):
                t = self.sessions.get(sid)
                (tk, tv), = self.reads.transient_run(t, layer, t.length + 1)
                buf.kv[layer, 0, :, row, : tk.shape[1]] = tk
                buf.kv[layer, 1, :, row, : tv.shape[1]] = tv
            buf.valid[:, : step.tail_valid.shape[1]] = step.tail_valid
        elif step.fresh:
            H, Bn, Tp = c.num_heads, *step.tail_pos.shape
            got = self.arena.kv[layer].index_select(2, step.tail_pos.flatten())
            buf.kv[layer, :, :, :, :Tp] = got.view(2, H, Bn, Tp, c.head_dim)
            buf.valid[:, :Tp] = step.tail_valid
        else:
            rows = torch.arange(len(step.sids))
            at = torch.tensor(buf.lengths) - 1
            buf.kv[layer, 0, :, rows, at] = k.to(buf.kv.dtype)  # [H, B, D]
            buf.kv[layer, 1, :, rows, at] = v.to(buf.kv.dtype)
            buf.valid[rows, at] = True
        return buf.kv[layer, 0, :, :, :T], buf.kv[layer, 1, :, :, :T], buf.valid[:, :T]
