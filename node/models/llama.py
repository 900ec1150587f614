"""A Llama-family decoder that decodes through fedkv's paged KV cache (nano-vllm's shape).

RMSNorm, rotary position embedding (RoPE, θ from the config), grouped-query attention over
the cache's runs of blocks, SwiGLU MLP, tied or separate output embedding. Parameter names are
those of Hugging Face's ``LlamaForCausalLM`` (``model.layers.3.self_attn.q_proj.weight``, ...),
so its state dict loads as is (``node.models.smollm2.load(...).state_dict`` for SmolLM2-135M-Instruct)
and adapters that target ``q_proj``/``v_proj`` find them.

``LlamaModel`` implements ``node.models.interface.CachedLM`` (the calls
``node.models.byte_model.TinyTransformer`` makes), so ``node.engine.sessions.Sessions`` and ``CacheNode`` drive it;
it has no decode loop of its own (sampling lives in ``Sessions.turn`` / ``turn_batch``)::

    kv = KVCache(model.cache_config(kv_dtype=...))       # heads = the model's *KV* heads
    sid = kv.open_session()
    logits = model.prefill(prompt, kv, sid)              # match_prefix, then forward_cached
    logits = model.forward_cached([token], kv, sid)[-1]  # one decode step
    logits = model.forward_batch(tokens, kv, sids)       # one step of several sessions

Decode layout: a one-token step is bound by reading the weights, so the wide ones are stored
for it -- q/k/v and gate/up each fused into one column-major matrix whose blocks the
parameters are views of (``node.models.projection``), the (tied) output embedding column-major
(:func:`transpose_storage`) -- and RoPE's cos/sin come from a table. Parameter names, shapes
and values are HF's; training (autograd) and adapters wrapping ``q_proj``/``v_proj`` use the
modules.

Keys are stored *after* RoPE (positions are absolute: a prefix hit reuses them unchanged). The
cache holds ``num_key_value_heads`` heads; the query heads that share a KV head are regrouped
as ``[kv_heads, group, T, head_dim]`` and attended together (``cache.attention.attend`` and
``attend_shared`` with a group axis), so no K/V is ever repeated per query head. A session
opened with a sparsity policy attends what the policy keeps (the policy sees every query
head's weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cache import CacheConfig, KVCache
from cache.attention import attend, attend_shared
from crypto import Layout, flatten
from node.models.byte_model import attend_session, attend_step
from node.models.interface import MixedBatch
from node.models import decode_step
from node.models import kernels as fused_kernels
from node.models.precision import dtype_of
from node.models.projection import Projection, transpose_storage


Rows = torch.Tensor | slice | None
"""Which rows of a forward go on past the last layer's attention (indices or a slice); None: all."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group over "
                             f"{self.num_kv_heads} KV heads")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Any) -> "LlamaConfig":
        """From a ``transformers`` Llama config object or its ``config.json`` dict."""
        get = hf.get if isinstance(hf, Mapping) else (lambda k, d=None: getattr(hf, k, d))
        if get("model_type", "llama") != "llama":
            raise ValueError(f"not a Llama config: model_type {get('model_type')!r}")
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {get('hidden_act')!r}: only SwiGLU (silu) is supported")
        rope = get("rope_parameters") or get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"RoPE scaling {rope!r} is not supported (default RoPE only)")
        theta = rope.get("rope_theta") or get("rope_theta") or 10_000.0
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        return cls(
            vocab_size=get("vocab_size"), hidden_size=hidden,
            intermediate_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
            num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads, rope_theta=float(theta),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", True)),
            max_position_embeddings=int(get("max_position_embeddings", 8192) or 8192),
            attention_bias=bool(get("attention_bias", False)), mlp_bias=bool(get("mlp_bias", False)))

    def cache_config(self, **overrides) -> CacheConfig:
        """A CacheConfig for this model's K/V: one head per *KV* head (GQA)."""
        return CacheConfig(num_layers=self.num_layers, num_heads=self.num_kv_heads,
                           head_dim=self.head_dim, **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's weight * (x * rsqrt(mean(x^2) + eps)) in fp32 in one call (a decode step runs
        # 61); a reduced-precision x is normalized in fp32 and rounded first, as HF does
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin of absolute positions (HF's "rotate half" layout: pairs (i, i + dim/2)).

    ``table(n, dtype)`` keeps them for positions ``0..n-1`` (grown by doubling), so a decode
    step slices or indexes rows instead of recomputing 30 layers' worth of cos/sin; the rows
    are the very values ``forward`` computes (same elementwise ops)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos(), emb.sin()

    def table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= n, head_dim] in ``dtype`` (rebuilt when ``inv_freq`` moved)."""
        t = self._table
        if (t is None or t[0].shape[0] < n or t[0].dtype != dtype
                or t[0].device != self.inv_freq.device):
            size = max(64, 1 << (n - 1).bit_length())
            with torch.inference_mode(False):  # a normal tensor: training may save it
                cos, sin = self(torch.arange(size, device=self.inv_freq.device))
            t = self._table = (cos.to(dtype), sin.to(dtype))
        return t


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, dim]; cos, sin: [T, dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        H, Hk, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(E, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(E, Hk * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(E, Hk * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, E, bias=cfg.attention_bias)
        self.relayout()

    def relayout(self) -> None:
        """Fuse q/k/v (``node.models.projection.Projection``). o_proj stays row-major:
        column-major gained little for it, and its one-token GEMM then sums in an order that
        doubled SmolLM2's decode error against an fp64 reference (4e-5 -> 1e-4, with
        down_proj's)."""
        self.qkv = Projection(self, ("q_proj", "k_proj", "v_proj"))
        self.o = Projection(self, ("o_proj",), fuse_fp32=False)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, hidden] -> q, k, v projected side by side, [..., T, (H + 2 Hk) * D]: one
        packed or fused matmul when it applies, else the modules (adapters, training, int8)."""
        y = self.qkv(x)
        if y is None:
            y = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return y

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [..., T, hidden] -> q [..., kv_heads, G, T, D] and k, v [..., kv_heads, T, D],
        q and k rotated (row t at the position of ``cos[t]``; K is stored post-RoPE)."""
        c = self.cfg
        H, Hk = c.num_heads, c.num_kv_heads
        y = self._project(x).unflatten(-1, (H + 2 * Hk, c.head_dim)).transpose(-3, -2)
        qk = apply_rope(y[..., : H + Hk, :, :], cos, sin)  # one RoPE for q and k together
        q, k, v = qk[..., :H, :, :], qk[..., H:, :, :], y[..., H + Hk :, :, :]
        return q.unflatten(-3, (Hk, c.group)), k, v

    def _o(self, a: torch.Tensor) -> torch.Tensor:
        """o_proj of [..., T, heads * D]."""
        y = self.o(a)
        return self.o_proj(a) if y is None else y

    def _out(self, a: torch.Tensor) -> torch.Tensor:
        """a: [..., kv_heads, G, T, D] -> [..., T, hidden]."""
        return self._o(a.flatten(-4, -3).transpose(-3, -2).flatten(-2))

    def fused(self, kernels: ModuleType, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              how: str, *cache_args, rows: Rows = None) -> torch.Tensor:
        """The attention sublayer of ``how`` (``forward_cached``, ``forward_batch``,
        ``forward_mixed``) on bf16 rows ``h`` [N, hidden], already normed, through the fused
        kernels (``node.models.kernels``). A decode step's q/k/v come out in fp32, the
        precision its attention over the fp32 cache runs in (``cache.attention.compute_dtype``);
        rows that prefill stay bf16; one session's single new token is a decode step too.
        Every row's K/V is stored; with ``rows`` only those rows go through o_proj and out."""
        c = self.cfg
        decode = how == "forward_batch" or (how == "forward_cached" and h.shape[0] == 1)
        dtype = torch.float32 if decode else torch.bfloat16
        q, k, v = kernels.rope_split(self._project(h), cos, sin, c.num_heads, c.num_kv_heads,
                                     c.head_dim, dtype)
        a = kernels.merge_heads(ATTEND[how](q, k, v, *cache_args, kernels=kernels))
        return self._o(a if rows is None else a[rows])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Cache-free causal attention, x: [B, T, hidden]; K/V expanded with stride 0 over
        each group (differentiable, SDPA's fused causal kernel)."""
        q, k, v = self._qkv(x, cos, sin)
        k, v = k.unsqueeze(-3).expand_as(q), v.unsqueeze(-3).expand_as(q)
        return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: KVCache, sid: int, layer: int) -> torch.Tensor:
        """x: [T, hidden] of the T new tokens -> [T, hidden]."""
        return self._out(attend_session(*self._qkv(x, cos, sin), cache, sid, layer))

    def forward_batch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: KVCache, step, layer: int) -> torch.Tensor:
        """x: [B, hidden], one new token of each of the step's B sessions (row b rotated to
        its own session's position) -> [B, hidden]."""
        return self._out(attend_step(*self._qkv(x, cos, sin), cache, step, layer))

    def forward_mixed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: KVCache, batch: MixedBatch, layer: int) -> torch.Tensor:
        """x: [N, hidden], a :class:`MixedBatch`'s packed rows: one q/k/v matmul for all of
        them, attention per row group (the decode step, then each chunk's session)."""
        return self._out(attend_mixed(*self._qkv(x, cos, sin), cache, batch, layer))


