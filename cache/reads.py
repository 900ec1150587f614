"""Reading a session's context: its read plan (runs of consecutive arena blocks) and the views.

A session is read as views into the full-precision arena, one per run of consecutive blocks
(``BlockTable.runs``): the plan grows with appended blocks and is rebuilt -- quantized-only
blocks decoded into a read buffer, once -- only after a block changed place. When the read
buffer has no room, the context is decoded for one read only (``transient_run``).

Works on the block manager and the arena; never on the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cache.attention import Run
from cache.block_table import BlockTable, end_of
from cache.errors import CacheFullError

if TYPE_CHECKING:
    from cache.manager import BlockManager
    from cache.token_arena import TokenArena


class ReadPlanner:
    def __init__(self, block_size: int, arena: "TokenArena", blocks: "BlockManager") -> None:
        self.block_size, self.arena, self.blocks = block_size, arena, blocks

    def plan(self, t: BlockTable, keep: set[int] | None = None) -> list[list[int]]:
        """The session's runs of consecutive blocks ([start, blocks]); grown by appended
        blocks, rebuilt (and quantized-only blocks decoded, once) only after a block changed
        place. Making room never drops the read buffer of a block in ``keep`` (default: the
        session's own)."""
        B = self.block_size
        if t.runs is None or t.plan_generation != self.blocks.generation:
            keep, after = t.block_ids() if keep is None else keep, None
            for b in t.held():
                self.blocks.ensure_fp(b, after, keep)
                after = end_of(b, B)
            t.runs, t.planned = [], 0
        for b in t.blocks[t.planned :]:
            if b is None:
                continue
            if t.runs and t.runs[-1][0] + t.runs[-1][1] * B == b.start:
                t.runs[-1][1] += 1
            else:
                t.runs.append([b.start, 1])
        t.planned, t.plan_generation = len(t.blocks), self.blocks.generation
        return t.runs

    def try_plan(self, t: BlockTable, keep: set[int] | None = None) -> bool:
        try:
            self.plan(t, keep)
            return True
        except CacheFullError:  # no room for a read buffer: reads decode per step instead
            t.runs = None
            return False

    def transient_run(self, t: BlockTable, layer: int, n: int) -> list[Run]:
        """The context decoded for this read only (no read buffer fits): one temporary run."""
        self.blocks.counters["transient_reads"] += 1
        ks, vs = [], []
        for b in t.blocks[: t.blocks_needed(n)]:
            if b is None:
                continue
            if b.start is not None:
                k, v = self.arena.run(layer, b.start, self.block_size)
            else:
                k, v = self.blocks.decode_layer(b, layer)
            ks.append(k.float())
            vs.append(v.float())
        m = self.resident(t, n)
        return [(torch.cat(ks, 1)[:, :m], torch.cat(vs, 1)[:, :m])]

    def resident(self, t: BlockTable, n: int) -> int:
        """Of the first ``n`` positions, how many are held (dropped blocks left out)."""
        if t.sparsity is None:  # the decode hot path: nothing is ever dropped
            return n
        B = self.block_size
        return n - B * sum(b is None for b in t.blocks[: n // B])

    def runs(self, t: BlockTable, layer: int) -> list[Run]:
        """K and V of every readable token of ``t`` in ``layer`` (see ``KVCache.read_runs``)."""
        n, B = t.layer_length(layer), self.block_size
        if not self.try_plan(t):
            return self.transient_run(t, layer, n)
        n = self.resident(t, n)
        out = []
        for start, nb in t.runs:
            if n <= 0:
                break
            take = min(n, nb * B)
            out.append(self.arena.run(layer, start, take))
            n -= take
        return out

    def resident_positions(self, t: BlockTable, layer: int) -> torch.Tensor:
        """Logical positions of the tokens ``runs`` returns, in order."""
        B, n = self.block_size, t.layer_length(layer)
        starts = [i * B for i, b in enumerate(t.blocks[: t.blocks_needed(n)]) if b is not None]
        pos = (torch.tensor(starts).view(-1, 1) + torch.arange(B)).flatten()
        return pos[pos < n]
