import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cache.quant import BlockFormat, pack_int4, relative_error, unpack_int4


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda x: len(x) % 2 == 0))
def test_int4_packing_is_exact(codes):
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_int4(t)
    assert packed.numel() == t.numel() // 2  # two values per byte
    assert torch.equal(unpack_int4(packed), t)


def test_int4_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))


def _kv(seed=0, L=2, H=3, B=16, D=8, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, H, B, D, generator=g) * scale,
            torch.randn(L, H, B, D, generator=g) * scale)


@pytest.mark.parametrize("scheme", ["kivi", "per_layer"])
@pytest.mark.parametrize("dtype,levels", [("int8", 127), ("int4", 15)])
def test_round_trip_within_half_step(scheme, dtype, levels):
    k, v = _kv(scale=3.0)
    fmt = BlockFormat(dtype, scheme, 3, 16, 8)
    kh, vh = fmt.decode(fmt.encode(k, v))
    # error bound: half a quantization step of the coarsest group (+ zero-point rounding)
    for x, xh in ((k, kh), (v, vh)):
        rng = x.abs().max() * 2 if dtype == "int8" else x.max() - x.min()
        step = float(rng) / levels
        assert float((x - xh).abs().max()) <= step * (0.5 if dtype == "int8" else 1.0) + 1e-3


def test_kivi_beats_per_layer_on_channel_outliers():
    k, v = _kv()
    k[..., 0] *= 50  # an outlier channel, as real keys have
    errs = {}
    for scheme in ("kivi", "per_layer"):
        fmt = BlockFormat("int4", scheme, 3, 16, 8)
        kh, _ = fmt.decode(fmt.encode(k, v))
        # the ordinary channels: per-layer scales spend their levels on the outlier
        errs[scheme] = float((k[..., 1:] - kh[..., 1:]).abs().mean())
    assert errs["kivi"] < errs["per_layer"] / 4


def test_int8_error_small_and_int4_larger():
    k, v = _kv()
    e = {}
    for dt in ("fp16", "int8", "int4"):
        fmt = BlockFormat(dt, "kivi", 3, 16, 8)
        e[dt] = relative_error(k, v, *fmt.decode(fmt.encode(k, v)))
    assert e["fp16"] < 1e-3 < e["int4"]
    assert e["int8"] < 0.02 and e["int4"] < 0.15
    assert e["int8"] < e["int4"]


def test_bytes_include_scales():
    H, B, D = 4, 32, 64
    fp16 = BlockFormat("fp16", "kivi", H, B, D).layer_bytes
    int8 = BlockFormat("int8", "kivi", H, B, D).layer_bytes
    int4 = BlockFormat("int4", "kivi", H, B, D).layer_bytes
    assert int8 == 2 * H * B * D + 2 * H * D + 2 * H * B  # codes + fp16 key/value scales
    assert int4 == H * B * D + 2 * H * D + 2 * H * B + H * D // 2 + H * B // 2
    assert int8 / fp16 < 0.53 and int4 / fp16 < 0.28


def test_constant_block_round_trips():
    k = torch.full((1, 1, 16, 8), 2.5)
    fmt = BlockFormat("int4", "kivi", 1, 16, 8)
    kh, vh = fmt.decode(fmt.encode(k, k.clone()))
    assert torch.allclose(kh, k, atol=1e-2) and torch.allclose(vh, k, atol=1e-2)
