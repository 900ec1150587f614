"""bf16 linears in oneDNN's own weight layout: the prefill path of ``--dtype bfloat16`` (a
decode step's few rows take ``node.models.projection.RowStack``'s ``bf16_linear``).

A bf16 ``F.linear`` hands oneDNN a plain row-major matrix that it reorders into its blocked
layout on every call; for a decode step's few rows that reorder is most of the time, so eager
bf16 decoded no faster than fp32 here. :class:`PackedProjection` keeps the reordered copy
(``torch.ops.mkldnn._reorder_linear_weight``, the weight prepacking Inductor's CPU freezing
does) and multiplies with ``torch.ops.mkldnn._linear_pointwise``; ``experiments.bench_llm``
measures the decode it gives against fp32's (docs/real-llm.md).

The packed copy is derived, never authoritative: the ``nn.Linear`` parameters stay (HF names,
state dict, LoRA wrappers, training, a follower's write-back) and the copy is rebuilt when any
of them changed -- its storage replaced (``data_ptr``) or written in place (the tensor's
version counter, which every in-place op bumps). It costs the weights' bytes once more.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def available() -> bool:
    """torch has oneDNN with bf16 kernels on this CPU (else bf16 runs the eager path)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


EXACT_ROWS = 16
"""Up to this many rows (decode steps) a product runs at its own row count."""
ROW_BUCKET = 32
"""More rows are padded to a multiple of this. oneDNN builds (JIT-compiles) a kernel per
input shape and keeps 1,024 in a cache: prefill chunks of every length made a long-running
server build one for each new length, churn that cache and slow down (``experiments.serve_soak``,
docs/serving.md); padded, at most 64 shapes cover a 2,048-token step, each built once."""


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by :func:`pack` (``x``'s rows padded to a
    :data:`ROW_BUCKET` multiple past :data:`EXACT_ROWS`; the padding's rows dropped)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m > EXACT_ROWS and m % ROW_BUCKET:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, ROW_BUCKET - m % ROW_BUCKET))
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    return y[:m].reshape(*x.shape[:-1], y.shape[-1])


def batch_hint() -> int | None:
    """The batch size oneDNN is told to block the packed weights for: 1 on several threads,
    none (its default) on one. With its default blocking oneDNN ran a 576-wide output
    (SmolLM2's o_proj, down_proj) on one thread of two; hinted, a prefill ran faster on two
    threads and slower on one."""
    return 1 if torch.get_num_threads() > 1 else None


def pack(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [out, in] in oneDNN's packed layout for :func:`batch_hint` (usable in and
    out of inference mode)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), batch_hint())


def _key(weights: list[torch.Tensor]) -> tuple:
    """What a packed copy was made from: the weights' storage and versions, and the layout."""
    return (*((w.data_ptr(), w._version) for w in weights), batch_hint())


class PackedProjection:
    """``x @ cat(W_1, ..., W_n).T`` of ``owner``'s linears ``names`` (bias-free), through one
    packed bf16 matrix. ``__call__`` returns None where the packed path does not apply --
    autograd on, weights not bf16, an adapter replaced a module, no oneDNN bf16 -- and the
    caller runs its modules instead."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        """Copies (``deepcopy``, pickle) leave the packed matrix behind: it is rebuilt on use
        (oneDNN's opaque tensors cannot be copied)."""
        return {**self.__dict__, "key": None, "packed": None}

    def _weights(self) -> list[torch.Tensor] | None:
        mods = [self.owner._modules[n] for n in self.names]  # no nn.Module.__getattr__: hot path
        if any(type(m) is not nn.Linear or m.bias is not None for m in mods):
            return None
        ws = [m.weight for m in mods]
        return ws if ws[0].dtype == torch.bfloat16 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype != torch.bfloat16 or torch.is_grad_enabled() or not available():
            return None
        ws = self._weights()
        if ws is None:
            return None
        if self.key != _key(ws):
            self.packed = pack(ws[0] if len(ws) == 1 else torch.cat([w.detach() for w in ws]))
            self.key = _key(ws)
        return linear(x, self.packed)
