"""One session's step through the cache: attach a cached prefix, reserve, write a layer, read
the context, commit.

``attach_prefix`` hangs the longest cached chain of whole blocks on an empty session (and lets
the prefetcher see it); ``reserve`` makes room for the next tokens; ``write`` stores one
layer's K/V at the reserved positions, and after the last layer ``commit`` completes the
tokens: full blocks get a content hash (prefix sharing, dedup) and blocks that left the
full-precision window are quantized. ``ReadPlanner`` gives the views a layer attends.

The decode hot path stays here: a reserve whose tokens fit in the pages the session's
unshared last block already holds allocates nothing, and memory pressure is one inline
watermark test; only when memory is low, or a block must be allocated, copied or freed, does
the pressure handler (``pressure.py``: what to demote, compact, quantize) run.

Works on the config, the arena, the block manager, the session table and the pressure
handler; never on the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from cache.attention import ARENA_STEP_DTYPES, NO_ROWS, ArenaStep, Run, Spans, scattered
from cache.block import Block
from cache.errors import CacheFullError, ReservationError, ShapeMismatchError, TensorDTypeError
from cache.prefetch import Prefetcher, make_prefetcher, prefetch_after_lookup
from cache.session_table import BlockTable, SessionTable, check_layer, end_of

if TYPE_CHECKING:
    from cache.config import CacheConfig
    from cache.manager import BlockManager
    from cache.pressure import Pressure
    from cache.token_arena import TokenArena


_NO_TAILS = torch.zeros(0)
"""A session's write through a ``StepStore`` has no batch tails to fill."""


