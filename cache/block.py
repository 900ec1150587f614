"""Block: the one record of a physical KV block (nano-vllm's ``Block``, plus what tiers,
quantization and eviction need). Nothing else in the engine keeps per-block state."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Block:
    """One block of ``block_size`` token positions, in every layer.

    A block's K/V live in up to two places: positions ``start .. start + capacity`` of the
    full-precision TokenArena (fresh blocks; a partly filled last block has less than
    ``block_size`` capacity) and ``qhandle`` in the quantized BlockPool (the only form of a
    block once it left the full-precision window: reads decode it, ``cache/steps.py``).
    """

    id: int
    version: int
    """Model version the K/V were computed under (the engine's one version counter)."""
    tokens: list[int] = field(default_factory=list)
    ref_count: int = 1
    hash: bytes | None = None
    """Content address once the block is full and complete in every layer."""
    parent_hash: bytes | None = None
    start: int | None = None
    capacity: int = 0
    qhandle: int | None = None
    format: str = "fp32"
    """Canonical storage: the full-precision dtype, or ``int8``/``int4`` once quantized."""
    tier: str = "hot"
    """Memory tier of the canonical copy (only ``hot`` until the memory-hierarchy issue)."""
    dirty: bool = True
    """Content not yet copied to any lower tier or file (persistence, next issues)."""
    last_access: int = 0
    """Engine clock of the last read, write or prefix hit."""
    frequency: int = 0
    """Prefix hits and attaches (LFU-style policies read it)."""
    error: float = 0.0
    """Accumulated relative quantization error (root of summed squares over encodings)."""
    kept_full_precision: bool = False
    """Quantization error passed the threshold: stays at full precision."""

    @property
    def full(self) -> bool:
        return self.hash is not None

    @property
    def quantized(self) -> bool:
        return self.qhandle is not None
