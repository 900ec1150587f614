"""Named, versioned tensors in namespaces (``kv/``, ``grad/``, ``param/``) inside the engine.

The node keeps its gradients and parameters here, next to its K/V, so one object owns the
node's memory and its version counter. Tensors are copied in and out: a caller mutating its
own tensor afterwards never changes what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.errors import CacheError, TensorDTypeError, UnknownTensorError

NAMESPACES = ("kv", "grad", "param")


class NonFiniteTensorError(CacheError, ValueError):
    """A tensor holding NaN or Inf; refused so a poisoned update never becomes state."""


@dataclass
class StoredTensor:
    tensor: torch.Tensor
    version: int


class TensorStore:
    def __init__(self) -> None:
        self._items: dict[str, StoredTensor] = {}

    @staticmethod
    def _check_name(name: str) -> None:
        ns, sep, rest = name.partition("/")
        if not sep or not rest or ns not in NAMESPACES:
            raise UnknownTensorError(
                f"tensor name {name!r} must be '<namespace>/<name>' with namespace in {NAMESPACES}"
            )

    def put(self, name: str, tensor: torch.Tensor, version: int | None = None) -> int:
        """Store a copy of ``tensor``; ``version`` defaults to the previous version + 1."""
        self._check_name(name)
        if not isinstance(tensor, torch.Tensor):
            raise TensorDTypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteTensorError(f"{name}: tensor holds NaN or Inf; nothing was stored")
        old = self._items.get(name)
        if version is None:
            version = old.version + 1 if old else 0
        elif old is not None and version < old.version:
            raise CacheError(f"{name}: version {version} is older than stored {old.version}")
        self._items[name] = StoredTensor(tensor.detach().to("cpu", copy=True), int(version))
        return int(version)

    def get(self, name: str) -> torch.Tensor:
        self._check_name(name)
        if name not in self._items:
            raise UnknownTensorError(f"no tensor stored under {name!r}")
        return self._items[name].tensor.clone()

    def version(self, name: str) -> int:
        self._check_name(name)
        if name not in self._items:
            raise UnknownTensorError(f"no tensor stored under {name!r}")
        return self._items[name].version

    def names(self, namespace: str | None = None) -> list[str]:
        return sorted(n for n in self._items if namespace is None or n.startswith(namespace + "/"))

    def delete(self, name: str) -> None:
        self._check_name(name)
        self._items.pop(name, None)

    def nbytes(self) -> dict[str, int]:
        out = {ns: 0 for ns in NAMESPACES}
        for n, item in self._items.items():
            out[n.split("/", 1)[0]] += item.tensor.numel() * item.tensor.element_size()
        return out
