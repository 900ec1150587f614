"""A session's one-token decode step through every layer in one kernel call
(``node.models.kernels``' ``decode_layers_int8`` and ``decode_layers_bf16``), for weight-only
int8 and for bf16 weights.

The fused path of ``LlamaModel._hidden`` returns to Python between its kernels, ~120 times a
step for SmolLM2; at one row each return costs about what its kernel's work does, and together
they were a fifth of a one-thread decode step (``experiments.bench_llm`` measures the step).
Here the layer loop, the K/V write into the arena and the attention over the context's runs
in place (``cache.KVCache.arena_step``), and the output head, are one call, computing what the
per-kernel path computes (the same kernels, in the same order: the logits are equal; tests
compare them).
:func:`run` returns None wherever it does not apply -- fp32 weights, no kernels, an adapter, a
cache that must take part -- and the caller takes the per-kernel path. bf16 weights are read
where their row stacks (``node.models.projection.RowStack``) put them, end to end, as the
per-kernel path's ``bf16_linear`` reads them.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from cache import KVCache
from node.models import kernels as fused_kernels
from node.models import precision
from node.models.precision import Int8Linear

PER_LAYER = {"int8": 10, "bfloat16": 9}
"""Tensors the kernel takes per layer, by weight format. int8: input norm, q/k/v codes and
scales, o codes and scales, post-attention norm, gate/up codes and scales, down codes and
scales. bfloat16: input norm, q, k, v, o, post-attention norm, gate, up, down."""


_generation = 0
"""Bumped by torch's global registration hooks on every assignment of a module, parameter or
buffer into a module of a kept model (``setattr``, ``register_*``, ``add_module``, a ModuleList
or ModuleDict item, ``load_state_dict(assign=True)``): a kept weight list is stale once it
moved."""

_tracked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Every module of the models whose lists are kept. Registrations into other modules do not
bump: HF's ``LlamaModel.forward`` slices its layer list, a new ``ModuleList`` of 30 layers, on
every call, and each bump cost a decode step beside it a re-read of ~630 objects."""


def _registered(module: nn.Module, name: str, value: object) -> None:
    global _generation
    if module in _tracked:
        _generation += 1


for _register in (module_hooks.register_module_module_registration_hook,
                  module_hooks.register_module_parameter_registration_hook,
                  module_hooks.register_module_buffer_registration_hook):
    _register(_registered)


class StepWeights(NamedTuple):
    """What the one-call step reads besides the row and the cache."""

    layers: list[torch.Tensor]
    """Every layer's ``PER_LAYER[format]`` tensors in the kernel's order."""
    head: list[torch.Tensor]
    """The output head in the format (int8: codes, scales; bf16: the weight), or empty where
    it is not (an adapter on it): the caller applies it then."""
    held: tuple[object, object] | None
    """``layers`` and ``head`` as the kernels' ``TensorList``s (None without the kernels):
    converted once here, not on every step's call (each conversion takes and drops a reference
    to every tensor, their objects cold after the weights streamed)."""
    embed: nn.Module
    """The model's embedding, its final norm's weight and its rotary tables' module: looked up
    once here, not through ``nn.Module.__getattr__`` every step."""
    final_norm: torch.Tensor
    rotary: nn.Module


_KEPT: "weakref.WeakKeyDictionary[nn.Module, tuple[StepWeights, int]]" = \
    weakref.WeakKeyDictionary()


def step_weights(model: nn.Module) -> StepWeights | None:
    """The model's :class:`StepWeights`, or None where a layer's projection is not in the
    model's format (fp32 weights, an adapter wrapping one). Kept between steps until a
    module, parameter or buffer is assigned into a module of a kept model (one integer compared
    each step, not the ~630 objects the lists are read from); a write into a weight in place is
    read through, and so is new storage of a bf16 parameter (the lists hold the parameters
    themselves). Not seen: a ``del`` of a module or parameter, or a write into a module's private
    ``_modules``/``_parameters``/``_buffers`` dicts, which torch runs no hook for."""
    kept = _KEPT.get(model)
    if kept is not None and kept[1] == _generation:
        return kept[0]
    readers = _READERS.get(precision.dtype_of(model))
    layers = None if readers is None else _read_weights(model, readers[0])
    if layers is None:
        return None
    head = readers[1](model)
    kernels = fused_kernels.ops()
    held = None if kernels is None else (kernels.TensorList(layers), kernels.TensorList(head))
    inner = model.model
    out = StepWeights(layers, head, held, inner.embed_tokens, inner.norm.weight, inner.rotary_emb)
    _tracked.update(model.modules())
    _KEPT[model] = (out, _generation)  # after the read: a re-stack in it registers buffers
    return out


