"""The KV-cache engine: paged, quantized, prefix-shared blocks plus a versioned tensor store.

Public API::

    from cache import KVCache, CacheConfig
    kv = KVCache(CacheConfig(num_layers=4, num_heads=4, head_dim=64, kv_dtype="int8"))
    sid = kv.open_session()                        # or open_session(sparsity=policy)
    reused = kv.match_prefix(sid, prompt_tokens)   # tokens whose K/V are already cached
    kv.reserve(sid, new_tokens)                    # room for the tokens about to be computed
    for layer in range(4):
        runs = kv.append_and_read(sid, layer, k, v)  # k, v: [heads, new_tokens, head_dim]
        out = cache.attention.attend(q, runs)      # runs: views into the arena, no gather
    step = kv.begin_batch(sids, next_tokens)       # many sessions, one forward per step
    prefix, tail_k, tail_v, valid = kv.append_and_read_batch(step, layer, k, v)

``KVCache`` is the façade; ``Block`` records live in ``BlockManager`` (``manager.py``),
full-precision K/V in the head-major ``TokenArena``, quantized blocks in ``BlockPool``.

``cache`` knows nothing of ``crypto``, ``node`` or Flower.
"""

from cache.config import CacheConfig, KV_DTYPES
from cache.engine import KVCache
from cache.errors import (
    CacheError,
    CacheFullError,
    ClosedSessionError,
    ConfigError,
    LayerIndexError,
    ReservationError,
    ShapeMismatchError,
    StaleSessionError,
    TensorDTypeError,
    UnknownSessionError,
    UnknownTensorError,
)
from cache.sizing import cache_size, cache_size_article
from cache.tunables import TUNABLES, UnknownTunableError

__all__ = [
    "CacheConfig",
    "KV_DTYPES",
    "KVCache",
    "CacheError",
    "CacheFullError",
    "ClosedSessionError",
    "ConfigError",
    "LayerIndexError",
    "ReservationError",
    "ShapeMismatchError",
    "StaleSessionError",
    "TensorDTypeError",
    "UnknownSessionError",
    "UnknownTensorError",
    "cache_size",
    "cache_size_article",
    "TUNABLES",
    "UnknownTunableError",
]
