"""TokenArena: full-precision K/V of every resident block, head-major, so runs are views.

Layout ``kv[layer, k|v, head, slot * B + t, dim]``: the K of consecutive slots s..s+n-1 in one
layer is the strided view ``kv[layer, 0, :, s*B:(s+n)*B]`` -- ``[heads, tokens, dim]`` with no
copy -- and writing a token is one indexed store per layer. A session reads its context as a
few such runs (its shared prefix, its own blocks) instead of gathering every block each step.

Placement keeps runs long: a block is put right after the session's previous block when that
slot is free; a session that starts a run gets the middle of the largest free gap (the start
when the gap opens the arena), so sessions that grow at once do not interleave their blocks.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenArena:
    def __init__(self, num_slots: int, layers: int, heads: int, block: int, dim: int,
                 dtype: torch.dtype):
        if num_slots < 1:
            raise ValueError(f"the arena needs at least one slot, got {num_slots}")
        self.num_slots, self.B = num_slots, block
        self.kv = torch.zeros(layers, 2, heads, num_slots * block, dim, dtype=dtype)
        self._free = np.ones(num_slots, dtype=bool)
        self.free_count = num_slots

    @property
    def slot_bytes(self) -> int:
        """Bytes one block occupies (every layer, K and V)."""
        L, _, H, _, D = self.kv.shape
        return 2 * L * H * self.B * D * self.kv.element_size()

    def allocate(self, after: int | None = None) -> int | None:
        """A free slot: ``after + 1`` when free, else the start of a new run; None if full."""
        if not self.free_count:
            return None
        if after is not None and after + 1 < self.num_slots and self._free[after + 1]:
            s = after + 1
        else:
            s = self._run_start()
        self._free[s] = False
        self.free_count -= 1
        return s

    def _run_start(self) -> int:
        """Middle of the largest free gap, or its start when nothing precedes it."""
        f = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(f))
        starts, ends = edges[0::2], edges[1::2]
        i = int(np.argmax(ends - starts))
        a, b = int(starts[i]), int(ends[i])
        return a if a == 0 else a + (b - a) // 2

    def free(self, slot: int) -> None:
        if self._free[slot]:
            raise ValueError(f"slot {slot} is already free")
        self._free[slot] = True
        self.free_count += 1

    def block(self, slot: int) -> torch.Tensor:
        """View ``[layers, 2, heads, B, dim]`` of one slot."""
        return self.kv[:, :, :, slot * self.B : (slot + 1) * self.B]

    def run(self, layer: int, slot: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views ``[heads, n_tokens, dim]`` of the tokens from ``slot`` on."""
        a = slot * self.B
        kv = self.kv[layer]
        return kv[0, :, a : a + n_tokens], kv[1, :, a : a + n_tokens]

    def positions(self, slot: int, offset: int, n: int) -> torch.Tensor:
        return torch.arange(slot * self.B + offset, slot * self.B + offset + n)
