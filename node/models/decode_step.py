"""A session's one-token decode step through every layer in one kernel call
(``node.models.kernels``' ``decode_layers_int8`` and ``decode_layers_bf16``), for weight-only
int8 and for bf16 weights.

The fused path of ``LlamaModel._hidden`` returns to Python between its kernels, ~120 times a
step for SmolLM2; at one row each return costs about what its kernel's work does, and together
they were a fifth of a one-thread decode step (``experiments.bench_llm`` measures the step).
Here the layer loop, the K/V write into the arena and the attention over the context's runs
in place (``cache.KVCache.arena_step``) are one call, computing what the per-kernel path
computes (the same kernels, in the same order: the logits are equal; tests compare them).
:func:`run` returns None wherever it does not apply -- fp32 weights, no kernels, an adapter, a
cache that must take part -- and the caller takes the per-kernel path. bf16 weights are read
where their row stacks (``node.models.projection.RowStack``) put them, end to end, as the
per-kernel path's ``bf16_linear`` reads them.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import nn

from cache import KVCache
from node.models import precision
from node.models.precision import Int8Linear

PER_LAYER = {"int8": 10, "bfloat16": 9}
"""Tensors the kernel takes per layer, by weight format. int8: input norm, q/k/v codes and
scales, o codes and scales, post-attention norm, gate/up codes and scales, down codes and
scales. bfloat16: input norm, q, k, v, o, post-attention norm, gate, up, down."""


class Sources:
    """What a weight list was read from: (dict, key, object) of every module, parameter and
    buffer looked up -- compared by identity in C loops (``map``), ~630 a SmolLM2 step."""

    def __init__(self) -> None:
        self.dicts: list[dict] = []
        self.keys: list[str] = []
        self.objects: list[object] = []

    def get(self, d: dict, k: str):
        """``d[k]``, recorded."""
        o = d[k]
        self.dicts.append(d)
        self.keys.append(k)
        self.objects.append(o)
        return o

    def unchanged(self) -> bool:
        return all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.objects))


_KEPT: "weakref.WeakKeyDictionary[nn.Module, tuple[list[torch.Tensor], Sources]]" = \
    weakref.WeakKeyDictionary()


def layer_weights(model: nn.Module) -> list[torch.Tensor] | None:
    """Every layer's ``PER_LAYER[format]`` tensors in the kernel's order, or None where a
    projection is not in the model's format (fp32 weights, an adapter wrapping one). Kept
    between steps while each module, parameter and buffer it was read from is still the one
    in its place (identity checks, far cheaper than reading the ~300 tensors again through
    the stacks' own checks); a write into a weight in place is read through, and so is new
    storage of a bf16 parameter (the list holds the parameters themselves)."""
    kept = _KEPT.get(model)
    if kept is not None and kept[1].unchanged():
        return kept[0]
    sources = Sources()
    read = _READERS.get(precision.dtype_of(model))
    out = None if read is None else _read_weights(model, sources, read)
    if out is not None:
        _KEPT[model] = (out, sources)
    return out


def _read_weights(model: nn.Module, sources: Sources, read) -> list[torch.Tensor] | None:
    """:func:`layer_weights` read afresh by ``read`` (one layer's tensors, or None), each
    lookup recorded in ``sources``."""
    get = sources.get
    out: list[torch.Tensor] = []
    layers = get(get(model._modules, "model")._modules, "layers")._modules
    for name in layers:
        mods = get(layers, name)._modules
        tensors = read(get, mods, get(mods, "self_attn"), get(mods, "mlp"))
        if tensors is None:
            return None
        out += tensors
    return out


def _int8_layer(get, mods: dict, attn: nn.Module,
                mlp: nn.Module) -> list[torch.Tensor] | None:
    """One layer's ``PER_LAYER["int8"]`` tensors, or None where a projection is not int8."""
    qkv, gate_up = attn.qkv.int8.codes(), mlp.gate_up.int8.codes()  # may re-stack: first
    for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                         (mlp, ("gate_proj", "up_proj", "down_proj"))):
        for n in names:
            lin = get(owner._modules, n)
            if type(lin) is Int8Linear:
                get(lin._buffers, "q"), get(lin._buffers, "scale")
    o, down = attn._modules["o_proj"], mlp._modules["down_proj"]
    if qkv is None or gate_up is None or type(o) is not Int8Linear or type(down) is not Int8Linear:
        return None
    b, d = o._buffers, down._buffers
    return [get(get(mods, "input_layernorm")._parameters, "weight"), qkv._buffers["q"],
            qkv._buffers["scale"], b["q"], b["scale"],
            get(get(mods, "post_attention_layernorm")._parameters, "weight"),
            gate_up._buffers["q"], gate_up._buffers["scale"], d["q"], d["scale"]]


def _bf16_layer(get, mods: dict, attn: nn.Module, mlp: nn.Module) -> list[torch.Tensor] | None:
    """One layer's ``PER_LAYER["bfloat16"]`` tensors -- the parameters themselves, stacked
    (``RowStack``) so each group is read as one stream -- or None where a projection is not a
    plain bf16 linear."""
    if any(p.rows.matrix() is None for p in (attn.qkv, attn.o, mlp.gate_up, mlp.down)):
        return None

    def weights(owner: nn.Module, names: tuple[str, ...]) -> list[torch.Tensor]:
        return [get(get(owner._modules, n)._parameters, "weight") for n in names]

    norm = [get(get(mods, n)._parameters, "weight") for n in ("input_layernorm",
                                                              "post_attention_layernorm")]
    return [norm[0], *weights(attn, ("q_proj", "k_proj", "v_proj", "o_proj")), norm[1],
            *weights(mlp, ("gate_proj", "up_proj", "down_proj"))]


_READERS = {"int8": _int8_layer, "bfloat16": _bf16_layer}
"""Weight format -> the reader of one layer's tensors."""
_STEPS = {"int8": "decode_layers_int8", "bfloat16": "decode_layers_bf16"}
"""Weight format -> the kernel of its one-call step."""


def run(model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        sid: int) -> torch.Tensor | None:
    """The final-normed hidden state [1, hidden] of session ``sid``'s reserved token, embedded
    as ``x`` [1, hidden] (the residual stream: updated in place) at the position of ``cos``,
    ``sin`` [1, head_dim], its K/V written and committed in every layer; None where this path
    does not apply (nothing written then)."""
    kernels = model.kernels(x)
    if kernels is None or x.shape[0] != 1:
        return None
    weights = layer_weights(model)
    if weights is None:
        return None
    step = cache.arena_step(sid)
    if step is None:
        return None
    c = model.cfg
    decode_layers = getattr(kernels, _STEPS[precision.dtype_of(model)])
    h = decode_layers(x, weights, model.model.norm.weight, cos, sin, step.kv, step.row, step.runs,
                      c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
    cache.commit_arena_step(sid)
    return h
