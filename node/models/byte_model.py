"""A tiny decoder-only transformer over bytes (vocabulary 256: no tokenizer download).

Training runs ordinary full causal attention (``forward``). Incremental decoding
(``forward_cached``) never keeps K/V itself: each layer writes the new tokens' K/V into the
cache engine and attends over the context as views of the cache's arena (``cache.attention``);
``forward_batch`` does one decode step of several sessions at once. The model has no decode
loop: ``node.engine.sessions`` drives it (``Sessions.turn`` and ``Sessions.turn_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from cache import CacheConfig, KVCache
from cache.attention import attend, attend_shared
from crypto import Layout, flatten
from node.models import kernels as built
from node.models.interface import MixedBatch


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    """Byte-level vocabulary."""
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 256
    context_len: int = 1280
    """Longest sequence (learned position embeddings); covers the 1,024-token benchmark."""
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} not divisible by n_heads {self.n_heads}")

    def cache_config(self, **overrides) -> CacheConfig:
        """A CacheConfig with this model's geometry."""
        return CacheConfig(
            num_layers=self.n_layers, num_heads=self.n_heads, head_dim=self.head_dim, **overrides
        )


def attend_sparse(q: torch.Tensor, runs, cache: KVCache, sid: int, layer: int,
                  policy) -> torch.Tensor:
    """Attend to what the sparsity policy kept after the last step plus the new positions;
    the policy then observes this step's weights over every logical position (and the cache
    frees the blocks it dropped once the step is complete). ``q`` is ``[heads, T, dim]`` or
    grouped ``[kv_heads, G, T, dim]`` (GQA); the policy sees one row of weights per query
    head, ``[heads, T, n]`` either way."""
    pos = cache.resident_positions(sid, layer)
    n, T = int(pos[-1]) + 1, q.shape[-2]
    live = torch.ones(n, dtype=torch.bool)
    if n > T:
        live[: n - T] = policy.keep(layer, n - T)
    keep = live[pos]
    a, w = attend(q, runs, keep=keep, weights=True)
    full = w.new_zeros(*w.shape[:-1], n)
    full[..., pos] = w
    policy.observe(layer, full.flatten(0, -3))
    return a


def attend_session(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                   sid: int, layer: int, kernels: ModuleType | None = None) -> torch.Tensor:
    """Write one session's new K/V in ``layer`` and attend its context (what its sparsity
    policy keeps, if it has one): q [heads, T, D] or grouped [kv_heads, G, T, D] -> the same
    shape. With ``kernels`` (``node.models.kernels``) the K/V are stored in one call
    (``store_step_kv``); a bf16 prefill's rows attend in one call that reads the
    arena's rows in place (``prefill_attention_spans`` over ``cache.attention.Spans``: no
    view or copy per run, however scattered the context; :func:`takes_prefill_kernel`), else
    the eager ops. A lone token's runs stay gathered: ``decode_attention`` over a context
    scattered into one-block runs was slower than over the copy (``experiments.serve_soak``
    found it)."""
    fused = kernels is not None and q.dim() == 4
    store = kernels.store_step_kv if fused and _storable(k, v) else None
    if fused and takes_prefill_kernel(q):
        spans = cache.append_and_read_spans(sid, layer, k, v, store=store)
        if spans is not None and spans.k.dtype in PREFILL_KV_DTYPES:
            return kernels.prefill_attention_spans(q, spans.k, spans.v, spans.runs)
        runs = cache.read_runs(sid, layer, gather=False)
    else:
        in_place = fused and q.shape[-2] > 1  # the eager fallback joins scattered runs itself
        runs = cache.append_and_read(sid, layer, k, v, gather=not in_place, store=store)
    policy = cache.sparsity(sid)
    if policy is not None:
        return attend_sparse(q, runs, cache, sid, layer, policy)
    if kernels is not None and takes_prefill_kernel(q) and _prefill_runs(runs):
        return kernels.prefill_attention(q, [rk for rk, _ in runs], [rv for _, rv in runs])
    if kernels is not None and takes_decode_kernel(q, runs):  # its runs as a step's prefix
        no_tail = q.new_empty(q.shape[0], 1, 0, q.shape[-1])  # K and V: [Hk, 1 slot, 0, D]
        return kernels.decode_attention(q, [rk for rk, _ in runs], [rv for _, rv in runs],
                                        no_tail, no_tail, _NO_TAIL, _NO_SLOTS)
    return attend(q, runs)


def _storable(k: torch.Tensor, v: torch.Tensor) -> bool:
    """``store_step_kv`` takes these rows: contiguous fp32 or bf16, both of one dtype."""
    return (k.dtype in (torch.float32, torch.bfloat16) and v.dtype == k.dtype
            and k.is_contiguous() and v.is_contiguous())


