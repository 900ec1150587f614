"""BlockTable: one session's logical -> physical block map, its token history and read plan."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cache.block import Block
from cache.errors import LayerIndexError
from cache.sparsity import SparsityPolicy


@dataclass
class BlockTable:
    """Logical block i of the session is ``blocks[i]``.

    ``length`` tokens are complete (written in every layer); ``pending`` more are reserved and
    being written layer by layer (``written`` holds the layers done for them). ``runs`` is the
    read plan: ``[first slot, blocks]`` per run of consecutive arena slots, grown as blocks are
    appended and rebuilt only when a block of this table changes place.
    """

    sid: int
    block_size: int
    version: int
    blocks: list[Block | None] = field(default_factory=list)
    """``None`` marks a block the session's sparsity policy dropped (its memory is freed)."""
    tokens: list[int] = field(default_factory=list)
    length: int = 0
    pending: int = 0
    written: set[int] = field(default_factory=set)
    stale: bool = False
    last_access: int = 0
    quant_checked: int = 0  # blocks[:quant_checked] were quantized or kept full precision
    runs: list[list[int]] | None = None
    planned: int = 0  # blocks covered by runs
    plan_generation: int = -1
    write_at: slice | torch.Tensor | None = None  # arena token positions of the pending tokens
    sparsity: SparsityPolicy | None = None
    root: bytes = b""
    """Parent hash of block 0: ``cache.prefix.ROOT`` or the session's namespace root."""
    releases: int = 0
    """Times the session's blocks were released (reset, version move): part of a batch tail
    buffer's key, so a session refilled to the same length is gathered again, never served
    the K/V it held before (``cache.batch.TailBuffer``)."""

    def held(self) -> list[Block]:
        """The blocks the session still holds (dropped ones left out)."""
        return [b for b in self.blocks if b is not None]

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def layer_length(self, layer: int) -> int:
        """Tokens readable in ``layer``: complete ones, plus pending ones written there."""
        return self.length + (self.pending if layer in self.written else 0)

    def block_ids(self) -> set[int]:
        return {b.id for b in self.blocks if b is not None}

    def positions(self, start: int, n: int) -> slice | torch.Tensor:
        """Arena token positions of tokens [start, start + n): a slice when contiguous."""
        B = self.block_size
        pos = [self.blocks[p // B].start + p % B for p in range(start, start + n)]
        if all(b - a == 1 for a, b in zip(pos, pos[1:])):
            return slice(pos[0], pos[0] + n)
        return torch.tensor(pos)


def end_of(b: Block | None, block_size: int) -> int | None:
    """Where the block after ``b`` goes to continue its run (None: anywhere)."""
    return None if b is None or b.start is None else b.start + block_size


def check_layer(layer: int, num_layers: int) -> None:
    """LayerIndexError unless ``layer`` is an int in ``[0, num_layers)``."""
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise LayerIndexError(f"layer {layer!r} out of range: the cache has {num_layers} layers")
