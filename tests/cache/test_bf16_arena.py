"""A bf16 arena (``kv_dtype="bf16"``): K/V of bf16 values stored exactly, at half the bytes;
its blocks through the tiers bit-exact; entries a tier holds in another form (another
precision, another node's quantized format, a truncated payload) converted or refused, never
read as garbage."""

import dataclasses

import pytest
import torch

from cache import KVCache
from tests.cache.conftest import feed, small_config


def _bf16_values(kv: KVCache, sid: int, tokens: list[int], seed: int = 0) -> list:
    """Write K/V that are bf16 values (as a bf16 or int8 model's are) as fp32 tensors."""
    g = torch.Generator().manual_seed(seed)
    c = kv.config
    kv.reserve(sid, tokens)
    made = []
    for layer in range(c.num_layers):
        k, v = torch.randn(2, c.num_heads, len(tokens), c.head_dim, generator=g).bfloat16().float()
        kv.write(sid, layer, k, v)
        made.append((k, v))
    return made


def test_bf16_values_are_stored_exactly_in_half_the_bytes():
    fp32 = KVCache(small_config(block_size=8))
    half = KVCache(small_config(block_size=8, kv_dtype="bf16"))
    assert half.arena.kv.dtype == torch.bfloat16
    assert half.arena.block_bytes * 2 == fp32.arena.block_bytes
    assert half.arena.num_blocks == 2 * fp32.arena.num_blocks  # the same pool_bytes
    s = half.open_session()
    made = _bf16_values(half, s, list(range(11)))
    for layer, (k, v) in enumerate(made):
        rk, rv = half.read(s, layer)
        assert torch.equal(rk.float(), k) and torch.equal(rv.float(), v)


def test_a_bf16_block_goes_warm_and_comes_back_bit_exact():
    kv = KVCache(small_config(block_size=8, pool_bytes=32 << 10, warm_bytes=1 << 20,
                              low_watermark=0.0, kv_dtype="bf16"))
    prompts, written = [], []
    for i in range(kv.arena.num_blocks + 3):
        p = list(range(8 * i, 8 * i + 8))
        s = kv.open_session()
        written.append(_bf16_values(kv, s, p, seed=i))
        kv.close_session(s)
        prompts.append(p)
    assert kv.stats()["swaps_out"]["warm"] == 3
    s = kv.open_session()
    assert kv.match_prefix(s, prompts[0] + [0]) == 8
    for layer, (k, v) in enumerate(written[0]):
        rk, rv = kv.read(s, layer)
        assert torch.equal(rk.float(), k) and torch.equal(rv.float(), v)


def _cached_entry(kv: KVCache, tokens: list[int]):
    s = kv.open_session()
    ks, vs = feed(kv, s, tokens)
    kv.close_session(s)
    (h, b), = kv.blocks.index.items()
    return h, kv.blocks.entry(b), ks, vs


def test_an_fp32_entry_is_restored_into_a_bf16_arena_rounded():
    """A tier another cache filled (a shared cold tier, a cache rebuilt with another
    ``kv_dtype``) holds fp32 blocks: they come back as their bf16 rounding."""
    h, e, ks, vs = _cached_entry(KVCache(small_config(block_size=8)), list(range(8)))
    half = KVCache(small_config(block_size=8, kv_dtype="bf16"))
    b = half.blocks.restore(h, e)
    assert b is not None
    got = half.arena.block(b.start)
    for layer in range(half.config.num_layers):
        assert torch.equal(got[layer, 0], ks[layer].bfloat16())
        assert torch.equal(got[layer, 1], vs[layer].bfloat16())


@pytest.mark.parametrize("change", ["quantized elsewhere", "truncated", "unknown format"])
def test_an_entry_it_cannot_hold_is_refused_and_nothing_is_placed(change):
    h, e, _, _ = _cached_entry(KVCache(small_config(block_size=8)), list(range(8)))
    if change == "quantized elsewhere":  # an int8 node's block in a shared tier
        e = dataclasses.replace(e, format="int8")
    elif change == "truncated":
        e = dataclasses.replace(e, payload=e.payload[:-4])
    else:
        e = dataclasses.replace(e, format="fp8")
    half = KVCache(small_config(block_size=8, kv_dtype="bf16"))
    free = half.arena.free_pages
    assert half.blocks.restore(h, e) is None
    assert half.arena.free_pages == free and h not in half.blocks.index
