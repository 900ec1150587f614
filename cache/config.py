"""Engine configuration: one dataclass, every default documented."""

from __future__ import annotations

from dataclasses import dataclass

from cache.errors import ConfigError

KV_DTYPES = ("fp32", "fp16", "int8", "int4")
QUANT_SCHEMES = ("kivi", "per_layer")


@dataclass
class CacheConfig:
    """Geometry and policy of one KV cache.

    The pool is laid out as the article describes: the arena is cut into superblocks (2 MB),
    each cut into managed blocks (128 KB) that are dedicated to one block size class (a slab),
    each made of pages (4 KB). A KV block of ``block_size`` tokens occupies a whole number of
    pages inside one managed block.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    block_size: int = 16
    """Tokens per KV block (vLLM's default is 16)."""
    kv_dtype: str = "fp32"
    """Storage of blocks that left the full-precision window: fp32, fp16, int8 or int4."""
    fp_window: int = 32
    """Newest tokens kept at full precision (KIVI's residual window); quantized modes only.
    The last, partial block is always full precision because key scales are per block."""
    quant_scheme: str = "kivi"
    """``kivi``: keys per-channel, values per-token scales; ``per_layer``: one scale per layer
    and per K/V in each block (the article's scheme; smallest metadata, largest error)."""
    tail_granule: int = 4
    """The last, partly filled block of a session lives in a smaller slot that grows in steps
    of this many tokens (moved into a full block when it fills), so a session wastes fewer
    than ``tail_granule`` token slots instead of up to ``block_size - 1``. 0 disables."""
    requant_error_threshold: float = 0.25
    """If a block's relative quantization error (||x - q(x)|| / ||x||) passes this, the block
    is kept at full precision instead (counted in ``stats()['rematerialised_blocks']``)."""
    pool_bytes: int = 64 << 20
    """Arena size, preallocated at construction."""
    superblock_bytes: int = 2 << 20
    managed_block_bytes: int | None = None
    """Slab size; ``None`` means 128 KB, or the next power of two holding 8 fp32 blocks."""
    page_bytes: int = 4 << 10

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "block_size", "page_bytes"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.quant_scheme not in QUANT_SCHEMES:
            raise ConfigError(
                f"quant_scheme must be one of {QUANT_SCHEMES}, got {self.quant_scheme!r}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for int4 packing, got {self.head_dim}")
        if self.tail_granule < 0:
            raise ConfigError(f"tail_granule must be >= 0, got {self.tail_granule}")
        if self.fp_window < 0:
            raise ConfigError(f"fp_window must be >= 0, got {self.fp_window}")
        if self.managed_block_bytes is None:
            # >= 8 full-precision blocks per slab, so the unusable tail of a slab (slots of
            # other sizes rarely divide it) stays a few percent
            need = 8 * self.block_bytes_fp32
            mb = 128 << 10
            while mb < need:
                mb *= 2
            self.managed_block_bytes = mb
        if self.superblock_bytes % self.managed_block_bytes:
            self.superblock_bytes = max(self.superblock_bytes, self.managed_block_bytes)
            if self.superblock_bytes % self.managed_block_bytes:
                raise ConfigError(
                    f"superblock_bytes {self.superblock_bytes} is not a multiple of "
                    f"managed_block_bytes {self.managed_block_bytes}"
                )
        if self.managed_block_bytes % self.page_bytes:
            raise ConfigError(
                f"managed_block_bytes {self.managed_block_bytes} is not a multiple of "
                f"page_bytes {self.page_bytes}"
            )
        if self.pool_bytes < self.superblock_bytes:
            raise ConfigError(
                f"pool_bytes {self.pool_bytes} is smaller than one superblock "
                f"({self.superblock_bytes})"
            )

    @property
    def block_bytes_fp32(self) -> int:
        return 2 * self.num_layers * self.num_heads * self.block_size * self.head_dim * 4
