"""BatchStep: one decode step of B sessions as index tensors (one write, one gather per layer).

Built once per step by ``Batcher.begin`` (``KVCache.begin_batch``): the arena position of
each session's new token (one ``index_copy_`` per layer writes all of them), the runs of the
longest block prefix the sessions share (attended once for the whole batch,
:func:`cache.attention.attend_shared`), and each session's remaining tokens as a padded
position matrix (one gather per layer). ``Batcher`` plans and runs those steps over the
session table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from cache.attention import NO_ROWS, scattered
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
    tail_valid: torch.Tensor
    """[B, T] bool, row i for ``sids[i]``: which of its tail positions hold a token."""
    tails: "TailBuffer"
    """Where the step's tails live: one slot per session (see :class:`TailBuffer`)."""
    rows: torch.Tensor | None = None
    """[B] the tail slot of each row; None when row i is slot i (the tails then come back in
    row order)."""
    gather: list[int] = field(default_factory=list)
    """Rows whose tails are gathered this step (new in the buffer, or not continuing); the
    others append their new token to what their slot holds."""
    gather_pos: torch.Tensor | None = None
    """[len(gather), T] arena positions of those rows' tails (padded); None when one of them
    holds quantized blocks: they are decoded per layer."""
    appends: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(slot, position, row) of each row that appends its new token to its slot."""
    gather_slots: list[int] = field(default_factory=list)
    """The slot of each row in ``gather``."""
    slots_read: int = 0
    """Slots ``0..slots_read-1`` are read: every row's slot is among them."""
    written: int = 0
    """Layers written so far; the step commits after the last one."""

    @property
    def fresh(self) -> bool:
        """Every row's tail is gathered this step (nothing continues from the last one)."""
        return len(self.gather) == len(self.sids)


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
class Slot:
    """What one tail slot holds: session ``sid``'s first ``length`` tail tokens, its tail
    starting at block ``first`` (id) after ``releases`` resets."""
    sid: int
    first: int
    releases: int
    length: int


@dataclass
class TailBuffer:
    """The batch's tails, kept from one step to the next: ``[layers, 2, slots, heads, cap, dim]``
    (slot-major: a slot's heads are one block, so attention folds slots x heads into one
    batch axis of views -- ``cache.attention.attend_shared`` -- with no copy of the tails).

    Each session of a batch owns a slot. A session whose slot continues (same tail start
    block, same ``BlockTable.releases`` -- a session reset and refilled to the same length
    holds other K/V behind the same first block -- and one token longer) appends its new
    token there, one indexed store per layer; a session new to the batch, or one that does
    not continue, has its tail gathered into a free slot (a departed session's). So a
    sequence finishing or joining costs one row's gather, not the whole batch's. The buffer
    is rebuilt -- every tail gathered again -- only when its ``key`` changes (shared prefix,
    a block moved or quantized), a tail outgrows ``cap`` or no slot is free. A copy of the
    tails only (the prefix is read in place); a member's quantized blocks are decoded into
    it, so it costs their full-precision bytes while the batch runs."""

    key: tuple
    kv: torch.Tensor
    valid: torch.Tensor
    slots: list[Slot | None]

    @classmethod
    def empty(cls, key: tuple, layers: int, heads: int, n: int, cap: int, dim: int,
              dtype: torch.dtype, filled: int = 0, rows: int = 0,
              memory: Callable[[int], torch.Tensor] | None = None) -> "TailBuffer":
        """A buffer whose every position is finite -- a slot's stale positions are masked
        out, and 0 x NaN would still be NaN -- zeroing only what the caller will not
        overwrite at once: positions ``filled..cap`` of slots ``0..rows-1`` (gathered up to
        ``filled``) and all of the slots after them. ``memory(numel)``: a flat tensor of
        ``dtype`` and at least ``numel`` elements to lay it in (its contents are not needed)."""
        shape = (layers, 2, n, heads, cap, dim)
        numel = math.prod(shape)
        kv = (torch.empty(shape, dtype=dtype) if memory is None
              else memory(numel)[:numel].view(shape))
        kv[:, :, :rows, :, filled:].zero_()
        kv[:, :, rows:].zero_()
        return cls(key, kv, torch.zeros(n, cap, dtype=torch.bool), [None] * n)

    def place(self, idents: list[Slot]) -> tuple[list[int], list[int]] | None:
        """Each session's slot and the rows to gather; None when the buffer cannot take the
        step (a tail longer than ``cap``, more sessions than free slots)."""
        cap = self.kv.shape[4]
        if max(s.length for s in idents) > cap:
            return None
        where = {s.sid: i for i, s in enumerate(self.slots) if s is not None}
        taken = {where[s.sid] for s in idents if s.sid in where}
        free = [i for i in range(len(self.slots)) if i not in taken]
        free.sort(key=lambda i: self.slots[i] is not None)  # empty slots first
        rows, gather = [], []
        for r, s in enumerate(idents):
            i = where.get(s.sid)
            old = self.slots[i] if i is not None else None
            if old is None or (old.first, old.releases, old.length + 1) != (s.first, s.releases, s.length):
                gather.append(r)
            if i is None:
                if not free:
                    return None
                i = free.pop(0)
            rows.append(i)
        return rows, gather


StepStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor, torch.Tensor, torch.Tensor], None]
"""A fused writer of a step's K/V a model may hand to ``append_and_read_batch``:
``store(arena_layer [2, H, N, D], write_pos [B], k, v [H, B, D] float32 contiguous,
tails_layer [2, S, H, cap, D], slots [n], at [n], rows [n])`` stores row b of k and v at
``write_pos[b]`` of the arena and row ``rows[i]`` at position ``at[i]`` of tail slot ``slots[i]``
(n may be 0) -- what the four indexed stores of the eager path do
(``node.models.kernels``' ``store_step_kv``)."""


TAIL_ROOM = 16
"""Decode steps a rebuilt tail buffer has room for at least; a long tail gets a quarter of its
length more, so a long decode is gathered again every ~25 % of growth, not every 16 tokens."""
SPARE_SLOTS = 0.25
"""Slots a rebuilt tail buffer keeps beyond its batch of n sessions, ``int(n * SPARE_SLOTS)``,
for sessions that join it (each slot costs a tail's bytes)."""


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
        self._tail_memory: torch.Tensor | None = None
        """The flat memory the kept tails lie in, reused by the next rebuilt buffer."""

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
        """The step's write positions, shared prefix runs and tail slots. When every member's
        blocks are in the full-precision arena the tails are gathered from it (a prefix
        scattered over many short runs -- ``cache.attention.scattered`` -- is no shared
        prefix: it goes to the tails, gathered once and appended to step by step, instead of
        a matmul pair per run every step); when a member holds quantized blocks its tail is
        decoded per layer instead (``transient``: no shared prefix, ``stats()['transient_reads']``),
        as ``read_runs`` does for one session."""
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
        idents = [Slot(t.sid, t.blocks[shared].id if len(t.blocks) > shared else -1, t.releases,
                       t.length + 1 - shared * B) for t in tables]
        write = torch.tensor([t.blocks[t.length // B].start + t.length % B for t in tables])
        key = (shared, self.blocks.generation, self.blocks.counters["quantized_blocks"])
        buf, rows, gather = self._slots(key, idents)
        lengths = torch.tensor([s.length for s in idents])
        step = BatchStep(list(sids), write, prefix, torch.arange(int(lengths.max())) < lengths[:, None],
                         buf, rows=None if rows == list(range(len(rows))) else torch.tensor(rows),
                         gather=gather)
        if gather and resident:
            step.gather_pos, _ = tail_positions(
                [[b.start for b in tables[r].blocks[shared:]] for r in gather],
                [idents[r].length for r in gather], B)
        slots = torch.tensor(rows)
        step.gather_slots, step.slots_read = [rows[r] for r in gather], max(rows) + 1
        buf.valid[slots] = torch.arange(buf.valid.shape[1]) < lengths[:, None]
        for r, i in enumerate(rows):
            buf.slots[i] = idents[r]
        kept = sorted(set(range(len(rows))) - set(gather))
        if kept:
            step.appends = (slots[kept], lengths[kept] - 1, torch.tensor(kept))
        return step

    def _slots(self, key: tuple, idents: list[Slot]) -> tuple[TailBuffer, list[int], list[int]]:
        """The buffer the step uses, each row's slot and the rows to gather: the kept
        buffer when it can take the step (:meth:`TailBuffer.place`), else a new one."""
        buf = self.tails if self.config.batch_tail_buffer else None
        placed = buf.place(idents) if buf is not None and buf.key == key else None
        if placed is not None:
            return buf, *placed
        c, n, longest = self.config, len(idents), max(s.length for s in idents)
        buf = TailBuffer.empty(key, c.num_layers, c.num_heads, n + int(n * SPARE_SLOTS),
                               longest + max(TAIL_ROOM, longest // 4), c.head_dim,
                               self.tail_dtype(), filled=longest, rows=n,
                               memory=self._memory if c.batch_tail_buffer else None)
        self.tails = buf if c.batch_tail_buffer else None  # kept only when reused
        return buf, list(range(n)), list(range(n))

    def _memory(self, numel: int) -> torch.Tensor:
        """Flat memory for a rebuilt tail buffer: the kept one's when it is large enough (every
        tail is gathered again, so none of it is needed), else new with a quarter to spare.
        A fresh allocation of a buffer's tens of MB is page-faulted in anew on each rebuild."""
        mem, dtype = self._tail_memory, self.tail_dtype()
        if mem is None or mem.dtype != dtype or mem.numel() < numel:
            self.tails = self._tail_memory = None  # the old memory freed before the new is taken
            self._tail_memory = torch.empty(numel + numel // 4, dtype=dtype)
        return self._tail_memory

    def tail_dtype(self) -> torch.dtype:
        """What the tail copy holds (``CacheConfig.batch_tail_dtype``; fp32 follows the arena)."""
        return torch.bfloat16 if self.config.batch_tail_dtype == "bf16" else self.arena.kv.dtype

    def append_and_read(self, step: BatchStep, layer: int, k: torch.Tensor, v: torch.Tensor,
                        store: StepStore | None = None):
        check_layer(layer, self.config.num_layers)
        c = self.config
        want = (c.num_heads, len(step.sids), c.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ShapeMismatchError(f"k, v must be {want}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if step.written != layer:
            raise ReservationError(f"batch step: layer {layer} written out of order")
        kv = self.arena.kv[layer]
        if store is not None:  # arena and appended tails in one call, then the gathers
            slots, at, rows = step.appends if step.appends is not None else (NO_ROWS,) * 3
            store(kv, step.write_pos, k, v, step.tails.kv[layer], slots, at, rows)
        else:
            kv[0].index_copy_(1, step.write_pos, k.to(kv.dtype))
            kv[1].index_copy_(1, step.write_pos, v.to(kv.dtype))
        prefix = [self.arena.run(layer, start, n) for start, n in step.prefix]
        tk, tv, valid = self._tails_of(step, layer, k, v, appended=store is not None)
        step.written += 1
        if step.written == c.num_layers:
            for sid in step.sids:
                t = self.sessions.get(sid)
                t.written = set(range(c.num_layers))
                self.commit(t)
        return prefix, tk, tv, valid

    def _tails_of(self, step: BatchStep, layer: int, k: torch.Tensor, v: torch.Tensor,
                  appended: bool = False):
        """Tail K, V [H, S, T, D] and mask [S, T] of slots ``0..S-1`` (the step's rows in order
        when ``step.rows`` is None): the gathered rows' tails stored in their slots, the
        other rows' new token appended to theirs (one indexed store each for K and V; already
        done when ``appended``, by a :data:`StepStore`)."""
        buf = step.tails
        self._gather(step, layer)
        if step.appends is not None and not appended:
            slots, at, rows = step.appends
            kk, vv = (k, v) if len(rows) == len(step.sids) else (k[:, rows], v[:, rows])
            buf.kv[layer, 0, slots, :, at] = kk.transpose(0, 1).to(buf.kv.dtype)  # [n, H, D]
            buf.kv[layer, 1, slots, :, at] = vv.transpose(0, 1).to(buf.kv.dtype)
        S, T = step.slots_read, step.tail_valid.shape[1]
        tails = buf.kv[layer, :, :S, :, :T].transpose(1, 2)  # [2, H, S, T, D] views
        return tails[0], tails[1], buf.valid[:S, :T]

    def _gather(self, step: BatchStep, layer: int) -> None:
        """Store this layer of the gathered rows' tails in their slots: one index_select for
        K and V together (9x faster than on the [H, N, D] views), or, when one of them holds
        quantized blocks, each decoded (``ReadPlanner.transient_run``)."""
        if not step.gather:
            return
        buf, c = step.tails, self.config
        into = step.gather_slots
        if step.gather_pos is None:
            for r, i in zip(step.gather, into):
                t = self.sessions.get(step.sids[r])
                (tk, tv), = self.reads.transient_run(t, layer, t.length + 1)
                n = tk.shape[1]
                buf.kv[layer, 0, i, :, :n] = tk
                buf.kv[layer, 1, i, :, :n] = tv
                buf.kv[layer, :, i, :, n:].zero_()  # finite behind the tail (see TailBuffer.empty)
            return
        G, Tp = step.gather_pos.shape
        got = self.arena.kv[layer].index_select(2, step.gather_pos.flatten())
        got = got.view(2, c.num_heads, G, Tp, c.head_dim).transpose(1, 2)
        if into == list(range(into[0], into[0] + G)):  # consecutive slots: a sliced store
            buf.kv[layer, :, into[0] : into[0] + G, :, :Tp] = got
        else:
            buf.kv[layer][:, torch.tensor(into), :, :Tp] = got.to(buf.kv.dtype)
