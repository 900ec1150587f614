"""TokenArena: full-precision K/V of every resident block, head-major, so runs are views.

Layout ``kv[layer, k|v, head, position, dim]``: the K of tokens at positions a..a+n-1 in one
layer is the strided view ``kv[layer, 0, :, a:a+n]`` -- ``[heads, tokens, dim]`` with no copy --
and writing a token is one indexed store per layer. A block holds B consecutive positions, so a
session whose blocks follow each other is read as one view; a session reads its context as a
few such runs (its shared prefix, its own blocks) instead of gathering every block each step.

Space is handed out in pages of ``page`` tokens (``CacheConfig.tail_granule``): a full block
takes B / page consecutive pages, a session's partly filled last block only the pages its
tokens need, and it grows in place while the next page is free (so a session wastes fewer than
``page`` token positions, not up to B - 1). Placement keeps runs long: a block goes right after
the session's previous one when that space is free; a block that starts a run goes to the
middle of the largest free gap (its start when the gap opens the arena), so sessions that grow
at once do not interleave their blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from cache import huge_pages


class TokenArena:
    def __init__(self, num_blocks: int, layers: int, heads: int, block: int, dim: int,
                 dtype: torch.dtype, page: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the arena needs room for at least one block, got {num_blocks}")
        self.B = block
        self.page = page if 0 < page < block and block % page == 0 else block
        self.num_blocks = num_blocks
        # read end to end by decode steps: on huge pages (cache/huge_pages.py)
        self.kv = huge_pages.zeros((layers, 2, heads, num_blocks * block, dim), dtype)
        self._free = np.ones(num_blocks * block // self.page, dtype=bool)
        self.free_pages = self._free.size

    @property
    def num_pages(self) -> int:
        return self._free.size

    @property
    def block_bytes(self) -> int:
        """Bytes one full block occupies (every layer, K and V)."""
        L, _, H, _, D = self.kv.shape
        return 2 * L * H * self.B * D * self.kv.element_size()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def capacity_for(self, tokens: int) -> int:
        """Token positions an allocation for ``tokens`` really gets (whole pages)."""
        return self.pages_for(tokens) * self.page

    def allocate(self, tokens: int, after: int | None = None) -> int | None:
        """Start position of room for ``tokens``: at ``after`` (the end of the previous block)
        when free, else a new run; None when no gap is big enough."""
        n = self.pages_for(tokens)
        if after is not None and after % self.page == 0 and self._is_free(after // self.page, n):
            p = after // self.page
        else:
            p = self._run_start(n)
            if p is None:
                return None
        self._free[p : p + n] = False
        self.free_pages -= n
        return p * self.page

    def grow(self, start: int, capacity: int, tokens: int) -> bool:
        """Extend the allocation at ``start`` in place to hold ``tokens``; False if the pages
        after it are taken."""
        have, need = capacity // self.page, self.pages_for(tokens)
        p = start // self.page + have
        if need <= have:
            return True
        if not self._is_free(p, need - have):
            return False
        self._free[p : p + need - have] = False
        self.free_pages -= need - have
        return True

    def free_at(self, start: int, tokens: int) -> bool:
        """``tokens`` fit at position ``start`` (page-aligned) in free pages."""
        return start % self.page == 0 and self._is_free(start // self.page, self.pages_for(tokens))

    def _is_free(self, p: int, n: int) -> bool:
        return p + n <= self._free.size and bool(self._free[p : p + n].all())

    def free_run(self, tokens: int) -> int | None:
        """Where ``allocate`` would put ``tokens`` with no predecessor to follow (see
        ``_run_start``), without taking it; None when no gap holds them."""
        p = self._run_start(self.pages_for(tokens))
        return None if p is None else p * self.page

    def placeable(self, tokens: int) -> int:
        """How many allocations of ``tokens`` the free gaps hold as they lie."""
        starts, ends = self._gaps()
        return int(((ends - starts) // self.pages_for(tokens)).sum())

    def _gaps(self) -> tuple[np.ndarray, np.ndarray]:
        """First and one-past-last page of each run of free pages."""
        edges = np.flatnonzero(np.diff(np.concatenate(([False], self._free, [False])).astype(np.int8)))
        return edges[0::2], edges[1::2]

    def oldest_run(self, tokens: int, ranks: list[tuple[int, int, int]],
                   most: int) -> int | None:
        """Start of the run for ``tokens`` whose most recently used occupant is the least
        recent, among runs of free positions and at most ``most`` tokens of evictable blocks:
        ``ranks`` holds (start, capacity, rank) of every evictable block (rank 0 is evicted
        first); any other block is not movable. None when no run qualifies."""
        n = self.pages_for(tokens)
        if n > self._free.size:
            return None
        rank = np.where(self._free, -1.0, np.inf)
        for start, capacity, r in ranks:
            rank[start // self.page : (start + capacity) // self.page] = r
        windows = np.lib.stride_tricks.sliding_window_view(rank, n)
        worst = windows.max(axis=1)
        worst[(windows >= 0).sum(axis=1) > self.pages_for(most)] = np.inf
        p = int(np.argmin(worst))
        return p * self.page if np.isfinite(worst[p]) else None

    def _run_start(self, n: int) -> int | None:
        """First page for ``n`` pages: the middle of the largest free gap, or its start when
        nothing precedes it; None when no gap holds ``n`` pages."""
        starts, ends = self._gaps()
        if not starts.size:
            return None
        i = int(np.argmax(ends - starts))
        a, b = int(starts[i]), int(ends[i])
        if b - a < n:
            return None
        return a if a == 0 else a + (b - a - n) // 2

    def free(self, start: int, capacity: int) -> None:
        p, n = start // self.page, capacity // self.page
        if not (~self._free[p : p + n]).all():
            raise ValueError(f"positions {start}..{start + capacity} are not all allocated")
        self._free[p : p + n] = True
        self.free_pages += n

    def block(self, start: int, tokens: int | None = None) -> torch.Tensor:
        """View ``[layers, 2, heads, tokens (default B), dim]`` from position ``start``."""
        return self.kv[:, :, :, start : start + (tokens or self.B)]

    def run(self, layer: int, start: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views ``[heads, n_tokens, dim]`` of the tokens from ``start`` on."""
        kv = self.kv[layer]
        return kv[0, :, start : start + n_tokens], kv[1, :, start : start + n_tokens]