PREFILL_KERNEL_HEAD_DIM = 64
"""The head size ``prefill_attention`` is built for (SmolLM2's, most small Llamas')."""


PREFILL_KV_DTYPES = (torch.float32, torch.bfloat16)
"""The cache dtypes ``prefill_attention`` reads (an fp16 arena takes the eager path)."""


def takes_prefill_kernel(q: torch.Tensor) -> bool:
    """``prefill_attention`` computes these rows: grouped bf16 queries, more than one, of head
    size 64, on a CPU with AVX-512 BF16 or AMX tiles (``kernels.prefill_kernel``), over fp32
    or bf16 K/V with contiguous rows (:func:`_prefill_runs`; the arena's rows always are). One
    query (decode) stays on the fp32 paths, which attend in the cache's precision."""
    return (q.dim() == 4 and q.dtype == torch.bfloat16 and q.shape[-2] > 1
            and q.shape[-1] == PREFILL_KERNEL_HEAD_DIM and q.stride(-1) == 1
            and built.prefill_kernel())


def _prefill_runs(runs) -> bool:
    """Runs ``prefill_attention`` reads: one dtype of :data:`PREFILL_KV_DTYPES`, rows contiguous."""
    return (bool(runs) and runs[0][0].dtype in PREFILL_KV_DTYPES
            and all(t.dtype == runs[0][0].dtype and t.stride(-1) == 1 for run in runs for t in run))


DECODE_KV_DTYPES = (torch.float32, torch.bfloat16)
"""The arena dtypes ``decode_attention`` reads (bf16 rows read as fp32; an fp16 arena takes
the eager path)."""


def takes_decode_kernel(q: torch.Tensor, runs) -> bool:
    """``decode_attention`` computes one session's one new token (``forward_cached`` of a single
    token, as a step of one row with no tail): grouped fp32 queries over runs of one dtype of
    :data:`DECODE_KV_DTYPES` with contiguous rows."""
    return (q.dim() == 4 and q.dtype == torch.float32 and q.shape[-2] == 1 and bool(runs)
            and _one_dtype(runs) and all(t.dim() == 3 and t.stride(-1) == 1
                                         for run in runs for t in run))


_NO_SLOTS = torch.empty(0, dtype=torch.long)
_NO_TAIL = torch.empty(1, 0, dtype=torch.bool)


_KERNEL_TAILS = (torch.float32, torch.bfloat16)


def _one_dtype(runs) -> bool:
    """K/V runs ``decode_attention`` reads: all of one of :data:`DECODE_KV_DTYPES` (or none)."""
    return not runs or (runs[0][0].dtype in DECODE_KV_DTYPES
                        and all(t.dtype == runs[0][0].dtype for run in runs for t in run))


