"""BlockLayout: where blocks of every storage class sit in the arena, and how to read them.

Storage classes: full blocks at full precision (``fp32``/``fp16``), full quantized blocks
(``int8``/``int4``), and tail slots (``fp32@4``, ``fp32@8``, ...) that hold a session's partly
filled last block. For each class the layout registers a pool size class and keeps a typed view
(for writing) and per-layer row views (for gathering many blocks with one ``index_select``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cache.config import KV_DTYPES, CacheConfig
from cache.pool import BlockPool
from cache.quant import BlockFormat


def fresh_dtype(config: CacheConfig) -> tuple[str, torch.dtype]:
    """Name and dtype of full-precision storage: fp16 for an fp16 cache, else fp32."""
    return ("fp16", torch.float16) if config.kv_dtype == "fp16" else ("fp32", torch.float32)


def pad_bytes(config: CacheConfig) -> int:
    """Arena padding so a head row can start at any slot (see ``BlockLayout.head_rows``)."""
    _, dt = fresh_dtype(config)
    return config.block_size * config.head_dim * torch.empty((), dtype=dt).element_size()


@dataclass
class GatherPlan:
    """How to read a session's first blocks: per class (pages, positions), and, when every
    block is full precision, head-row indices per layer for the single-gather path."""

    groups: list[tuple[str, torch.Tensor, slice | torch.Tensor]]
    heads: torch.Tensor | None


class BlockLayout:
    def __init__(self, config: CacheConfig, pool: BlockPool):
        c = self.config = config
        self.pool = pool
        self.fresh, self.dtype = fresh_dtype(c)
        item = torch.empty((), dtype=self.dtype).element_size()
        g, B = c.tail_granule, c.block_size
        self.capacity: dict[str, int] = {self.fresh: B, c.kv_dtype: B}
        if 0 < g < B:
            self.capacity.update({f"{self.fresh}@{cap}": cap for cap in range(g, B, g)})
        self.formats: dict[str, BlockFormat] = {}
        self.views: dict[str, torch.Tensor] = {}  # [slab, slot, L, 2, H, cap, D], fresh classes
        self.rows: dict[str, list[torch.Tensor]] = {}  # per class and layer, see BlockPool.rows
        for name, cap in self.capacity.items():
            dt = name.split("@")[0]
            fmt = BlockFormat(dt, c.quant_scheme, c.num_heads, cap, c.head_dim, c.scale_format)
            self.formats[name] = fmt
            pool.add_class(name, fmt.layer_bytes * c.num_layers)
            dtype = self.dtype if dt == self.fresh else torch.uint8
            size = torch.empty((), dtype=dtype).element_size()
            if dt == self.fresh:
                shape = (c.num_layers, 2, c.num_heads, cap, c.head_dim)
                self.views[name] = pool.view(name, dtype)[
                    :, :, : fmt.layer_bytes * c.num_layers // size].unflatten(-1, shape)
            self.rows[name] = [
                pool.rows(name, dtype, layer * fmt.layer_bytes // size, fmt.layer_bytes // size)
                for layer in range(c.num_layers)
            ]
        for dt in KV_DTYPES:  # every storage dtype's format, for figures (bytes per token)
            self.formats.setdefault(dt, BlockFormat(
                dt, c.quant_scheme, c.num_heads, B, c.head_dim, c.scale_format))
        # Head rows: row r holds one head's block_size x head_dim values starting r * unit
        # elements into the arena, so one index_select lands K and V of all-full-precision
        # sessions directly in [heads, tokens, head_dim] order. A tail slot's row runs past its
        # own tokens; those positions lie past the session's length and are sliced away.
        row = B * c.head_dim
        self.unit = math.gcd(c.page_bytes // item, row,
                             *(cap * c.head_dim for cap in self.capacity.values()))
        base = pool.arena.view(self.dtype)
        self.head_rows = base.as_strided(((base.numel() - row) // self.unit + 1, row),
                                         (self.unit, 1))

    def class_for(self, n_tokens: int) -> str:
        """Full-precision class for a block that will hold ``n_tokens``: a full block, or the
        smallest tail slot (a multiple of ``tail_granule``) that fits them."""
        g, B = self.config.tail_granule, self.config.block_size
        cap = -(-n_tokens // g) * g if 0 < g < B else B
        return self.fresh if cap >= B else f"{self.fresh}@{cap}"

    def classes_for(self, n_tokens: int) -> list[str]:
        """Every full-precision class that can hold ``n_tokens``, smallest first: a tail
        that finds no room in its own class takes a bigger slot rather than evict."""
        fits = [c for c in self.views if self.capacity[c] >= n_tokens]
        return sorted(fits, key=self.capacity.__getitem__)

    def view_of(self, block: int) -> torch.Tensor:
        """The typed [L, 2, H, cap, D] view of one full-precision block."""
        cls, s, idx = self.pool.location(block)
        return self.views[cls][s, idx]

    # -- reading ---------------------------------------------------------------------------
    def plan(self, blocks: list[int]) -> GatherPlan:
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for pos, b in enumerate(blocks):
            g = groups.setdefault(self.pool.location(b)[0], ([], []))
            g[0].append(self.pool.first_page(b))
            g[1].append(pos)
        plan = [
            (cls, torch.tensor(pg),
             slice(ps[0], ps[-1] + 1) if ps[-1] - ps[0] + 1 == len(ps) else torch.tensor(ps))
            for cls, (pg, ps) in groups.items()
        ]
        fresh_only = blocks and all(cls in self.views for cls in groups)
        return GatherPlan(plan, self._head_rows_of(blocks) if fresh_only else None)

    def _head_rows_of(self, blocks: list[int]) -> torch.Tensor:
        """Row indices into ``head_rows``: [layer] -> (K heads, V heads) x blocks, flat."""
        c = self.config
        H, D, L = c.num_heads, c.head_dim, c.num_layers
        elems = self.pool.page_bytes // torch.empty((), dtype=self.dtype).element_size()
        start = torch.tensor([self.pool.first_page(b) * elems for b in blocks])
        cap = torch.tensor([self.capacity[self.pool.location(b)[0]] for b in blocks]) * D
        layer = torch.arange(L).view(L, 1, 1, 1)
        kv = torch.arange(2).view(1, 2, 1, 1)
        head = torch.arange(H).view(1, 1, H, 1)
        off = start + ((layer * 2 + kv) * H + head) * cap  # [L, 2, H, blocks]
        return (off // self.unit).reshape(L, -1)

    def gather(self, plan: GatherPlan, layer: int, nb: int, n: int):
        """K and V of the first ``n`` tokens (``nb`` blocks) in ``layer``: [heads, n, dim],
        float32; quantized blocks are dequantized here, before attention's softmax."""
        c = self.config
        H, B, D = c.num_heads, c.block_size, c.head_dim
        if plan.heads is not None:  # all full precision: one gather, no transpose
            kv = self.head_rows.index_select(0, plan.heads[layer]).view(2, H, nb * B, D)
            return kv[0, :, :n].float(), kv[1, :, :n].float()
        k = torch.empty(H, nb, B, D)
        v = torch.empty_like(k)
        for cls, pages, where in plan.groups:
            raw = self.rows[cls][layer].index_select(0, pages)
            cap = self.capacity[cls]
            if cls in self.views:  # a full-precision block or tail slot
                kv = raw.view(-1, 2, H, cap, D)
                kp, vp = kv[:, 0], kv[:, 1]
            else:
                kp, vp = self.formats[cls].decode(raw)
            # one strided copy per class straight into [heads, blocks, tokens, dim]
            k[:, where, :cap] = kp.transpose(0, 1)
            v[:, where, :cap] = vp.transpose(0, 1)
        return k.view(H, nb * B, D)[:, :n], v.view(H, nb * B, D)[:, :n]
