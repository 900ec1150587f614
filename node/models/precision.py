"""The numeric format a served model computes in (``--dtype``): one place that names them and
turns a loaded fp32 ``node.models.llama.LlamaModel`` into one.

* ``float32`` -- the reference (the converted weights as they are);
* ``bfloat16`` -- weights and activations bf16, half the weight bytes a decode step reads;
  a decode step's few rows read the weights once through ``node.models.kernels``'
  ``bf16_linear`` (q/k/v and gate/up stacked row-major, every matrix end to end on huge pages:
  ``node.models.projection.RowStack``, :func:`lay_out`; a lone token in one call through
  every layer, ``node.models.decode_step``); more rows run on oneDNN's bf16 GEMM with the
  weights kept in its packed layout (``node.models.packed``: eager bf16, which reorders the
  weight on every call, decoded no faster than fp32 here); attention in fp32;
* ``int8`` -- weight-only int8 (:class:`Int8Linear`: symmetric per-output-channel scales,
  bf16 activations), a quarter of the fp32 bytes a decode step reads: the fastest decode
  (``experiments.bench_llm``). A decode batch's rows read the codes (``node.models.kernels``'
  ``int8_linear``, and on AMX ``int8_linear_amx`` from a copy in tile order: 1 more byte per
  weight), q/k/v and gate/up stacked into one call (:class:`Int8Projection`); more rows use a
  packed bf16 copy of the dequantized weights (2 more bytes per weight). Serving only: its
  linears hold int8 buffers, not HF's parameters, so it is not trained, published or wrapped
  by adapters.

The KV cache stores K/V in its own ``kv_dtype``: bf16 by default for bf16 and int8 weights (their
K/V are bf16 values: exact; ``LlamaModel.cache_config``), fp32 for fp32 ones; it casts on the way
in and out, so every cache format works under every weight format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cache import huge_pages
from node.models import kernels, packed

DTYPES = ("float32", "bfloat16", "int8")
"""``--dtype`` choices; the first is the default and the reference."""
DEFAULT = DTYPES[0]
DECODE_ROWS = 4
"""Up to this many rows an :class:`Int8Linear` multiplies the int8 codes on the vector units
(``node.models.kernels``' ``int8_linear``, else ``aten._weight_int8pack_mm``): 1 byte read per
weight, but its multiply-adds grow with the rows."""
TILE_ROWS = 128
"""Past :data:`DECODE_ROWS` and up to this many rows, on a CPU with AMX, the codes are widened to
bf16 tile by tile and multiplied on the matrix unit (``int8_linear_amx``: still 1 byte read per
weight, once for all the rows) -- a decode batch, or a mixed step's decode rows with a short
prefill chunk. More rows -- a long prefill, or no AMX -- go through oneDNN's bf16 GEMM on a
packed bf16 copy of the dequantized weights (2 bytes per weight, read once for all the rows),
which past here computes faster than the tiles' one 32-row block at a time.
``experiments.int8_rows`` measures the three at each row count."""


def check(dtype: str) -> str:
    """``dtype`` if it names a format, else a ValueError listing them."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {list(DTYPES)}")
    return dtype


def torch_dtype(dtype: str) -> torch.dtype:
    """The activations' dtype of a format (int8 computes in bf16)."""
    return torch.float32 if check(dtype) == "float32" else torch.bfloat16


