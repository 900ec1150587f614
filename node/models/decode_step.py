"""A session's one-token decode step through every layer in one kernel call
(``node.models.kernels``' ``decode_layers_int8``), for weight-only int8 weights.

The fused path of ``LlamaModel._hidden`` returns to Python between its kernels, ~120 times a
step for SmolLM2; at one row each return costs about what its kernel's work does, and together
they were a fifth of a one-thread decode step (``experiments.bench_llm`` measures the step).
Here the layer loop, the K/V write into the arena and the attention over the context's runs
in place (``cache.KVCache.arena_step``) are one call, computing what the per-kernel path
computes (the same kernels, in the same order: the logits are equal; tests compare them).
:func:`run` returns None wherever it does not apply -- not int8, no kernels, an adapter, a
cache that must take part -- and the caller takes the per-kernel path.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from cache import KVCache
from node.models.precision import Int8Linear

PER_LAYER = 10
"""Tensors the kernel takes per layer: input norm, q/k/v codes and scales, o codes and scales,
post-attention norm, gate/up codes and scales, down codes and scales."""


Sources = list[tuple[dict, str, object]]
"""(dict, key, object) of every module, parameter and buffer a weight list was read from."""

_KEPT: "weakref.WeakKeyDictionary[nn.Module, tuple[list[torch.Tensor], Sources]]" = \
    weakref.WeakKeyDictionary()


def layer_weights(model: nn.Module) -> list[torch.Tensor] | None:
    """Every layer's :data:`PER_LAYER` tensors in the kernel's order, or None where a
    projection is not int8 (bf16 or fp32 weights, an adapter wrapping one). Kept between
    steps while each module, parameter and buffer it was read from is still the one in its
    place (identity checks, far cheaper than reading the ~300 tensors again through the
    stacks' own checks); a write into a weight in place is read through."""
    kept = _KEPT.get(model)
    if kept is not None and all(d.get(k) is o for d, k, o in kept[1]):
        return kept[0]
    sources: Sources = []
    out = _read_weights(model, sources)
    if out is not None:
        _KEPT[model] = (out, sources)
    return out


def _read_weights(model: nn.Module, sources: Sources) -> list[torch.Tensor] | None:
    """:func:`layer_weights` read afresh, each lookup recorded in ``sources``."""
    def get(d: dict, k: str):
        sources.append((d, k, d[k]))
        return d[k]

    out: list[torch.Tensor] = []
    layers = get(get(model._modules, "model")._modules, "layers")._modules
    for name in layers:
        mods = get(layers, name)._modules
        attn, mlp = get(mods, "self_attn"), get(mods, "mlp")
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
        out += [get(get(mods, "input_layernorm")._parameters, "weight"), qkv._buffers["q"],
                qkv._buffers["scale"], b["q"], b["scale"],
                get(get(mods, "post_attention_layernorm")._parameters, "weight"),
                gate_up._buffers["q"], gate_up._buffers["scale"], d["q"], d["scale"]]
    return out


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
    h = kernels.decode_layers_int8(x, weights, model.model.norm.weight, cos, sin, step.kv, step.row,
                                   step.runs, c.num_heads, c.num_kv_heads, c.head_dim,
                                   c.rms_norm_eps)
    cache.commit_arena_step(sid)
    return h