def attend_mixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                 batch: MixedBatch, layer: int, kernels: ModuleType | None = None) -> torch.Tensor:
    """Attention of a :class:`MixedBatch`'s rows (q [Hk, G, N, D], k, v [Hk, N, D]): the decode
    step's, then each chunk's against its session."""
    B, parts = len(batch.decode_tokens), []
    if B and kernels is not None and q.dtype == torch.bfloat16:  # decode attends in fp32
        rows = attend_step(q[..., :B, :].float(), k[:, :B].float(), v[:, :B].float(), cache,
                           batch.step, layer, kernels)
        parts.append(rows.to(q.dtype))
    elif B:
        parts.append(attend_step(q[..., :B, :], k[:, :B], v[:, :B], cache, batch.step, layer))
    for sid, a, b in batch.spans():
        parts.append(attend_session(q[..., a:b, :], k[:, a:b], v[:, a:b], cache, sid, layer,
                                    kernels))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


ATTEND = {"forward_cached": attend_session, "forward_batch": attend_step,
          "forward_mixed": attend_mixed}
"""The attention over the cache of each cached form of ``Attention`` (q, k, v, then its cache
arguments)."""


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        E, M = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(E, M, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(E, M, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(M, E, bias=cfg.mlp_bias)
        self.relayout()

    def relayout(self) -> None:
        """Fuse gate/up (``Projection``); down_proj stays row-major (see Attention's)."""
        self.gate_up = Projection(self, ("gate_proj", "up_proj"))
        self.down = Projection(self, ("down_proj",), fuse_fp32=False)

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        y = self.down(h)
        return self.down_proj(h) if y is None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up(x)  # gate and up side by side; None: the modules run
        if y is None:
            return self._down(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = y.chunk(2, dim=-1)
        return self._down(F.silu(gate).mul_(up))

    def fused(self, kernels: ModuleType, h: torch.Tensor) -> torch.Tensor:
        """The MLP of bf16 rows ``h`` [N, hidden], SiLU x up in one pass
        (``node.models.kernels``)."""
        y = self.gate_up(h)
        if y is None:
            y = torch.cat([self.gate_proj(h), self.up_proj(h)], dim=-1)
        return self._down(kernels.silu_mul(y))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``how`` names the attention's form (``forward``: cache-free,
    ``forward_cached``: one session, ``forward_batch``: one step of several)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *cache_args,
                how: str = "forward", rows: Rows = None) -> torch.Tensor:
        """With ``rows``, only those rows go on past the attention (whose K/V all rows store)."""
        attn = getattr(self.self_attn, how)
        x = x + attn(self.input_layernorm(x), cos, sin, *cache_args)
        if rows is not None:
            x = x[rows]
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg.head_dim, cfg.rope_theta)


