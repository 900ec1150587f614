"""LoRA adapters for ``node.models.llama.LlamaModel``, FFA-LoRA style (Sun et al., ICLR 2024).

Each targeted ``nn.Linear`` (``q_proj`` and ``v_proj`` by default) becomes
``y = W x + b + scale * B (A x)`` with

* ``W``, ``b`` the frozen base weights, **shared** with the base model (not copied: five
  adapted nodes in one process hold one 540 MB SmolLM2, not five);
* ``A`` ``[r, in]`` frozen, drawn from a **public** seed (the run's seed and the module's name),
  so every node holds the same ``A`` without sending it;
* ``B`` ``[out, r]`` zero at the start (the adapted model *is* the base model) and the only
  trained tensor.

Why FFA-LoRA: with ``A`` common and frozen, ``ΔW = scale · B A`` is linear in ``B``, so the mean
of the nodes' ``B`` updates is exactly the update of the mean (plain LoRA's ``mean(B)·mean(A)``
is not ``mean(B·A)``), the upload is half of LoRA's, and the DP noise lands on ``r · out``
values per matrix instead of ``r · (in + out)``.

Why not PEFT: ``peft`` is not installed, and ``LlamaModel`` is a plain ``nn.Module`` (not a
``transformers.PreTrainedModel``); PEFT's ``inject_adapter_in_model`` could wrap its
``nn.Linear`` layers, but its names (``lora_A.default.weight``) and its trainable ``A`` would
need overriding for FFA-LoRA, so the ~40 lines here are smaller than the glue.

Plain LoRA (``LoraConfig.train_a``): A is trained too (still initialised from the public seed)
and laid out and federated next to its B -- the comparison arm of
``experiments.private_finetune``; the chat task's default stays FFA-LoRA.

The adapted model keeps its class's behaviour (it is a ``LlamaModel`` subclass, made by
swapping the class of a parameter-sharing copy, as ``torch.nn.utils.parametrize`` does):
``parameter_layout()`` and ``trainable_parameters()`` name the ``B`` matrices only, so the
federation averages, encrypts and writes back exactly the adapters.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from crypto import Layout
from crypto.layout import LayoutEntry
from node.models.llama import LlamaModel


@dataclass(frozen=True)
class LoraConfig:
    """Which linears get adapters and how large they are."""

    rank: int = 8
    """r: columns of B / rows of A (SmolLM2 q+v at r=8: 184,320 trained values, 0.14 %)."""
    alpha: float = 32.0
    """B A is scaled by alpha / rank; FFA-LoRA trains B alone, so a larger scale than
    LoRA's usual 2 keeps the learning rate moderate."""
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    """Names of the ``nn.Linear`` submodules to adapt (matched on the last name component)."""
    seed: int = 0
    """The public seed A is drawn from (every node must use the same)."""
    train_a: bool = False
    """False: FFA-LoRA (A frozen, only B trained and sent). True: plain LoRA, A is a trained
    parameter, in the layout before its B (the federation then averages A and B separately)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module name")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """A frozen linear plus ``scale * B (A x)``; ``weight``/``bias`` keep the base names."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, a: torch.Tensor, train_a: bool = False):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # shared with the base model, frozen
        self.bias = base.bias
        self.scale = scale
        if train_a:  # plain LoRA: same state-dict name, now a parameter
            self.lora_A = nn.Parameter(a.to(base.weight.dtype))
        else:
            self.register_buffer("lora_A", a.to(base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype,
                                               device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A),
                                                              self.lora_B) * self.scale


def public_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """A ``[rank, in]`` for module ``name``: PEFT's default init (uniform ±1/sqrt(in)) from a
    generator seeded by the public seed and the name, so it is the same on every node."""
    digest = hashlib.sha256(f"fedkv-lora-A:{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=g) * 2 - 1) * bound


class LoraLlamaModel(LlamaModel):
    """A ``LlamaModel`` whose targeted linears are ``LoraLinear``; built by :func:`adapt`."""

    lora_config: LoraConfig

    def _trained(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of the trained adapters in state-dict order: the B matrices, and
        with ``train_a`` each A before its B."""
        ends = ("lora_A", "lora_B") if self.lora_config.train_a else ("lora_B",)
        return ((n, p) for n, p in self.named_parameters() if n.endswith(ends))

    def adapter_names(self) -> list[str]:
        """State-dict names of the trained adapters (the B matrices; A too under ``train_a``)."""
        return [n for n, _ in self._trained()]

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        """The B matrices (and A under ``train_a``); the base is frozen."""
        return (p for _, p in self._trained())

    def parameter_layout(self) -> Layout:
        """The trained adapters (names, shapes, order) -- built from shapes, so a model on the
        ``meta`` device (the server sizing aggregates) needs no weights."""
        return Layout(tuple(LayoutEntry(n, tuple(p.shape), "torch." + str(p.dtype).removeprefix("torch."))
                            for n, p in self._trained()))


def adapt(base: LlamaModel, config: LoraConfig = LoraConfig()) -> LoraLlamaModel:
    """A LoRA-adapted model sharing ``base``'s (frozen) weights; ``base`` is left unchanged
    apart from its parameters' ``requires_grad`` (set False: the base is never trained)."""
    if not isinstance(base, LlamaModel):
        raise TypeError(f"adapt needs a node.models.llama.LlamaModel, got {type(base).__name__}")
    if getattr(base, "dtype_name", "float32") == "int8":
        raise ValueError("a weight-only int8 model (--dtype int8) holds int8 codes, not the "
                         "float weights LoRA adapts; use --dtype float32 or bfloat16")
    for p in base.parameters():
        p.requires_grad_(False)
    model = copy.deepcopy(base, memo={id(p): p for p in base.parameters()})
    targets = [(n, m) for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in config.targets and isinstance(m, nn.Linear)]
    if not targets:
        raise ValueError(f"no nn.Linear named {config.targets} in the model")
    for name, lin in targets:
        parent_name, _, attr = name.rpartition(".")
        a = public_a(name, config.rank, lin.in_features, config.seed) if lin.weight.device.type != "meta" \
            else torch.empty(config.rank, lin.in_features, device="meta")
        setattr(model.get_submodule(parent_name), attr,
                LoraLinear(lin, config.rank, config.scale, a, config.train_a))
    model.__class__ = LoraLlamaModel
    model.lora_config = config
    return model.eval()
