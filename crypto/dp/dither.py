"""Subtractive dither: quantization whose error does not depend on the value quantized.

Why: with dp-mode distributed each client sends ``y_i = clip(update_i) + share_i`` where the
share alone is not enough noise; only the sum is the accounted Gaussian mechanism. Stochastic
rounding of ``y_i`` adds an error that depends on ``y_i`` (hence on the client's data), so the
released sum would not be a post-processing of that mechanism. With a dither ``u ~ U[0, 1)``
per coordinate, ``q = floor(y/step + u)`` and the decoder's ``q - u + 1/2`` differ from
``y/step`` by ``-frac(y/step + u) + 1/2``: uniform on (-1/2, 1/2] *whatever y is* (the classic
subtractive-dither result), so the decrypted sum is the Gaussian mechanism's output plus noise
independent of every input: post-processing, and the accounted ε holds. Saturation is not
post-processing; ``crypto.dp.privacy`` ("the coupling bound") charges it as δ_sat
(``crypto.dp.saturation``). A summand of m noise shares gets one dither, range [0, m·L] and
offset m·R (``crypto.packing.dithered_quantize``).

Both ends need ``u``: it is drawn from SHAKE-256 keyed with ``CkksContext.dither_key`` (every
key holder has it, the server does not) and labelled with (run, round, epoch, node, kind), the
same fields a ``crypto.binding`` manifest lists, so a node decrypting an aggregate subtracts the
dithers of exactly the summands the manifest names.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import numpy as np

__all__ = ["dither", "dither_total"]

_DOMAIN = b"fedkv-dither-v1"


def dither(key: bytes, run_id: int, rnd: int, epoch: int, node_id: str, kind: int, n: int) -> np.ndarray:
    """n values uniform on [0, 1) (53 random bits each), a function of the key and the label."""
    if len(key) != 32:
        raise ValueError("the dither key is 32 bytes (CkksContext.dither_key)")
    label = struct.pack(">QQIB", run_id, rnd, epoch, kind) + node_id.encode()
    raw = np.frombuffer(hashlib.shake_256(_DOMAIN + key + label).digest(8 * n), dtype=">u8").astype(np.uint64)
    return (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53


def dither_total(key: bytes, run_id: int, rnd: int, epoch: int, summands: Iterable[tuple[str, int]],
                 n: int) -> np.ndarray:
    """Sum over the summands (node id, kind) of ``dither - 1/2``: what a decoder subtracts."""
    total = np.zeros(n, dtype=np.float64)
    for node_id, kind in summands:
        total += dither(key, run_id, rnd, epoch, node_id, kind, n) - 0.5
    return total