class ReadPlanner:
    """Reading a session's context: its read plan and the runs a layer attends.

    The plan is a list of ``[arena start, blocks, first block index]`` runs of consecutive
    blocks: blocks with an arena slot (fresh ones, and quantized ones whose read buffer the
    arena still has room for) are read as views, one per run of consecutive arena blocks
    (``BlockTable.runs``); a run of quantized-only blocks (start ``None``) is decoded for the
    read, one layer at a time, into a scratch tensor that lives only as long as the read
    (``stats()['transient_reads']``). Read buffers are never allocated for a read and any
    allocation may drop them, so an open session needs its quantized blocks plus its fresh
    window, not a decoded copy of its whole context. The plan grows with appended blocks and
    is rebuilt only after a block changed place or form (``BlockManager.generation``)."""

    def __init__(self, block_size: int, arena: "TokenArena", blocks: "BlockManager") -> None:
        self.block_size, self.arena, self.blocks = block_size, arena, blocks

    def plan(self, t: BlockTable) -> list[list]:
        """The session's runs ``[start, blocks, first index]``; grown by appended blocks,
        rebuilt only after a block changed place or form. Allocates nothing."""
        B = self.block_size
        if t.runs is None or t.plan_generation != self.blocks.generation:
            t.runs, t.planned = [], 0
        if t.planned != len(t.blocks):
            t.gather = None  # the plan changes: so do the positions a gather reads
        runs = t.runs
        for i in range(t.planned, len(t.blocks)):
            b = t.blocks[i]
            if b is None:
                continue
            last = runs[-1] if runs else None
            if b.start is None:  # quantized only: decoded when read
                if last is not None and last[0] is None and last[2] + last[1] == i:
                    last[1] += 1
                else:
                    runs.append([None, 1, i])
            elif last is not None and last[0] is not None and last[0] + last[1] * B == b.start:
                last[1] += 1
            else:
                runs.append([b.start, 1, i])
        t.planned, t.plan_generation = len(t.blocks), self.blocks.generation
        return runs

    def in_arena(self, t: BlockTable) -> bool:
        """True when every block the session holds is read in place (nothing to decode)."""
        return all(start is not None for start, _, _ in self.plan(t))

    def transient_run(self, t: BlockTable, layer: int, n: int) -> list[Run]:
        """The first ``n`` positions as one run, decoded blocks and views concatenated (a
        batch member whose context is not all in the arena)."""
        runs = self._read(t, layer, n)
        return [(torch.cat([k for k, _ in runs], 1).float(),
                 torch.cat([v for _, v in runs], 1).float())]

    def resident(self, t: BlockTable, n: int) -> int:
        """Of the first ``n`` positions, how many are held (dropped blocks left out)."""
        if t.sparsity is None:  # the decode hot path: nothing is ever dropped
            return n
        B = self.block_size
        return n - B * sum(b is None for b in t.blocks[: n // B])

    def runs(self, t: BlockTable, layer: int, gather: bool = True) -> list[Run]:
        """K and V of every readable token of ``t`` in ``layer`` (see ``KVCache.read_runs``)."""
        return self._read(t, layer, t.layer_length(layer), gather)

    def _read(self, t: BlockTable, layer: int, n: int, gather: bool = True) -> list[Run]:
        """Runs of the first ``n`` positions: arena views, quantized runs decoded; with
        ``gather``, a context scattered over many short arena runs is one gathered copy
        (``_gathered``)."""
        B, n, out, decoded = self.block_size, self.resident(t, n), [], False
        plan = self.plan(t)
        if (gather and t.sparsity is None
                and (gathered := self._gathered(t, plan, layer, n)) is not None):
            return gathered
        for start, nb, i0 in plan:
            if n <= 0:
                break
            take = min(n, nb * B)
            if start is None:
                k, v = self.blocks.decode_blocks(t.blocks[i0 : i0 + nb], layer)
                out.append((k[:, :take], v[:, :take]))
                decoded = True
            else:
                out.append(self.arena.run(layer, start, take))
            n -= take
        if decoded:
            self.blocks.counters["transient_reads"] += 1
        return out

    def spans(self, t: BlockTable, layer: int) -> Spans | None:
        """The layer's whole context as :class:`Spans`, or None when a block of it must be
        decoded (quantized only) or a sparsity policy drops blocks (``runs`` then)."""
        if t.sparsity is not None:
            return None
        runs = self.run_table(t, t.layer_length(layer))
        if runs is None:
            return None
        kv = self.arena.kv[layer]
        return Spans(kv[0], kv[1], runs)

    def run_table(self, t: BlockTable, n: int) -> torch.Tensor | None:
        """int64 [runs, 2]: :meth:`arena_runs` as a tensor."""
        runs = self.arena_runs(t, n)
        return None if runs is None else torch.tensor(runs, dtype=torch.long).view(-1, 2)

    def arena_runs(self, t: BlockTable, n: int) -> list[tuple[int, int]] | None:
        """(arena start, tokens) of each run holding the first ``n`` positions; None when one
        of them is quantized only."""
        return self._arena_runs(self.plan(t), n)

    def _arena_runs(self, plan: list, n: int) -> list[tuple[int, int]] | None:
        """(arena start, tokens) of each run holding the first ``n`` positions of ``plan``;
        None when one of them is quantized only (decoded when read)."""
        out, left = [], n
        for start, nb, _ in plan:
            if left <= 0:
                break
            if start is None:
                return None
            out.append((start, min(nb * self.block_size, left)))
            left -= out[-1][1]
        return out

    def _gathered(self, t: BlockTable, plan: list, layer: int, n: int) -> list[Run] | None:
        """The first ``n`` positions as one run, gathered by one ``index_select`` when their
        arena runs are ``cache.attention.scattered`` (a view per run and a copy of them all
        cost more); None otherwise, or when a run is quantized. Every layer of a step reads the
        same positions: worked out once (``BlockTable.gather``)."""
        if t.gather is None or t.gather[0] != n:
            t.gather = (n, self._gather_positions(plan, n))
        pos = t.gather[1]
        if pos is None:
            return None
        kv = self.arena.kv[layer].index_select(2, pos)
        return [(kv[0], kv[1])]

    def _gather_positions(self, plan: list, n: int) -> torch.Tensor | None:
        """Arena positions of the first ``n`` tokens of ``plan`` when its runs are scattered."""
        runs = self._arena_runs(plan, n)
        if runs is None or not scattered([m for _, m in runs]):
            return None
        return torch.from_numpy(np.concatenate([np.arange(s, s + m) for s, m in runs]))

    def resident_positions(self, t: BlockTable, layer: int) -> torch.Tensor:
        """Logical positions of the tokens ``runs`` returns, in order."""
        B, n = self.block_size, t.layer_length(layer)
        starts = [i * B for i, b in enumerate(t.blocks[: t.blocks_needed(n)]) if b is not None]
        pos = (torch.tensor(starts).view(-1, 1) + torch.arange(B)).flatten()
        return pos[pos < n]


class SessionSteps:
    def __init__(self, config: "CacheConfig", arena: "TokenArena", blocks: "BlockManager",
                 sessions: "SessionTable", reads: ReadPlanner, pressure: "Pressure") -> None:
        self.config, self.arena, self.blocks = config, arena, blocks
        self.sessions, self.reads, self.pressure = sessions, reads, pressure
        self.prefetcher: Prefetcher | None = None
        """Made on the first lookup when ``prefetch_mode`` is not ``none`` (``_prefetch``)."""

    def attach_prefix(self, t: BlockTable, toks: list[int]) -> int:
        """``KVCache.match_prefix`` on the session's table."""
        if t.length or t.pending:
            raise ReservationError(f"match_prefix needs an empty session; {t.sid} has tokens")
        B, m = self.config.block_size, self.blocks
        m.counters["prefix_lookups"] += 1
        parent = t.root
        m.prefetch_chain(parent, toks)
        for i in range((len(toks) - 1) // B):
            b = m.lookup(parent, toks[i * B : (i + 1) * B],
                         end_of(t.blocks[-1], B) if t.blocks else None)
            if b is None:
                m.counters["prefix_miss_blocks"] += 1
                break
            m.ref(b)
            t.blocks.append(b)
            parent = b.hash
            m.counters["prefix_hit_blocks"] += 1
        t.length = len(t.blocks) * B
        t.tokens = toks[: t.length]
        t.quant_checked = len(t.blocks) if m.qpool is not None else 0
        m.counters["prefix_hit_tokens"] += t.length
        self._prefetch(t.blocks)
        return t.length

    def _prefetch(self, touched: list) -> None:
        """After a lookup: the prefetcher sees the blocks it touched and moves what it
        predicts from warm/cold into hot (``cache/prefetch/``). Built on first use and again
        when ``prefetch_mode``/``prefetch_degree`` change (a new one learns from scratch)."""
        c = self.config
        if c.prefetch_mode == "none" or not c.prefetch_degree or self.blocks.tiers is None:
            return
        p = self.prefetcher
        if p is None or p.name != c.prefetch_mode or p.degree != c.prefetch_degree:
            p = self.prefetcher = make_prefetcher(c.prefetch_mode, c.prefetch_degree)
        prefetch_after_lookup(self.blocks, p, [b.hash for b in touched])

    def reserve(self, t: BlockTable, toks: list[int]) -> None:
        """``KVCache.reserve`` on the session's table."""
        if not toks:
            raise ShapeMismatchError("reserve needs at least one token")
        if t.pending:
            raise ReservationError(
                f"session {t.sid}: {t.pending} reserved tokens are not written in every layer "
                f"yet (done: {sorted(t.written)})")
        m = self.blocks
        m.clock += 1  # the session's last use (its LRU stamp)
        t.last_access = m.clock
        if t.sparsity is not None and t.length:
            self.pressure.drop_sparse(t)
        self.pressure.reserves_since_compact += 1  # its lazy compaction counts reserves
        if self.arena.free_pages / self.arena.num_pages < self.config.low_watermark:
            self.pressure.relieve()  # memory is low: demote a batch, compact lazily
        tail, new = self._room(t, t.length + len(toks))
        if tail is not None:
            old = t.blocks[-1]
            t.blocks[-1] = tail
            shared = old.ref_count > 1
            self.blocks.unref(old)
            self.blocks.counters["cow_copies" if shared else "tail_moves"] += 1
            t.runs = None
        t.blocks.extend(new)
        del t.tokens[t.length:]  # in place: a copy touched every held token's int, each step
        t.tokens.extend(toks)
        t.pending, t.written = len(toks), set()
        t.write_at = t.positions(t.length, len(toks))

    def _room(self, t: BlockTable, total: int) -> tuple[Block | None, list[Block]]:
        """Room for ``total`` tokens: nothing to do when they fit in the pages the session's
        unshared, resident last block already holds (most decode steps), else
        ``Pressure.allocate`` (grow, copy-on-write, move, new blocks)."""
        B, page = self.config.block_size, self.arena.page
        last = t.blocks[-1] if t.length % B else None
        if (last is not None and last.ref_count == 1 and last.start is not None
                and total - (len(t.blocks) - 1) * B <= min(B, last.capacity // page * page)):
            self.pressure.alloc_failures_in_row = 0  # a success, as an allocation would be
            return None, []
        return self.pressure.allocate(t, total)

    def write(self, t: BlockTable, layer: int, k: torch.Tensor, v: torch.Tensor,
              store: Callable[..., None] | None = None) -> None:
        """``KVCache.write`` on the session's table (scattered positions through ``store``, a
        ``cache.batch.StepStore``, when given: one call for K and V, no tails); the last layer
        commits. (Typed loosely: importing the alias from ``cache.batch``, which imports this
        module, would make the two import each other.)"""
        self._check_kv(t, layer, k, v)
        dst = self.arena.kv[layer]
        if isinstance(t.write_at, slice):  # contiguous: two plain copies, nothing to index
            dst[0, :, t.write_at] = k
            dst[1, :, t.write_at] = v
        elif store is not None:
            store(dst, t.write_at, k, v, _NO_TAILS, NO_ROWS, NO_ROWS, NO_ROWS)
        else:
            dst[0].index_copy_(1, t.write_at, k.to(dst.dtype))
            dst[1].index_copy_(1, t.write_at, v.to(dst.dtype))
        t.written.add(layer)
        if len(t.written) == self.config.num_layers:
            self.commit(t)

    def arena_step(self, t: BlockTable) -> ArenaStep | None:
        """``KVCache.arena_step`` on the session's table."""
        if t.pending != 1 or t.written or t.sparsity is not None:
            return None
        if self.arena.kv.dtype not in ARENA_STEP_DTYPES:
            return None
        runs = self.reads.arena_runs(t, t.length + 1)
        if runs is None:
            return None
        row = t.write_at.start if isinstance(t.write_at, slice) else int(t.write_at[0])
        return ArenaStep(self.arena.kv, row, runs)

    def commit_arena_step(self, t: BlockTable) -> None:
        """``KVCache.commit_arena_step`` on the session's table."""
        if t.pending != 1 or t.written:
            raise ReservationError(f"session {t.sid}: no one-token step to commit (pending "
                                   f"{t.pending}, layers written {len(t.written)})")
        t.written = set(range(self.config.num_layers))
        self.commit(t)

    def _check_kv(self, t: BlockTable, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        check_layer(layer, self.config.num_layers)
        c = self.config
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TensorDTypeError(
                    f"{name} must be a floating-point torch.Tensor, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")
            want = (c.num_heads, t.pending, c.head_dim)
            if tuple(x.shape) != want:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(x.shape)}, expected {want} "
                    f"(heads, reserved tokens, head_dim) for session {t.sid}")
        if not t.pending:
            raise ReservationError(f"session {t.sid}: nothing reserved; call reserve() first")
        if layer in t.written:
            raise ReservationError(f"session {t.sid}: layer {layer} already written")

    def commit(self, t: BlockTable) -> None:
        """All layers written: tokens become complete; hash full blocks; quantize old ones
        (``Pressure.quantize_old`` says what that means for what a query attends)."""
        B, m = self.config.block_size, self.blocks
        start, t.length = t.length, t.length + t.pending
        t.pending, t.written, t.write_at = 0, set(), None
        new = []
        for bi in range(start // B, t.blocks_needed(t.length)):
            b = t.blocks[bi]
            b.tokens, b.last_access, b.dirty = t.tokens[bi * B : min((bi + 1) * B, t.length)], m.clock, True
            if len(b.tokens) == B and b.hash is None and self._register(t, bi):
                new.append(t.blocks[bi])
        if m.qpool is not None:
            self.pressure.quantize_old(t)
        for b in new:  # after quantizing: a shared store gets the compact form when there is one
            m.publish(b)

    def _register(self, t: BlockTable, bi: int) -> bool:
        """Hash the full block ``bi``; True when it is new content (not a dedup hit)."""
        prev = t.blocks[bi - 1] if bi else None
        parent = t.root if bi == 0 else (prev.hash if prev is not None else None)
        if parent is None:  # an earlier block is unhashed (forked chain) or dropped
            return False
        mine = t.blocks[bi]
        kept = self.blocks.register(mine, parent)
        if kept is not mine:
            t.blocks[bi] = kept
            t.runs = None
        if self.prefetcher is not None and kept.hash is not None:
            self.prefetcher.observe(kept.hash)  # a new block: learn the chain into it
        return kept is mine and kept.hash is not None
