"""The models one server serves by name: the base and each LoRA adapter (as vLLM's
``--lora-modules name=path``), picked by a request's ``model``.

Each adapter is ``node.serving.adapters.load_into(base, adapter)``: a ``LoraLlamaModel`` that shares
the base's weight tensors (``node.models.lora.adapt`` copies modules, never parameters), so an adapter
costs its A and B and a KV pool, not a second model. Each served model has its own backend
and KV cache, and a request's prefix namespace is its tenant *and* its model
(``namespace``): two adapters -- or an adapter and the base -- never share K/V, which other
weights computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServedModels:
    """``base_id``'s backend first, then each adapter's by its served name."""

    base_id: str
    backend: Any
    """The base model's ``GenerationBackend``."""
    adapters: dict[str, Any] = field(default_factory=dict)
    """Served name -> that adapter's backend."""
    sources: dict[str, str] = field(default_factory=dict)
    """Served name -> where its adapter came from (a PEFT directory, or a run's version)."""

    def names(self) -> list[str]:
        return [self.base_id, *self.adapters]

    def backend_for(self, name: str) -> Any:
        return self.backend if name == self.base_id else self.adapters[name]

    def namespace(self, tenant: str, name: str) -> str:
        """The prefix-sharing namespace of ``tenant``'s requests to model ``name``."""
        return tenant if name == self.base_id else f"{tenant}@{name}"

    def listing(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models``' entries: the base, then each adapter with its ``parent``."""
        out = [{"id": self.base_id, "object": "model", "created": created, "owned_by": "fedkv",
                "version": self.backend.version}]
        for name, backend in self.adapters.items():
            out.append({"id": name, "object": "model", "created": created, "owned_by": "fedkv",
                        "version": backend.version, "parent": self.base_id,
                        "root": self.sources.get(name, name)})
        return out

    def close(self, close_base: Callable[[Any], None] | None = None) -> None:
        """Close every adapter's backend, then the base's (``close_base`` when given)."""
        for backend in self.adapters.values():
            backend.close()
        (close_base or (lambda b: b.close()))(self.backend)


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``name=PEFT_DIR`` (``--lora-modules``) -> (name, dir); ValueError naming the problem."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path or any(c.isspace() for c in name):
        raise ValueError(f"--lora-modules takes name=PEFT_DIR, got {spec!r}")
    return name, path
