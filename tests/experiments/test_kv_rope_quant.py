"""experiments.kv_rope_quant's pieces on a tiny random Llama (the SmolLM2 run is the script's):
the simulated forward is the model's own at fp32, and the block round trip is the cache's."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cache.quant import BlockFormat  # noqa: E402
from experiments.kv_rope_quant import forward_quantized, qdq  # noqa: E402
from tests.tiny_models import SMALL, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(one_thread):
    return tiny_llama(**SMALL, rope_theta=10_000.0)


def test_fp32_simulation_is_the_models_forward(tiny):
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = tiny(torch.tensor([ids]))[0]
    for keys in ("pre", "post"):
        assert (forward_quantized(tiny, ids, "fp32", keys) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kv_dtype,rel", [("int8", 0.02), ("int4", 0.3)])
def test_block_round_trip_keeps_shape_and_partial_blocks_own_ranges(kv_dtype, rel):
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 37, 8, generator=g), torch.randn(2, 37, 8, generator=g)
    fmt = BlockFormat(kv_dtype, "kivi", 2, 16, 8, scales="log8")
    kq, vq = qdq(k, v, fmt, kv_dtype)
    assert kq.shape == k.shape and vq.shape == v.shape
    assert (kq - k).abs().max() < rel * k.abs().max() and (vq - v).abs().max() < rel * v.abs().max()
    # the last, partial block is quantized with its own range (padding repeats a token)
    k2, _ = qdq(k[:, 32:], v[:, 32:], fmt, kv_dtype)
    assert torch.equal(kq[:, 32:], k2)


def test_pre_and_post_rope_differ_only_when_quantized(tiny):
    ids = list(range(1, 30))
    a, b = (forward_quantized(tiny, ids, "int4", keys) for keys in ("pre", "post"))
    assert not torch.equal(a, b)
