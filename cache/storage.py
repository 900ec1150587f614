"""Where a cache's K/V live and what a block costs: the split of ``pool_bytes`` between the
full-precision ``TokenArena`` and the quantized ``BlockPool``, and per-dtype block figures."""

from __future__ import annotations

import torch

from cache.config import CacheConfig
from cache.errors import ConfigError
from cache.pool import BlockPool
from cache.quant import FULL_PRECISION, BlockFormat
from cache.token_arena import TokenArena

QUANTIZED = ("int8", "int4")


def fresh_dtype(config: CacheConfig) -> tuple[str, torch.dtype]:
    """Name and dtype of full-precision storage: a bf16 or fp16 cache's own, else fp32 (the
    window a quantized cache keeps before its blocks are coded)."""
    name = config.kv_dtype if config.kv_dtype in FULL_PRECISION else "fp32"
    return name, FULL_PRECISION[name]


def make_storage(c: CacheConfig) -> tuple[TokenArena, BlockPool | None, BlockFormat | None]:
    """Split ``pool_bytes``: all full precision, or ``read_buffer_fraction`` of it in a
    quantized cache (blocks not quantized yet: fresh windows, prompts being prefilled)."""
    _, dtype = fresh_dtype(c)
    block = 2 * c.num_layers * c.num_heads * c.block_size * c.head_dim * dtype.itemsize
    share = c.read_buffer_fraction if c.kv_dtype in QUANTIZED else 1.0
    blocks = int(c.pool_bytes * share) // block
    if blocks < 1:
        raise ConfigError(f"pool_bytes {c.pool_bytes} x {share} holds no {block}-byte block")
    arena = TokenArena(blocks, c.num_layers, c.num_heads, c.block_size, c.head_dim, dtype,
                       c.tail_granule)
    if c.kv_dtype not in QUANTIZED:
        return arena, None, None
    fmt = BlockFormat(c.kv_dtype, c.quant_scheme, c.num_heads, c.block_size, c.head_dim,
                      c.scale_format)
    pool = BlockPool(c.pool_bytes - blocks * block, None, c.managed_block_bytes, c.page_bytes)
    pool.add_class(c.kv_dtype, fmt.layer_bytes * c.num_layers)
    return arena, pool, fmt


class BlockCosts:
    """Per-dtype figures of one cache's full blocks (``KVCache.bytes_per_token`` & co.)."""

    def __init__(self, config: CacheConfig, arena: TokenArena, qpool: BlockPool | None) -> None:
        self.config, self.arena, self.qpool = config, arena, qpool
        self.fresh = fresh_dtype(config)[0]

    def dtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.fresh, self.config.kv_dtype)))

    def bytes_per_token(self, kv_dtype: str | None = None) -> float:
        c = self.config
        fmt = BlockFormat(kv_dtype or c.kv_dtype, c.quant_scheme, c.num_heads, c.block_size,
                          c.head_dim, c.scale_format)
        return fmt.layer_bytes * c.num_layers / c.block_size

    def slot_bytes(self, kv_dtype: str | None = None) -> int:
        """Bytes of the slot that holds one full block in ``kv_dtype`` (page-rounded for
        quantized blocks); ``kv_dtype`` must be one of :meth:`dtypes`."""
        d = self._dtype(kv_dtype)
        return self.arena.block_bytes if d == self.fresh else self.qpool.classes[d].slot_bytes

    def arena_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Arena bytes one token of a full ``kv_dtype`` block really costs: for quantized
        blocks a managed block's bytes over the blocks it holds (slot rounding and the slab's
        unusable tail counted), over ``block_size``."""
        d = self._dtype(kv_dtype)
        if d == self.fresh:
            return self.arena.block_bytes / self.config.block_size
        return self.qpool.arena_bytes_per_block(d) / self.config.block_size

    def _dtype(self, kv_dtype: str | None) -> str:
        d = kv_dtype or self.config.kv_dtype
        if d not in self.dtypes():
            raise ValueError(f"this cache stores full blocks as {self.dtypes()}, not "
                             f"{d!r}; build a KVCache with kv_dtype={d!r}")
        return d
