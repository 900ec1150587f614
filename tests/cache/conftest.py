import pytest
import torch

from cache import CacheConfig, KVCache


def small_config(**kw) -> CacheConfig:
    base = dict(num_layers=2, num_heads=2, head_dim=8, block_size=4, pool_bytes=2 << 20,
                managed_block_bytes=16 << 10, page_bytes=64)
    base.update(kw)
    return CacheConfig(**base)


def feed(kv: KVCache, sid: int, tokens: list[int], seed: int = 0) -> tuple[list, list]:
    """Reserve and write random K/V for ``tokens`` in every layer; returns what was written."""
    g = torch.Generator().manual_seed(seed)
    c = kv.config
    kv.reserve(sid, tokens)
    ks, vs = [], []
    for layer in range(c.num_layers):
        k = torch.randn(c.num_heads, len(tokens), c.head_dim, generator=g)
        v = torch.randn(c.num_heads, len(tokens), c.head_dim, generator=g)
        kv.write(sid, layer, k, v)
        ks.append(k)
        vs.append(v)
    return ks, vs


@pytest.fixture
def kv() -> KVCache:
    return KVCache(small_config())
