"""BatchStep: one decode step of B sessions as index tensors (one write, one gather per layer).

Built once per step by ``KVCache.begin_batch``: the arena position of each session's new token
(one ``index_copy_`` per layer writes all of them), the runs of the longest block prefix the
sessions share (attended once for the whole batch, :func:`cache.attention.attend_shared`), and
each session's remaining tokens as a padded position matrix (one gather per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchStep:
    sids: list[int]
    write_pos: torch.Tensor
    """[B] arena token positions of the new tokens."""
    prefix: list[tuple[int, int]]
    """(arena start, tokens) per run of the shared prefix."""
    tail_pos: torch.Tensor | None
    """[B, T] arena positions of each session's own tokens (new one included), padded; None
    when the members' read buffers do not all fit: the tails are decoded per layer."""
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
    it. A bounded copy of the tails only (the prefix is read in place), like a read buffer."""

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
