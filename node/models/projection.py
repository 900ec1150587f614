"""How a group of linears reading the same input is multiplied for inference: one object per
group (:class:`Projection`) over the paths the weights' format allows -- bf16 rows of a decode
step through one row-major stack (:class:`RowStack`, ``node.models.kernels``' ``bf16_linear``),
more bf16 rows through oneDNN's packed copy (``node.models.packed``), int8 codes stacked
(``node.models.precision.Int8Projection``), fp32 through one fused column-major matrix
(:class:`Fused`) -- while the ``nn.Linear`` modules stay what training, adapters and the
state dict see (``node.models.llama``).
"""

from __future__ import annotations

import torch
from torch import nn

from node.models import kernels
from node.models.packed import PackedProjection
from node.models.precision import DECODE_ROWS, Int8Projection


def transpose_storage(p: nn.Parameter) -> None:
    """Store a weight [out, in] column-major (a transposed view of a contiguous [in, out]):
    same shape, values and parameter, but ``x @ W.T`` for one token then streams the matrix
    row by row -- MKL's one-row GEMM on this layout measured 1.5-2x faster than on the
    row-major one for SmolLM2's wide matrices (lm_head, fused q/k/v and gate/up, whose
    input is the 576-wide hidden state) on this machine."""
    p.data = p.detach().t().contiguous().t()


def _plain(owner: nn.Module, names: tuple[str, ...], dtype: torch.dtype) -> list[nn.Linear] | None:
    """``owner``'s modules ``names`` where each is a plain bias-free ``nn.Linear`` of weights
    in ``dtype`` (not an adapter's wrapper), else None."""
    mods = [owner._modules[n] for n in names]  # no nn.Module.__getattr__: hot path
    if any(type(m) is not nn.Linear or m.bias is not None for m in mods):
        return None
    return mods if mods[0].weight.dtype == dtype else None


class Fused:
    """The fp32 weights of linears reading the same input (q/k/v; gate/up) stored as the column
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
        return _plain(self.owner, self.names, torch.float32)

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


class RowStack:
    """The bf16 weights of linears reading the same input (q/k/v; gate/up; or one alone) as
    the row blocks of one contiguous [sum(out), in] matrix: the layout ``bf16_linear`` reads
    (each weight row front to back, once for a decode step's rows). Each parameter *is* a view
    of its block, so the stack costs no bytes and the parameters stay what adapters and the
    state dict see; a write in place (``load_state_dict``, a write-back) is read through, and a
    parameter whose storage was replaced (a dtype change, an assignment to ``.data``) is
    stacked again, once, in place (values unchanged). ``matrix()`` is None without bf16 plain
    linears or with autograd on."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.w: torch.Tensor | None = None
        self.ptrs: list[int] = []

    def modules(self) -> list[nn.Linear] | None:
        """The stacked modules, or None where one is not a plain bf16 linear."""
        return _plain(self.owner, self.names, torch.bfloat16)

    def matrix(self) -> torch.Tensor | None:
        mods = self.modules()
        if mods is None or torch.is_grad_enabled():
            return None
        if [m.weight.data_ptr() for m in mods] != self.ptrs:
            with torch.inference_mode(False), torch.no_grad():  # weights, usable in and out of it
                self.move(torch.cat([m.weight.detach() for m in mods]))
        return self.w

    def move(self, w: torch.Tensor) -> None:
        """Read the weights from ``w`` from now on: a contiguous [sum(out), in] bf16 matrix
        holding their values (the stack, or its slot in ``precision.lay_out``'s buffer); the
        parameters re-pointed to its row blocks."""
        mods = self.modules()
        rows = sum(m.weight.shape[0] for m in mods or ())
        if mods is None or not w.is_contiguous() or w.shape != (rows, mods[0].weight.shape[1]):
            raise ValueError(f"no bf16 weights of shape {tuple(w.shape)} to move here")
        with torch.inference_mode(False), torch.no_grad():  # parameters stay trainable
            a = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight.data = w[a : a + n]
                a += n
        self.w, self.ptrs = w, [m.weight.data_ptr() for m in mods]


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
        self.rows = RowStack(owner, names)
        self.fused = Fused(owner, names) if fuse_fp32 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        y = None
        if x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            y = self.int8(x)  # first: its check is one type test, the packed path's is longer
            if y is None:
                y = self._decode_rows(x)
        if y is None:
            y = self.packed(x)
        if y is None and self.fused is not None and (w := self.fused.weight()) is not None:
            y = torch.matmul(x, w)
        return y

    def _decode_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """bf16 ``x`` of up to :data:`DECODE_ROWS` rows through the row stack
        (``bf16_linear``: each weight read once, at the memory's pace; oneDNN's packed GEMM
        took longer at one row), or None."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > DECODE_ROWS or (k := kernels.ops()) is None:
            return None
        w = self.rows.matrix()
        if w is None:
            return None
        return k.bf16_linear(rows.contiguous(), w).reshape(*x.shape[:-1], w.shape[0])
