"""Pressure handling: when to demote, compact, quantize and free, and where new blocks go.

* Below ``low_watermark`` of free arena memory (tested inline by the step, which then calls
  ``relieve``) a reserve demotes ``evict_batch`` cached blocks
  to warm (when there is a warm tier: they stay hits) and compacts lazily (at most once per
  ``COMPACT_EVERY`` reserves); a single allocation still evicts at most the one block it needs.
* The third allocation failure in a row compacts and retries once.
* After a step's commit the blocks that left the full-precision window are quantized
  (``quantize_old``), and before a sparse session's reserve the blocks its policy dropped in
  every layer are freed (``drop_sparse``).

Works on the block manager, the arena and the session table; never on the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cache.block import Block
from cache.compaction import COMPACT_EVERY, compact
from cache.errors import CacheFullError
from cache.session_table import BlockTable, SessionTable, end_of

if TYPE_CHECKING:
    from cache.config import CacheConfig
    from cache.manager import BlockManager
    from cache.token_arena import TokenArena


class Pressure:
    def __init__(self, config: "CacheConfig", arena: "TokenArena", blocks: "BlockManager",
                 sessions: "SessionTable") -> None:
        self.config, self.arena, self.blocks, self.sessions = config, arena, blocks, sessions
        self.reserves_since_compact = 0
        self.alloc_failures_in_row = 0

    def offload(self, tier: str = "warm") -> int:
        """Demote every unreferenced prefix-cache block out of hot memory to ``warm`` or
        ``cold`` (``KVCache.offload``); returns the blocks moved."""
        t = self.blocks.tiers
        if t is None or tier not in ("warm", "cold") or (tier == "cold" and t.cold is None):
            raise ValueError(f"cannot offload to {tier!r}: this cache has "
                             f"{'no tiers' if t is None else 'no cold store'}")
        moved = self.blocks.demote(len(self.blocks.policy))
        if tier == "cold":
            t.spill_warm()
        return moved

    def relieve(self) -> None:
        """Memory is low (``SessionSteps.reserve`` tests the watermark and counts the reserve
        inline): demote a batch, and compact at most once per ``COMPACT_EVERY`` reserves."""
        free = self.arena.free_pages / self.arena.num_pages
        if free >= self.config.low_watermark:
            return
        if self.blocks.tiers is not None and self.config.warm_bytes:
            self.blocks.counters["pressure_demotions"] += self.blocks.demote(
                self.config.evict_batch)
        if self.reserves_since_compact >= COMPACT_EVERY:
            self.compact()

    def compact(self) -> dict[str, int]:
        """Mark-and-sweep, then move scattered sessions into contiguous runs."""
        self.reserves_since_compact = 0
        return compact(self.blocks, self.arena, self.sessions)

    def allocate(self, t: BlockTable, total: int) -> tuple[Block | None, list[Block]]:
        """``_allocate``; the third failure in a row compacts and retries once."""
        try:
            out = self._allocate(t, total)
        except CacheFullError:
            self.alloc_failures_in_row += 1
            if self.alloc_failures_in_row < 3:
                raise
            self.alloc_failures_in_row = 0
            self.compact()
            out = self._allocate(t, total)
        self.alloc_failures_in_row = 0
        return out

    def _allocate(self, t: BlockTable, total: int) -> tuple[Block | None, list[Block]]:
        """Room for ``total`` tokens: the partly filled last block grows in place, or is
        copied (shared: copy-on-write; no room after it: a move) -- that copy, or None --
        and the new blocks, each placed right after its predecessor when that space is free;
        several new blocks that do not fit after it go end to end elsewhere, into a free gap
        or room made by eviction (``BlockManager.room_for_run``)."""
        B, m = self.config.block_size, self.blocks
        keep: set[int] = set()  # any read buffer may go, the session's own too: reads decode
        tail, new = None, []
        last = end_of(t.blocks[-1], B) if t.blocks else None
        try:
            if t.length % B:
                old, want = t.blocks[-1], min(B, total - (len(t.blocks) - 1) * B)
                if old.ref_count > 1 or not m.grow(old, want):
                    prev = t.blocks[-2] if len(t.blocks) > 1 else None
                    tail = m.copy(old, t.length % B, want, end_of(prev, B), keep)
                    last = end_of(tail, B)
            need = t.blocks_needed(total) - len(t.blocks)
            if need > 1 and not (last is not None and m.arena.free_at(last, need * B)):
                start = m.room_for_run(need * B)  # end to end, elsewhere
                last = last if start is None else start
            for i in range(need):
                n = min(B, total - (len(t.blocks) + i) * B)
                new.append(m.new(n, last, keep | {b.id for b in new}))
                last = end_of(new[-1], B)
        except CacheFullError:
            m.counters["alloc_failures"] += 1  # refused to the caller, nothing changed
            for b in new + ([tail] if tail else []):
                m.unref(b)
            raise
        return tail, new

    def quantize_old(self, t: BlockTable) -> None:
        """Quantize the blocks this step pushed out of the full-precision window (at the
        commit, i.e. inside the last layer's write).

        What a query attends in a quantized cache (decided in issue 22): a block is attended
        in the form the cache holds when the layer reads it. So (1) in the step that pushes a
        block out of the window, the last layer attends its quantized values while earlier
        layers attended full precision (single-session path; a batch step's tails are read
        before the commit), and every later step attends them quantized in every layer; and
        (2) a prefix-cache hit attaches blocks as cached -- quantized when another session
        pushed them out of its window -- while a cold prefill of the same prompt attends its
        own prefix at full precision in the layers before the last. A prompt's logits, and
        rarely a greedy token, therefore depend on whether another session quantized its
        prefix (int4 ``Sessions.turn_batch`` vs one-at-a-time ``Sessions.turn``). This is inherent to
        keeping only the compact form of cached blocks (that is the memory a quantized cache
        saves); making every layer attend one representation would mean quantizing before
        the prefill's attention, a change of results we do not make here. The bound is
        pinned by tests/node/models/test_batched_decode.py: a hit moves the logits by at most 3x
        what quantization moves a cold prefill's logits from full precision."""
        limit = (t.length - self.config.fp_window) // self.config.block_size
        for b in t.blocks[t.quant_checked : max(limit, t.quant_checked)]:
            if b is not None and not (b.quantized or b.kept_full_precision) and b.start is not None:
                self.blocks.quantize(b, self.config.requant_error_threshold)
        t.quant_checked = max(t.quant_checked, limit)

    def drop_sparse(self, t: BlockTable) -> None:
        """Free every full block whose positions the policy dropped in all layers (at the
        next reserve: the last layer's attention runs after the step's commit)."""
        B, n = self.config.block_size, t.length
        alive = torch.zeros(t.blocks_needed(n), dtype=torch.bool)
        for layer in range(self.config.num_layers):
            keep = t.sparsity.keep(layer, n)
            pad = torch.zeros(alive.numel() * B, dtype=torch.bool)
            pad[:n] = keep
            alive |= pad.view(-1, B).any(dim=1)
        for i in range(min(n // B, len(t.blocks) - 1)):  # never the block being written
            b = t.blocks[i]
            if b is not None and not alive[i]:
                t.blocks[i] = None
                self.blocks.unref(b)
                self.blocks.counters["sparsity_dropped_blocks"] += 1
                t.runs = None