def layer_weights(model: nn.Module) -> list[torch.Tensor] | None:
    """:func:`step_weights`' layers, or None."""
    weights = step_weights(model)
    return None if weights is None else weights.layers


def _read_weights(model: nn.Module, read) -> list[torch.Tensor] | None:
    """:func:`layer_weights` read afresh by ``read`` (one layer's tensors, or None)."""
    out: list[torch.Tensor] = []
    for layer in model.model.layers:
        tensors = read(layer, layer.self_attn, layer.mlp)
        if tensors is None:
            return None
        out += tensors
    return out


def _int8_layer(layer: nn.Module, attn: nn.Module, mlp: nn.Module) -> list[torch.Tensor] | None:
    """One layer's ``PER_LAYER["int8"]`` tensors, or None where a projection is not int8."""
    qkv, gate_up = attn.qkv.int8.codes(), mlp.gate_up.int8.codes()  # may re-stack
    o, down = attn.o_proj, mlp.down_proj
    if qkv is None or gate_up is None or type(o) is not Int8Linear or type(down) is not Int8Linear:
        return None
    return [layer.input_layernorm.weight, qkv.q, qkv.scale, o.q, o.scale,
            layer.post_attention_layernorm.weight, gate_up.q, gate_up.scale, down.q, down.scale]


def _bf16_layer(layer: nn.Module, attn: nn.Module, mlp: nn.Module) -> list[torch.Tensor] | None:
    """One layer's ``PER_LAYER["bfloat16"]`` tensors -- the parameters themselves, stacked
    (``RowStack``) so each group is read as one stream -- or None where a projection is not a
    plain bf16 linear."""
    if any(p.rows.matrix() is None for p in (attn.qkv, attn.o, mlp.gate_up, mlp.down)):
        return None
    return [layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight,
            attn.v_proj.weight, attn.o_proj.weight, layer.post_attention_layernorm.weight,
            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]


def _int8_head(model: nn.Module) -> list[torch.Tensor]:
    lin = model.head.int8.codes()
    return [] if lin is None else [lin.q, lin.scale]


def _bf16_head(model: nn.Module) -> list[torch.Tensor]:
    return [] if model.head.rows.matrix() is None else [model.lm_head.weight]


_READERS = {"int8": (_int8_layer, _int8_head), "bfloat16": (_bf16_layer, _bf16_head)}
"""Weight format -> the readers of one layer's tensors and of the head's."""
_STEPS = {"int8": "decode_layers_int8", "bfloat16": "decode_layers_bf16"}
"""Weight format -> the kernel of its one-call step."""


def run(model: nn.Module, token: int, position: int, cache: KVCache,
        sid: int) -> torch.Tensor | None:
    """The fp32 logits [1, vocab] of session ``sid``'s reserved ``token`` at ``position``,
    embedded and rotated in the call (the embedding table's row, the rotary tables' row: a
    Python embedding and two table slices a step cost more than the copies), its K/V written
    and committed in every layer, the head in the same call where it is in the model's format;
    None where this path does not apply (nothing written then), among them an embedding that
    is not a plain table lookup (a subclass, a hook, ``max_norm``)."""
    weights = step_weights(model)  # None at once for fp32 weights: no reader reads them
    if weights is None:
        return None
    embed = weights.embed
    kernels = fused_kernels.serving(embed.weight, weights.final_norm)
    if kernels is None or weights.held is None or not _plain_lookup(embed):
        return None
    step = cache.arena_step(sid)
    if step is None:
        return None
    c = model.cfg
    cos, sin = weights.rotary.table(position + 1, embed.weight.dtype)
    decode_layers = getattr(kernels, _STEPS[precision.dtype_of(model)])
    out = decode_layers(embed.weight, token, weights.held[0], weights.final_norm, cos, sin,
                        position, step.kv, step.row, step.runs, c.num_heads, c.num_kv_heads,
                        c.head_dim, c.rms_norm_eps, weights.held[1])
    cache.commit_arena_step(sid)
    return out if weights.head else model._head(out)


def _plain_lookup(embed: nn.Module) -> bool:
    """Whether ``embed``'s forward is its weight's row, nothing else."""
    return (type(embed) is nn.Embedding and embed.max_norm is None and not embed._forward_hooks
            and not embed._forward_pre_hooks)