def attend_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, step,
                layer: int, kernels: ModuleType | None = None) -> torch.Tensor:
    """Write a batched decode step's K/V in ``layer`` and attend each row's context, a shared
    prefix once for all: q [heads, B, D] or grouped [kv_heads, G, B, D] -> the same shape.
    With ``kernels`` (``node.models.kernels``) fp32 K/V are stored in one fused call
    (``store_step_kv``) and an fp32 grouped step's attention is one more (``decode_attention``:
    ``attend_shared``'s result, each row read from its tail slot, fp32 or bf16 tails read as
    fp32)."""
    fused = (kernels is not None and k.dtype == torch.float32 and k.is_contiguous()
             and v.is_contiguous())
    prefix, tk, tv, valid = cache.append_and_read_batch(
        step, layer, k, v, store=kernels.store_step_kv if fused else None)
    if (kernels is not None and q.dim() == 4 and q.dtype == torch.float32
            and tk.dtype in _KERNEL_TAILS and _one_dtype(prefix)):
        slots = step.rows if step.rows is not None else _NO_SLOTS
        return kernels.decode_attention(q, [pk for pk, _ in prefix], [pv for _, pv in prefix],
                                        tk, tv, valid, slots)
    if step.rows is None:
        return attend_shared(q, prefix, tk, tv, valid)
    slotted = q.new_zeros(*q.shape[:-2], tk.shape[-3], q.shape[-1])  # rows in their tail slots
    slotted[..., step.rows, :] = q
    return attend_shared(slotted, prefix, tk, tv, valid)[..., step.rows, :]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [..., T, d_model] -> q, k, v: [..., heads, T, head_dim]."""
        H, D = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = self.qkv(self.ln1(x)).split(self.cfg.d_model, dim=-1)
        return tuple(t.unflatten(-1, (H, D)).transpose(-3, -2) for t in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(-3, -2).flatten(-2))
        return x + self.mlp(self.ln2(x))

    def forward_cached(self, x: torch.Tensor, cache: KVCache, sid: int, layer: int) -> torch.Tensor:
        """x: [T, d_model] for the T new tokens; attention over everything the cache holds."""
        q, k, v = self._qkv(x)  # [H, T, D]
        return self._residual(x, attend_session(q, k, v, cache, sid, layer))

    def forward_batch(self, x: torch.Tensor, cache: KVCache, step, layer: int) -> torch.Tensor:
        """x: [B, d_model], one new token of each of the step's B sessions."""
        q, k, v = self._qkv(x)  # [H, B, D]
        return self._residual(x, attend_step(q, k, v, cache, step, layer))

    def forward_mixed(self, x: torch.Tensor, cache: KVCache, batch: MixedBatch,
                      layer: int) -> torch.Tensor:
        """x: [N, d_model], a :class:`MixedBatch`'s packed rows (``node.models.llama``'s form)."""
        q, k, v = self._qkv(x)
        B, parts = len(batch.decode_tokens), []
        if B:
            parts.append(attend_step(q[:, :B], k[:, :B], v[:, :B], cache, batch.step, layer))
        for sid, a, b in batch.spans():
            parts.append(attend_session(q[:, a:b], k[:, a:b], v[:, a:b], cache, sid, layer))
        return self._residual(x, torch.cat(parts, dim=-2))

    def _residual(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Attention output a [H, T, D] projected, then the MLP, both residual."""
        x = x + self.proj(a.transpose(0, 1).flatten(-2))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """The byte-level LM; implements ``node.models.interface.CachedLM``."""

    def __init__(self, cfg: ModelConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or ModelConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def context_len(self) -> int:
        return self.cfg.context_len

    def cache_config(self, **overrides) -> CacheConfig:
        return self.cfg.cache_config(**overrides)

    def train_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy of ``batch`` [B, T + 1] (full causal attention)."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def trainable_parameters(self):
        """Every parameter: the model is trained whole."""
        return self.parameters()

    def parameter_layout(self) -> Layout:
        """Every state-dict entry, in state-dict order: the federation averages the whole model."""
        return flatten(self.state_dict(), check_finite=False)[1]

    def _check_len(self, n: int) -> None:
        if n > self.cfg.context_len:
            raise ValueError(f"sequence of {n} tokens exceeds context_len {self.cfg.context_len}")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [batch, T] byte ids -> logits [batch, T, vocab]; full causal attention."""
        T = idx.shape[-1]
        self._check_len(T)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor | list[int], cache: KVCache, sid: int):
        """Feed new tokens of session ``sid``; returns logits [T, vocab] for them."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        start = cache.length(sid)
        self._check_len(start + tokens.numel())
        cache.reserve(sid, tokens.tolist())
        x = self.tok(tokens) + self.pos(torch.arange(start, start + tokens.numel()))
        for i, blk in enumerate(self.blocks):
            x = blk.forward_cached(x, cache, sid, i)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def forward_batch(self, tokens: list[int], cache: KVCache, sids: list[int]) -> torch.Tensor:
        """One decode step of many sessions in one forward: token i goes to session
        ``sids[i]``; returns logits [B, vocab]."""
        starts = [cache.length(s) for s in sids]
        for n in starts:
            self._check_len(n + 1)
        step = cache.begin_batch(list(sids), [int(t) for t in tokens])
        x = self.tok(torch.as_tensor(tokens, dtype=torch.long)) + self.pos(torch.tensor(starts))
        for i, blk in enumerate(self.blocks):
            x = blk.forward_batch(x, cache, step, i)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def forward_mixed(self, batch: MixedBatch, cache: KVCache) -> torch.Tensor:
        """One scheduler step's decode rows and prefill chunks in one forward
        (``node.models.interface.MixedBatch``); logits of the rows a step samples from."""
        positions = batch.positions(cache)
        self._check_len(int(positions.max()) + 1)
        x = self.tok(torch.tensor(batch.tokens(), dtype=torch.long)) + self.pos(positions)
        for i, blk in enumerate(self.blocks):
            x = blk.forward_mixed(x, cache, batch, i)
        return self.head(self.ln_f(x[batch.output_rows()]))

    @torch.no_grad()
    def prefill(self, prompt: list[int], cache: KVCache, sid: int) -> torch.Tensor:
        """Feed a prompt into an empty session, reusing any cached prefix; returns the logits
        of the last prompt token."""
        reused = cache.match_prefix(sid, prompt)
        return self.forward_cached(prompt[reused:], cache, sid)[-1]