class LlamaModel(nn.Module):
    """``LlamaForCausalLM``'s weights, decoding only through a :class:`cache.KVCache`."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        transpose_storage(self.lm_head.weight)  # ~20 % of a decode step's weights
        self.head = Projection(self, ("lm_head",), fuse_fp32=False)

    def relayout(self) -> None:
        """Redo the decode layout of the weights (``node.models.projection``)
        after something replaced their storage (a dtype change); values are unchanged. A
        reduced-precision head stays row-major: bf16's one-row GEMM measured ~2-3x faster on
        that layout than on the column-major one (the opposite of fp32)."""
        for layer in self.model.layers:
            layer.self_attn.relayout()
            layer.mlp.relayout()
        self.head = Projection(self, ("lm_head",), fuse_fp32=False)
        head = getattr(self.lm_head, "weight", None)  # an int8 head has codes, no weight
        if isinstance(head, nn.Parameter) and head.dtype == torch.float32:
            transpose_storage(head)
        elif isinstance(head, nn.Parameter):
            head.data = head.detach().contiguous()
        embed = self.model.embed_tokens.weight
        if embed is not head and not embed.is_contiguous():  # untied from an int8 head
            embed.data = embed.detach().contiguous()  # a lookup reads rows, not strided columns

    @classmethod
    def from_state_dict(cls, cfg: LlamaConfig, state: Mapping[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32) -> "LlamaModel":
        """Build from an HF ``LlamaForCausalLM`` state dict (``lm_head.weight`` may be absent
        when the embeddings are tied; an extra ``rotary_emb.inv_freq`` is ignored)."""
        m = cls(cfg)
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        want = {k for k in m.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = want - set(state), set(state) - want
        if missing or unexpected:
            raise ValueError(f"state dict does not fit the config: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        m.load_state_dict(state, strict=False)  # copies into the fused storage
        m = m.to(dtype).eval()
        if dtype != torch.float32:
            m.relayout()
        return m

    @classmethod
    def from_pretrained(cls, directory=None, *, verify_hashes: bool = True,
                        dtype: str = "float32") -> "LlamaModel":
        """The converted model of ``node.models.smollm2`` (default: SmolLM2-135M-Instruct) in the
        format ``dtype`` names (``node.models.precision.DTYPES``: float32, bfloat16, int8)."""
        from node.models import smollm2 as models, precision

        precision.check(dtype)
        loaded = models.load(directory, verify_hashes=verify_hashes)
        model = cls.from_state_dict(LlamaConfig.from_hf(loaded.config), loaded.state_dict)
        return precision.convert(model, dtype)

    # -- CachedLM (node.models.interface) ----------------------------------------------------
    @property
    def context_len(self) -> int:
        return self.cfg.max_position_embeddings

    def cache_config(self, **overrides) -> CacheConfig:
        """The model's cache geometry. bf16 and int8 weights make bf16 K/V, so the cache holds
        them as bf16 unless told otherwise (``CacheConfig.kv_dtype``, as vLLM's
        ``--kv-cache-dtype auto`` follows the model), a batch's tail copy too
        (``CacheConfig.batch_tail_dtype``): half the bytes a decode step's attention reads.
        (The fused decode-only step ropes K in fp32; it is rounded to bf16 there, as the eager
        bf16 path rounds it.)"""
        if dtype_of(self) != "float32":
            overrides.setdefault("kv_dtype", "bf16")
            overrides.setdefault("batch_tail_dtype", "bf16")
        return self.cfg.cache_config(**overrides)

    def _check_len(self, n: int) -> None:
        if n > self.cfg.max_position_embeddings:
            raise ValueError(f"{n} positions exceed max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), head_dim] from the table (rows, not recomputed)."""
        cos, sin = self.model.rotary_emb.table(int(positions.max()) + 1,
                                               self.model.embed_tokens.weight.dtype)
        return cos[positions], sin[positions]

    def _rope_range(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``start..start+n-1``: views of the table."""
        cos, sin = self.model.rotary_emb.table(start + n, self.model.embed_tokens.weight.dtype)
        return cos[start : start + n], sin[start : start + n]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head's logits of hidden states ``x`` (normed here)."""
        return self._head(self.model.norm(x))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The output head's logits of final-normed rows in fp32 whatever the weights' format
        (``node.models.precision``): sampling, log-probabilities and losses downstream see one
        dtype."""
        y = self.head(h)
        return (self.lm_head(h) if y is None else y).float()

    def kernels(self, x: torch.Tensor) -> ModuleType | None:
        """The fused kernels (``node.models.kernels``) when they serve hidden states ``x``:
        bf16 activations (``--dtype bfloat16`` or ``int8``), no autograd, built here."""
        return fused_kernels.serving(x, self.model.norm.weight)

    def _hidden(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, how: str,
                *cache_args, rows: Rows = None) -> torch.Tensor:
        """Embedded rows ``x`` through every layer's ``how`` form, final-normed; only ``rows``
        of them (all when None) come out. The last layer stores every row's K/V and runs its
        o_proj and MLP on ``rows`` alone: a prefill samples one row, so the rest of that
        layer's work on the others was thrown away. The fused form carries each residual add
        into the next norm (``add_rms_norm_``)."""
        layers = self.model.layers
        last = len(layers) - 1
        k = self.kernels(x)
        if k is None:
            for i, layer in enumerate(layers):
                x = layer(x, cos, sin, *cache_args, i, how=how, rows=rows if i == last else None)
            return self.model.norm(x)
        eps = self.cfg.rms_norm_eps
        norms = [layer.input_layernorm.weight for layer in layers][1:] + [self.model.norm.weight]
        h = k.rms_norm(x, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            keep = rows if i == last else None
            a = layer.self_attn.fused(k, h, cos, sin, how, *cache_args, i, rows=keep)
            if keep is not None:
                x = x[keep].contiguous()
            h = k.add_rms_norm_(x, a, layer.post_attention_layernorm.weight, eps)
            h = k.add_rms_norm_(x, layer.mlp.fused(k, h), norms[i], eps)
        return h

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward: idx [B, T] -> logits [B, T, vocab] (training, scoring)."""
        T = idx.shape[-1]
        self._check_len(T)
        cos, sin = self._rope_range(0, T)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self._logits(x)

    def train_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``batch`` [B, T + 1] (cache-free forward)."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def trainable_parameters(self):
        """Every parameter (each tied tensor once): the model is trained whole. A LoRA
        wrapper (issue 23 item 4) narrows this to its adapters."""
        return self.parameters()

    def parameter_layout(self) -> Layout:
        """Every state-dict entry in state-dict order, the tied ``lm_head.weight`` left out
        (it *is* ``model.embed_tokens.weight``: averaging it twice would send it twice)."""
        state = self.state_dict()
        if self.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return flatten(state, check_finite=False)[1]

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor | Sequence[int], cache: KVCache, sid: int, *,
                       last_only: bool = False) -> torch.Tensor:
        """Feed new tokens of session ``sid`` (after what it holds); logits [T, vocab], or
        [1, vocab] of the last token with ``last_only`` (the output projection over a 49,152
        vocabulary is ~30 % of a 2,048-token SmolLM2 prefill). A session opened with a
        sparsity policy attends what the policy keeps."""
        if type(tokens) in (list, tuple) and all(type(t) is int for t in tokens):
            toks = list(tokens)  # a decode step's one int: no tensor made and read back
        else:
            toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()
        start = cache.length(sid)
        self._check_len(start + len(toks))
        cache.reserve(sid, toks)
        return self._forward_reserved(toks, cache, sid, start, last_only)

    def _forward_reserved(self, toks: list[int], cache: KVCache, sid: int, start: int,
                          last_only: bool = False) -> torch.Tensor:
        """``forward_cached`` of tokens already reserved at ``start``: a lone token in one
        kernel call where ``node.models.decode_step`` applies, else layer by layer."""
        T = len(toks)
        if T == 1 and (logits := decode_step.run(self, toks[0], start, cache, sid)) is not None:
            return logits
        cos, sin = self._rope_range(start, T)
        x = self.model.embed_tokens(torch.tensor(toks, dtype=torch.long))
        return self._head(self._hidden(x, cos, sin, "forward_cached", cache, sid,
                                       rows=slice(T - 1, T) if last_only else None))

    @torch.no_grad()
    def forward_batch(self, tokens: Sequence[int], cache: KVCache,
                      sids: Sequence[int]) -> torch.Tensor:
        """One decode step of distinct sessions: token i goes to session ``sids[i]`` (at its
        own position); logits [B, vocab]. A prefix of blocks the sessions share is attended
        once for all of them and all their query heads (``cache.attention.attend_shared``)."""
        starts = [cache.length(s) for s in sids]
        for n in starts:
            self._check_len(n + 1)
        step = cache.begin_batch(list(sids), [int(t) for t in tokens])
        cos, sin = self._rope(torch.tensor(starts))
        x = self.model.embed_tokens(torch.as_tensor(list(tokens), dtype=torch.long))
        return self._head(self._hidden(x, cos, sin, "forward_batch", cache, step))

    @torch.no_grad()
    def forward_mixed(self, batch: MixedBatch, cache: KVCache) -> torch.Tensor:
        """One scheduler step in one pass through the weights: the decode rows and prefill
        chunks of ``batch`` packed (each row at its own session's position); logits of each
        decode row and of each chunk's last token (``node.models.interface.MixedBatch``). A lone
        one-token chunk (the scheduler's lone decode row, ``node.engine.scheduler``) is that
        session's ``forward_cached``."""
        if batch.step is None and len(batch.chunks) == 1 and len(batch.chunks[0][1]) == 1:
            sid, toks = batch.chunks[0]
            return self._forward_reserved([int(t) for t in toks], cache, sid, cache.length(sid))
        positions = batch.positions(cache)
        self._check_len(int(positions.max()) + 1)
        cos, sin = self._rope(positions)
        x = self.model.embed_tokens(torch.tensor(batch.tokens(), dtype=torch.long))
        return self._head(self._hidden(x, cos, sin, "forward_mixed", cache, batch,
                                       rows=batch.output_rows()))

    @torch.no_grad()
    def prefill(self, prompt: Sequence[int], cache: KVCache, sid: int) -> torch.Tensor:
        """Feed a prompt into an empty session, reusing any cached prefix (whole blocks);
        returns the logits of the last prompt token."""
        prompt = [int(t) for t in prompt]
        reused = cache.match_prefix(sid, prompt)
        return self.forward_cached(prompt[reused:], cache, sid, last_only=True)[-1]
