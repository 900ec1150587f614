"""How many bytes a KV cache needs, two ways.

The article sizes a cache as ``2 x num_layers x hidden_size x max_seq_len x bytes`` (one K and
one V vector of the model width per token per layer). That holds only when every head has its
own K/V (multi-head attention). With grouped-query or multi-query attention K/V exist only for
``num_kv_heads`` heads, so the correct size is
``2 x num_layers x num_kv_heads x head_dim x max_seq_len x bytes`` (x batch).

:func:`arena_bytes_per_token` is what the engine really spends: a block's stored bytes (scales
included), rounded to its pool slot, with the managed block's unusable tail counted.
"""

from __future__ import annotations

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def _bytes(dtype: str | float) -> float:
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        return DTYPE_BYTES[dtype]
    return float(dtype)


def cache_size_article(
    max_seq_len: int, num_layers: int, hidden_size: int, dtype: str | float = "fp16",
    batch: int = 1,
) -> int:
    """The article's formula: 2 x layers x hidden x tokens x bytes (x batch)."""
    return int(2 * num_layers * hidden_size * max_seq_len * _bytes(dtype) * batch)


def cache_size(
    max_seq_len: int,
    num_layers: int,
    hidden_size: int,
    dtype: str | float = "fp16",
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    batch: int = 1,
) -> int:
    """Per-head formula: 2 x layers x kv_heads x head_dim x tokens x bytes (x batch).

    ``head_dim`` defaults to ``hidden_size // num_heads``; ``num_kv_heads`` to ``num_heads``
    (plain multi-head attention, where this equals the article's formula).
    """
    if num_heads is None:
        num_heads = num_kv_heads or 1
        head_dim = head_dim or hidden_size // num_heads
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by {num_heads} heads")
        head_dim = hidden_size // num_heads
    kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
    return int(2 * num_layers * kv_heads * head_dim * max_seq_len * _bytes(dtype) * batch)


def arena_bytes_per_token(config, kv_dtype: str | None = None) -> float:
    """Real arena bytes per token of a full ``block_size`` block stored as ``kv_dtype`` (default
    ``config.kv_dtype``) in a cache built from ``config``: the block's bytes (scales included)
    rounded up to whole pages, times the managed block's bytes over the slots it holds, over
    ``block_size`` (fp32/fp16 blocks live in the TokenArena at exactly their bytes).
    ``KVCache(config).arena_bytes_per_token(kv_dtype)`` is the same figure off a live cache."""
    from cache.pool import slot_bytes_for
    from cache.quant import BlockFormat

    c = config
    dt = kv_dtype or c.kv_dtype
    fmt = BlockFormat(dt, c.quant_scheme, c.num_heads, c.block_size, c.head_dim, c.scale_format)
    if not fmt.quantized:  # the full-precision TokenArena: exactly the block's bytes
        return fmt.layer_bytes * c.num_layers / c.block_size
    slot = slot_bytes_for(fmt.layer_bytes * c.num_layers, c.page_bytes)
    per_slab = c.managed_block_bytes // slot
    if per_slab < 1:
        raise ValueError(f"a {dt} block ({slot} B) does not fit a managed block")
    return c.managed_block_bytes / per_slab / c.block_size
