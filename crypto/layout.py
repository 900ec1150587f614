"""Reversible flattening of a model's named tensors into one float vector.

CKKS encrypts flat vectors; the node holds a dict of tensors. `Layout` records names, shapes and
dtypes in order so the decrypted aggregate can be put back exactly, and carries a digest that
ciphertexts embed so an aggregate is never unflattened against another model's layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from crypto.errors import LayoutMismatchError, NonFiniteUpdateError

__all__ = ["Layout", "LayoutEntry", "flatten", "to_numpy"]


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view/copy of a numpy array or torch tensor (torch imported only if passed)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def _dtype_name(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return str(x.dtype)
    if hasattr(x, "detach"):
        return "torch." + str(x.dtype).removeprefix("torch.")
    return str(np.asarray(x).dtype)


@dataclass(frozen=True)
class LayoutEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, or "torch.<dtype>" when the source was a torch tensor

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass(frozen=True)
class Layout:
    """Order, names, shapes and dtypes of the tensors in a flat vector."""

    entries: tuple[LayoutEntry, ...]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    # --- serialization ---
    def to_json(self) -> str:
        return json.dumps(
            {"v": 1, "entries": [[e.name, list(e.shape), e.dtype] for e in self.entries]},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        try:
            obj = json.loads(text)
            if obj.get("v") != 1:
                raise ValueError("unknown layout version")
            entries = tuple(
                LayoutEntry(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in obj["entries"]
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise LayoutMismatchError(f"not a serialized Layout: {exc}") from exc
        if any(d < 0 for e in entries for d in e.shape):
            raise LayoutMismatchError("negative dimension in layout")
        return cls(entries)

    def to_bytes(self) -> bytes:
        return self.to_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Layout:
        return cls.from_json(data)

    def digest(self) -> bytes:
        """8-byte fingerprint of names/shapes/dtypes, embedded in ciphertexts."""
        return hashlib.sha256(b"fedkv-layout-v1" + self.to_bytes()).digest()[:8]

    # --- flatten / unflatten ---
    def flatten(self, tensors: Mapping[str, Any]) -> np.ndarray:
        """Flatten `tensors` in this layout's order; names and shapes must match exactly."""
        if set(tensors) != set(self.names):
            missing = sorted(set(self.names) - set(tensors))
            extra = sorted(set(tensors) - set(self.names))
            raise LayoutMismatchError(f"tensor names differ from layout: missing={missing} extra={extra}")
        out = np.empty(self.size, dtype=np.float64)
        pos = 0
        for e in self.entries:
            arr = to_numpy(tensors[e.name])
            if tuple(arr.shape) != e.shape:
                raise LayoutMismatchError(f"{e.name}: shape {tuple(arr.shape)} != layout {e.shape}")
            out[pos : pos + e.size] = arr.reshape(-1)
            pos += e.size
        return out

    def unflatten(self, vec: np.ndarray, *, as_torch: bool = False) -> dict[str, Any]:
        """Split `vec` back into named arrays with the recorded shapes and dtypes.

        Integer tensors (e.g. BatchNorm counters) come back rounded. `as_torch=True` returns
        torch tensors (with the recorded torch dtype when the source was torch).
        """
        vec = np.asarray(vec)
        if vec.ndim != 1 or vec.shape[0] != self.size:
            raise LayoutMismatchError(f"vector of shape {vec.shape} does not fit layout of size {self.size}")
        out: dict[str, Any] = {}
        pos = 0
        for e in self.entries:
            part = vec[pos : pos + e.size].reshape(e.shape)
            pos += e.size
            is_torch = e.dtype.startswith("torch.")
            np_dtype = np.dtype(_torch_to_numpy_dtype(e.dtype) if is_torch else e.dtype)
            if np.issubdtype(np_dtype, np.integer) or np_dtype == np.bool_:
                part = np.rint(part)
            arr = np.array(part, dtype=np_dtype)  # a contiguous copy; 0-d stays a 0-d array
            if as_torch:
                import torch  # local: crypto does not need torch unless asked for tensors

                tensor = torch.from_numpy(arr)
                if is_torch:
                    tensor = tensor.to(getattr(torch, e.dtype.removeprefix("torch.")))
                arr = tensor
            out[e.name] = arr
        return out


def _torch_to_numpy_dtype(name: str) -> str:
    base = name.removeprefix("torch.")
    return {"bfloat16": "float32", "half": "float16", "float": "float32", "double": "float64"}.get(base, base)


def flatten(tensors: Mapping[str, Any], *, check_finite: bool = True) -> tuple[np.ndarray, Layout]:
    """Flatten named tensors (numpy or torch) into a float64 vector plus its `Layout`.

    Order is the mapping's iteration order (a torch `state_dict` is ordered). NaN/Inf raise
    `NonFiniteUpdateError` here, before anything is encrypted.
    """
    entries = tuple(
        LayoutEntry(str(name), tuple(int(d) for d in to_numpy(t).shape), _dtype_name(t))
        for name, t in tensors.items()
    )
    layout = Layout(entries)
    vec = layout.flatten(tensors)
    if check_finite and not np.isfinite(vec).all():
        bad = [e.name for e in entries if not np.isfinite(to_numpy(tensors[e.name]).astype(np.float64)).all()]
        raise NonFiniteUpdateError(f"non-finite values (NaN/Inf) in {bad}")
    return vec, layout
