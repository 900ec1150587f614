"""Block quantization: fp16, int8 and int4 (two values per byte) with KIVI or per-layer scales.

A quantized block stores, per layer, a byte region holding its scales (fp16), zero points and
codes. KIVI's layout: keys are quantized per channel (scale over the block's tokens, because
key outliers live in fixed channels) and values per token (scale over the head dimension).
int8 is symmetric (no zero point needed at 256 levels); int4 is asymmetric with an integer zero
point packed two per byte like the codes. Scales are rounded to their stored form *before*
coding so that decoding uses exactly the scale the codes were made with.

Scale storage (``scales``, KIVI only; ``per_layer`` keeps its two fp16 scales):

* ``fp16``: one fp16 scale per group (2 B).
* ``log8`` (the engine's default, ``CacheConfig.scale_format``): one fp16 reference per layer
  and K/V (the largest scale, rounded up) and, per group, a uint8 ``q`` with
  ``scale = ref * 2**(-q / 16)``: 1 B per group, 16 octaves of range, and ``q`` is rounded
  so the stored scale is never below the exact one (the group's range stays covered; its step
  grows by at most 2**(1/16) - 1 = 4.4 %). This is double quantization of the scales (as in
  QLoRA and llama.cpp's k-quants). It is what lets int4 reach <= 0.30x fp16 at 16-token
  blocks: with fp16 scales an int4 block costs ``0.25 + 0.625 (1/B + 1/D)`` of fp16 -- 0.309x
  on the federation's model (B=16, D=32) even with zero allocator waste; with ``log8``
  ``0.25 + 0.375 (1/B + 1/D)`` + 8 B/layer -- 0.286x (int8: 0.547x -> 0.524x).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

FULL_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Full-precision storage formats and their element types (the arena holds one of them)."""
_LEVELS = {"int8": 127, "int4": 15}
SCALE_FORMATS = ("fp16", "log8")
# 2**(-q/16) for every uint8 q; a table so encode and decode compute bit-identical scales
_LOG8 = torch.exp2(-torch.arange(256, dtype=torch.float64) / 16).float()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] two per byte along the last dim (even index = low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=out[..., 0::2])
    torch.bitwise_right_shift(packed, 4, out=out[..., 1::2])
    return out


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class BlockFormat:
    """Byte layout of one block in one storage dtype; ``layer_bytes`` per layer, all layers
    contiguous. ``encode``/``decode`` convert between float K/V and that layout."""

    def __init__(self, kv_dtype: str, scheme: str, heads: int, block: int, head_dim: int,
                 scales: str = "fp16"):
        if scales not in SCALE_FORMATS:
            raise ValueError(f"scales must be one of {SCALE_FORMATS}, got {scales!r}")
        self.kv_dtype, self.scheme = kv_dtype, scheme
        self.log8 = scales == "log8" and scheme != "per_layer" and kv_dtype in _LEVELS
        self.scales = "log8" if self.log8 else "fp16"
        self.H, self.B, self.D = heads, block, head_dim
        self.fields = self._fields()
        offsets, off = {}, 0
        for f in self.fields:  # fp16 scales come first so every view stays aligned
            offsets[f.name] = (off, off + f.nbytes)
            off += f.nbytes
        self.offsets = offsets
        self.layer_bytes = off + off % 2  # even, so every layer's fp16 fields stay aligned

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in _LEVELS

    def _fields(self) -> list[Field]:
        H, B, D = self.H, self.B, self.D
        if not self.quantized:
            return [Field("kv", FULL_PRECISION[self.kv_dtype], (2, H, B, D))]
        per_layer = self.scheme == "per_layer"
        k_sc, v_sc = ((1,), (1,)) if per_layer else ((H, D), (H, B))
        if self.log8:
            fields = [Field("k_ref", torch.float16, (1,)), Field("v_ref", torch.float16, (1,)),
                      Field("k_scale", torch.uint8, k_sc), Field("v_scale", torch.uint8, v_sc)]
        else:
            fields = [Field("k_scale", torch.float16, k_sc),
                      Field("v_scale", torch.float16, v_sc)]
        if self.kv_dtype == "int8":
            fields += [Field("k", torch.int8, (H, B, D)), Field("v", torch.int8, (H, B, D))]
        else:
            # zero points packed like codes; a single per-layer zero point takes one byte
            zk = (1,) if per_layer else (H, D // 2)
            zv = (1,) if per_layer else (H, (B + 1) // 2)
            fields += [
                Field("k_zp", torch.uint8, zk),
                Field("v_zp", torch.uint8, zv),
                Field("k", torch.uint8, (H, B, D // 2)),
                Field("v", torch.uint8, (H, B, D // 2)),
            ]
        return fields

    # -- encode -------------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v: [L, H, B, D] float -> uint8 [L, layer_bytes]."""
        L = k.shape[0]
        if not self.quantized:
            kv = torch.stack((k, v), dim=1).to(FULL_PRECISION[self.kv_dtype]).contiguous()
            return kv.view(torch.uint8).reshape(L, -1)
        parts: dict[str, torch.Tensor] = {}
        # keys: reduce over tokens (dim 2) per channel; values: over head_dim (dim 3) per token
        k_dims, v_dims = ((1, 2, 3), (1, 2, 3)) if self.scheme == "per_layer" else ((2,), (3,))
        for name, x, dims in (("k", k, k_dims), ("v", v, v_dims)):
            codes, scale, zp = self._quantize(x.float(), dims)
            if self.log8:
                parts[f"{name}_ref"], scale = scale
            parts[f"{name}_scale"] = scale.reshape(L, -1)
            if zp is not None:
                zp = zp.reshape(L, -1)
                if self.scheme != "per_layer":
                    if zp.shape[1] % 2:
                        zp = torch.cat((zp, torch.zeros_like(zp[:, :1])), dim=1)
                    zp = pack_int4(zp)
                parts[f"{name}_zp"] = zp
            parts[name] = pack_int4(codes) if self.kv_dtype == "int4" else codes
        out = [parts[f.name].contiguous().view(torch.uint8).reshape(L, -1) for f in self.fields]
        pad = self.layer_bytes - sum(f.nbytes for f in self.fields)
        if pad:
            out.append(torch.zeros(L, pad, dtype=torch.uint8))
        return torch.cat(out, dim=1)

    def _stored_scale(self, exact: torch.Tensor):
        """(what is stored, the float32 scale the codes are made with) for exact scales
        ``[L, ...]``: fp16, or (fp16 reference per layer, uint8 log codes) for ``log8``."""
        if not self.log8:
            scale = exact.half()
            return scale, scale.float()
        L = exact.shape[0]
        top = exact.reshape(L, -1).amax(dim=1, keepdim=True)
        ref = (top * (1 + 2**-10)).clamp_min(2**-24).half()  # rounded up: ref >= every scale
        r = ref.float().view(L, *[1] * (exact.dim() - 1))
        q = torch.floor(-16 * torch.log2(exact / r)).clamp_(0, 255).to(torch.uint8)
        return (ref, q), r * _LOG8[q.long()]

    def _quantize(self, x: torch.Tensor, dims: tuple[int, ...]):
        levels = _LEVELS[self.kv_dtype]
        if self.kv_dtype == "int8":
            scale, s = self._stored_scale(
                (x.abs().amax(dim=dims, keepdim=True) / levels).clamp_min(1e-8))
            codes = torch.round(x / s).clamp_(-levels, levels).to(torch.int8)
            return codes, scale, None
        lo = x.amin(dim=dims, keepdim=True)
        hi = x.amax(dim=dims, keepdim=True)
        scale, s = self._stored_scale(((hi - lo) / levels).clamp_min(1e-8))
        zp = torch.round(-lo / s)
        # An integer zero point must be a code: a group far from zero (all one sign, narrow)
        # widens its range to include zero instead of clamping values away.
        off = (zp < 0) | (zp > levels)
        if bool(off.any()):
            lo, hi = torch.where(off, lo.clamp_max(0), lo), torch.where(off, hi.clamp_min(0), hi)
            scale, s = self._stored_scale(((hi - lo) / levels).clamp_min(1e-8))
            zp = torch.round(-lo / s)
        zp = zp.clamp_(0, levels)
        codes = (torch.round(x / s) + zp).clamp_(0, levels).to(torch.uint8)
        return codes, scale, zp.to(torch.uint8)

    # -- decode -------------------------------------------------------------------------
    def field(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        """View one field of raw regions ``[n, layer_bytes]`` as its dtype and shape."""
        a, b = self.offsets[name]
        f = next(f for f in self.fields if f.name == name)
        return raw[:, a:b].contiguous().view(f.dtype).reshape(raw.shape[0], *f.shape)

    def decode(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [n, layer_bytes] -> (k, v), each [n, H, B, D] float32."""
        if not self.quantized:
            kv = self.field(raw, "kv").float()
            return kv[:, 0], kv[:, 1]
        n, H, B, D = raw.shape[0], self.H, self.B, self.D
        out = []
        for name in ("k", "v"):
            codes = self.field(raw, name)
            scale = self.field(raw, f"{name}_scale")
            if self.log8:
                ref = self.field(raw, f"{name}_ref").float().view(n, *[1] * (scale.dim() - 1))
                scale = ref * _LOG8[scale.long()]
            else:
                scale = scale.float()
            if self.kv_dtype == "int4":
                codes = unpack_int4(codes)
                zp = self.field(raw, f"{name}_zp")
                if self.scheme != "per_layer":
                    zp = unpack_int4(zp)
                zp = zp.float()
            else:
                zp = None
            if self.scheme == "per_layer":
                shape = (n, 1, 1, 1)
            elif name == "k":
                shape = (n, H, 1, D)
            else:
                shape = (n, H, B, 1)
            if zp is not None and self.scheme != "per_layer":
                zp = zp[..., : (D if name == "k" else B)]
            x = codes.float()
            if zp is not None:
                x = x - zp.reshape(shape)
            out.append(x * scale.reshape(shape))
        return out[0], out[1]


def relative_error(
    k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor
) -> float:
    """||x - x_hat|| / ||x|| over keys and values together."""
    num = (k - k_hat).pow(2).sum() + (v - v_hat).pow(2).sum()
    den = k.pow(2).sum() + v.pow(2).sum()
    return float((num / den.clamp_min(1e-30)).sqrt())
