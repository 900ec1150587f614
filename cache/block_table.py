"""BlockTable: one session's logical -> physical block map and its token history."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """Logical block i of the session lives in physical block ``blocks[i]``.

    ``length`` tokens are complete (written in every layer); ``pending`` more are reserved and
    being written layer by layer (``written`` holds the layers done for them).
    """

    sid: int
    block_size: int
    version: int
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    length: int = 0
    pending: int = 0
    written: set[int] = field(default_factory=set)
    stale: bool = False
    quant_checked: int = 0  # blocks[:quant_checked] were quantized or kept full precision
    gather_key: tuple[int, int] | None = None  # (layout epoch, #blocks) the gather plan is for
    gather_plan: object = None  # a cache.layout.GatherPlan for gather_key

    def slot(self, pos: int) -> tuple[int, int]:
        """(logical block index, offset in block) of token position ``pos``."""
        return divmod(pos, self.block_size)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def layer_length(self, layer: int) -> int:
        """Tokens readable in ``layer``: complete ones, plus pending ones written there."""
        return self.length + (self.pending if layer in self.written else 0)
