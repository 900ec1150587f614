"""How a group of linears reading the same input is multiplied for inference: one object per
group (:class:`Projection`) over the paths the weights' format allows -- bf16 through
oneDNN's packed copy (``node.models.packed``), int8 codes stacked
(``node.models.precision.Int8Projection``), fp32 through one fused column-major matrix
(:class:`Fused`) -- while the ``nn.Linear`` modules stay what training, adapters and the
state dict see (``node.models.llama``).
"""

from __future__ import annotations

import torch
from torch import nn

from node.models.packed import PackedProjection
from node.models.precision import Int8Projection


def transpose_storage(p: nn.Parameter) -> None:
    """Store a weight [out, in] column-major (a transposed view of a contiguous [in, out]):
    same shape, values and parameter, but ``x @ W.T`` for one token then streams the matrix
    row by row -- MKL's one-row GEMM on this layout measured 1.5-2x faster than on the
    row-major one for SmolLM2's wide matrices (lm_head, fused q/k/v and gate/up, whose
    input is the 576-wide hidden state) on this machine."""
    p.data = p.detach().t().contiguous().t()


class Fused:
    """The weights of linears reading the same input (q/k/v; gate/up) stored as the column
    blocks of one contiguous [in, sum(out)] matrix, so decode makes one matmul of them, not
    three. The parameters stay (HF names, state dict, LoRA targets): each *is* a transposed
    view of its block. ``weight()`` returns the matrix for decode only without autograd (it
    is no parameter) and while the modules are plain bias-free ``nn.Linear``s -- an adapter
    that replaced one (LoRA on ``q_proj``) turns it off and callers use the modules; a
    parameter whose storage was replaced (a dtype change, ``deepcopy``, an assignment) is
    fused again, once, in place (values unchanged, same parameter objects)."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.w: torch.Tensor | None = None
        self.ptrs: list[int] = []
        self.weight()

    def _modules(self) -> list[nn.Linear] | None:
        mods = [getattr(self.owner, n) for n in self.names]
        if any(type(m) is not nn.Linear or m.bias is not None for m in mods):
            return None
        return mods

    def _fuse(self, mods: list[nn.Linear]) -> None:
        self.w = torch.cat([m.weight.detach().t() for m in mods], dim=1).contiguous()
        a = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = self.w[:, a : a + n].t()
            a += n
        self.ptrs = [m.weight.data_ptr() for m in mods]

    def weight(self) -> torch.Tensor | None:
        mods = self._modules()
        if mods is None:
            return None
        if [m.weight.data_ptr() for m in mods] != self.ptrs:
            with torch.inference_mode(False), torch.no_grad():  # parameters stay trainable
                self._fuse(mods)
        return None if torch.is_grad_enabled() else self.w


class Projection:
    """``x @ cat(W_1, ..., W_n).T`` of ``owner``'s bias-free linears ``names`` by the path the
    weights' format allows: bf16 through oneDNN's packed copy (:class:`PackedProjection`),
    int8 codes stacked (``node.models.precision.Int8Projection``), fp32 through the fused
    column-major matrix (:class:`Fused`, with ``fuse_fp32``). ``__call__`` returns None where
    none applies -- autograd on, an adapter replaced a module -- and the caller runs the
    modules."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...], fuse_fp32: bool = True):
        self.packed = PackedProjection(owner, names)
        self.int8 = Int8Projection(owner, names)
        self.fused = Fused(owner, names) if fuse_fp32 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        y = None
        if x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            y = self.int8(x)  # first: its check is one type test, the packed path's is longer
        if y is None:
            y = self.packed(x)
        if y is None and self.fused is not None and (w := self.fused.weight()) is not None:
            y = torch.matmul(x, w)
        return y
