"""Tiny random Llama models for the tests (one factory; each test overrides only what it needs).

``tiny_llama`` builds ``node.models.llama.LlamaModel`` directly (no ``transformers`` import: seconds);
``tiny_hf_llama`` builds ``transformers.LlamaForCausalLM`` of the same geometry for the tests
that compare against it (``from_hf`` turns it into ours). Overrides use ``node.models.llama.LlamaConfig``
field names; ``tiny_hf_llama`` passes any other keyword (``pad_token_id``) to the HF config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from node.models.llama import LlamaConfig, LlamaModel

GEOMETRY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16)
"""The shared tiny geometry: 2 layers, hidden 64, GQA (4 query heads over 2 KV heads)."""

SMALL: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
"""Half the width, for tests that only need some Llama (fewer weights to publish or quantize)."""

HF_DEFAULTS: dict[str, Any] = dict(rope_theta=100_000.0, max_position_embeddings=512)
"""The HF-built models' RoPE base differs from our default 10 000, so a dropped theta shows."""

_OURS = {f.name for f in dataclasses.fields(LlamaConfig)}


def tiny_config(**overrides: Any) -> LlamaConfig:
    """``GEOMETRY`` with ``overrides`` (``LlamaConfig`` field names)."""
    return LlamaConfig(**{**GEOMETRY, **overrides})


def tiny_llama(seed: int = 0, std: float | None = None, norms_too: bool = False,
               **overrides: Any) -> LlamaModel:
    """An eval-mode ``LlamaModel`` seeded with ``seed``; ``std``: redraw the weight matrices
    (with ``norms_too`` every parameter) from N(0, std), as the default init repeats tokens."""
    torch.manual_seed(seed)
    model = LlamaModel(tiny_config(**overrides))
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if norms_too or p.dim() > 1:
                    p.normal_(0, std)
    return model.eval()


def tiny_hf_llama(seed: int = 0, initializer_range: float = 0.2,
                  attn_implementation: str | None = "eager", **overrides: Any):
    """An eval-mode ``transformers.LlamaForCausalLM`` of ``GEOMETRY`` + ``HF_DEFAULTS`` +
    ``overrides``; ``attn_implementation=None`` keeps HF's default, as a user's model would."""
    import transformers
    hf_only = {k: v for k, v in overrides.items() if k not in _OURS}
    cfg = tiny_config(**{**HF_DEFAULTS, **{k: v for k, v in overrides.items() if k in _OURS}})
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias, initializer_range=initializer_range,
        attn_implementation=attn_implementation, **hf_only)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def ours_from_hf(hf) -> LlamaModel:
    """Our model holding ``hf``'s weights (as ``LlamaModel.from_pretrained`` would load them)."""
    return LlamaModel.from_state_dict(LlamaConfig.from_hf(hf.config), hf.state_dict())