class Int8Linear(nn.Module):
    """``y = x @ (q * scale[:, None]).T`` with ``q`` int8 [out, in] and one fp32 scale per
    output row (``max |w| / 127`` of that row: symmetric, no zero point), bias-free.

    A decode batch's rows read the int8 codes (:data:`DECODE_ROWS`, :data:`TILE_ROWS`; the
    tiled kernel reads a copy of them in AMX tile order). More rows multiply a bf16 copy of
    the *dequantized* weights in oneDNN's packed layout (``node.models.packed``), so prefill and
    decode compute the same model. Both copies are derived (rebuilt when ``q`` or ``scale``
    change, left behind by copies) and cost 1 and 2 bytes per weight besides the codes."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp_(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self._drop_copies()

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor) -> "Int8Linear":
        """An :class:`Int8Linear` holding these codes [out, in] and scales [out] (shared, not copied)."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.register_buffer("q", q)
        lin.register_buffer("scale", scale)
        lin.out_features, lin.in_features = q.shape
        lin._drop_copies()
        return lin

    def _drop_copies(self) -> None:
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple | None = None
        self._tiled: torch.Tensor | None = None
        self._tiled_key: tuple | None = None

    def __getstate__(self) -> dict:
        """Copies leave the derived matrices behind (oneDNN's opaque tensors cannot be
        copied); they are rebuilt on use."""
        return {**self.__dict__, "_packed": None, "_packed_key": None, "_tiled": None,
                "_tiled_key": None}

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] these codes stand for, in ``dtype``."""
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)

    def _bf16_packed(self) -> torch.Tensor | None:
        """The dequantized weights, bf16, oneDNN-packed; None without oneDNN bf16."""
        if not packed.available():
            return None
        key = (self.q.data_ptr(), self.q._version, self.scale.data_ptr(), self.scale._version,
               packed.batch_hint())
        if self._packed_key != key:
            with torch.inference_mode(False), torch.no_grad():
                self._packed = packed.pack(self.dequantized(torch.bfloat16))
            self._packed_key = key
        return self._packed

    def _tiled_codes(self) -> torch.Tensor | None:
        """The codes in AMX tile order (``int8_pack_amx``); None without AMX or where the
        shape does not tile (out % 16, in % 32)."""
        if not kernels.amx() or self.out_features % 16 or self.in_features % 32:
            return None
        q = self._buffers["q"]
        key = (q.data_ptr(), q._version)
        if self._tiled_key != key:
            self._tiled, self._tiled_key = kernels.ops().int8_pack_amx(q), key
        return self._tiled

    def _from_codes(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows @ W.T`` read from the codes, or None where the bf16 GEMM is the faster."""
        m = rows.shape[0]
        fused = kernels.ops() if rows.dtype == torch.bfloat16 else None
        if m <= DECODE_ROWS:
            if fused is not None:
                return fused.int8_linear(rows, self.q, self.scale)
            return torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.q,
                                                      self.scale.to(rows.dtype))
        tiled = self._tiled_codes() if fused is not None and m <= TILE_ROWS else None
        return None if tiled is None else fused.int8_linear_amx(rows, tiled, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = self._from_codes(rows)
        if y is None and rows.dtype == torch.bfloat16 and (w := self._bf16_packed()) is not None:
            y = packed.linear(rows, w)
        elif y is None:
            y = F.linear(rows, self.dequantized(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Projection:
    """``x @ cat(W_1, ..., W_n).T`` of ``owner``'s :class:`Int8Linear` modules ``names`` in one
    call: their codes stacked into one [sum(out), in] matrix (one scale per output row, so
    stacking is exact) whose row blocks the modules' ``q`` and ``scale`` then are views of --
    q/k/v and gate/up read in one pass, no extra bytes. ``__call__`` returns None where it does
    not apply (a module is no :class:`Int8Linear`) and the caller runs its modules. Derived:
    re-stacked when a module's codes moved (a copy, ``load_state_dict`` into new storage)."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names
        self.key: tuple | None = None
        self.stacked: Int8Linear | None = None

    def _modules(self) -> list[Int8Linear] | None:
        mods = [self.owner._modules[n] for n in self.names]
        return mods if all(type(m) is Int8Linear for m in mods) else None

    @staticmethod
    def _key(mods: list[Int8Linear]) -> list[int]:
        """Where the codes are (a write in place is read through the views)."""
        return [m._buffers["q"].data_ptr() for m in mods]  # not nn.Module.__getattr__: hot path

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        lin = self.codes()
        return None if lin is None else lin.forward(x)  # not nn.Module.__call__: no hooks

    def codes(self) -> Int8Linear | None:
        """The one :class:`Int8Linear` the modules' product is (the stack, or the lone
        module), or None where a module is not one."""
        mods = self._modules()
        if mods is None:
            return None
        if len(mods) == 1:
            return mods[0]
        if self.key != self._key(mods):
            self._stack(mods)
        return self.stacked

    def matrix(self) -> torch.Tensor | None:
        """The codes the product reads (the stack's, or the lone module's), or None."""
        lin = self.codes()
        return None if lin is None else lin.q

    def move(self, q: torch.Tensor) -> None:
        """Read the codes from ``q`` from now on: a copy of them (int8, their shape; the slot
        :func:`end_to_end` filled), the stack's and the modules' ``q`` re-pointed to it."""
        mods, lin = self._modules(), self.codes()
        if mods is None or lin is None or q.shape != lin.q.shape:
            raise ValueError(f"no int8 codes of shape {tuple(q.shape)} to move here")
        lin.q = q  # assigned, not written into _buffers: decode_step's kept lists see it
        a = 0
        for m in mods:
            m.q = q[a : a + m.out_features]
            a += m.out_features
        self.key = self._key(mods)

    def _stack(self, mods: list[Int8Linear]) -> None:
        with torch.inference_mode(False), torch.no_grad():
            q = torch.cat([m.q for m in mods])
            scale = torch.cat([m.scale for m in mods])
            a = 0
            for m in mods:
                n = m.out_features
                m.q, m.scale = q[a : a + n], scale[a : a + n]  # buffers: views of the stack
                a += n
            self.stacked = Int8Linear.from_codes(q, scale)
        self.key = self._key(mods)


def _quantize_linears(model: nn.Module) -> None:
    """Replace each bias-free ``nn.Linear`` of the decoder layers and the output head by an
    :class:`Int8Linear` of its weights (the embedding stays bf16: a lookup reads one row)."""
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name, mod in list(owner.named_children()):
                if type(mod) is nn.Linear and mod.bias is None:
                    setattr(owner, name, Int8Linear(mod.weight))
    model.lm_head = Int8Linear(model.lm_head.weight)


def step_projections(model: nn.Module, form: str = "int8") -> list:
    """The products of a decode step in the order it reads them: per layer q/k/v, o, gate/up,
    down; then the output head -- each ``Projection``'s ``form``: ``int8``
    (:class:`Int8Projection`) or ``rows`` (``node.models.projection.RowStack``, bf16)."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [getattr(p, form) for p in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
    return out + [getattr(model.head, form)]


@torch.no_grad()
def end_to_end(mats: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer on huge pages (``cache.huge_pages``) holding ``mats`` (all of one dtype) end
    to end in this order, and each one's copy in it (a view of its shape)."""
    with torch.inference_mode(False):  # weights, usable in and out of inference mode
        buf = huge_pages.zeros((sum(q.numel() for q in mats),), mats[0].dtype)
        slots, a = [], 0
        for q in mats:
            slots.append(buf[a : a + q.numel()].view(q.shape).copy_(q))
            a += q.numel()
    return buf, slots


LAYOUT_FORMS = {"int8": "int8", "bfloat16": "rows"}
"""The ``Projection`` form whose matrices :func:`lay_out` places, by model format."""


def lay_out(model: nn.Module, form: str) -> None:
    """Every matrix a decode step reads in ``form`` (``int8``: the codes of each
    :class:`Int8Projection`; ``rows``: each bf16 ``RowStack``, the head with the tied
    embedding) in one buffer on huge pages (``cache.huge_pages``), end to end in step order:
    the step streams one buffer, no TLB miss every 4 KiB, and each product's read-ahead runs
    into the next product's matrix instead of unrelated memory. The modules' codes or
    parameters become views of it (no second copy); one given new storage later (an adapter,
    a load) is read, or stacked again, where it is."""
    projs = [p for p in step_projections(model, form) if p.matrix() is not None]
    if projs:
        _, slots = end_to_end([p.matrix() for p in projs])
        for p, m in zip(projs, slots):
            p.move(m)


@torch.no_grad()
def convert(model: nn.Module, dtype: str) -> nn.Module:
    """``model`` (a ``LlamaModel``, fp32) in format ``dtype``, in place; returns it."""
    if check(dtype) == "float32":
        return model
    model.to(torch.bfloat16)
    if dtype == "int8":
        _quantize_linears(model)
    model.relayout()
    lay_out(model, LAYOUT_FORMS[dtype])
    model.dtype_name = dtype
    return model.eval()


def dtype_of(model: nn.Module) -> str:
    """The format a model computes in (``float32`` unless :func:`convert` made it another)."""
    return getattr(model, "dtype_name", DEFAULT)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every matrix of the layers and the output head
    (the embedding's one row is left out; a tied head is counted once, as the head)."""
    head = model.lm_head
    seen = {id(model.model.embed_tokens.weight)} - {id(getattr(head, "weight", None))}
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.dim() == 0:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
