"""The contenders of ``experiments.bench_llm``: fedkv sessions (``node.models.llama.LlamaModel`` over
``cache.KVCache``) and Hugging Face ``LlamaForCausalLM`` with its ``DynamicCache``, each a
``Stepper`` (one greedy step of every session it holds), and ``interleave``, which times them
in rotating segments. Prompts are prefilled once: ``copy_session`` gives other caches the
same K/V through the public write path, ``hf_cache_from`` gives them to HF's DynamicCache.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from cache import KVCache, cache_size
from node.engine.generation import TokenStream
from node.engine.sampling import greedy
from node.models.llama import LlamaModel


def bytes_per_token(model: LlamaModel, kv_dtype: str | None = "fp32") -> int:
    """Bytes of one token's K/V in every layer, stored as ``kv_dtype``; None: the format the
    model's own cache stores (``LlamaModel.cache_config``: bf16 for bf16 and int8 weights)."""
    c = model.cache_config()  # its heads are the K/V heads
    return cache_size(1, c.num_layers, c.num_heads * c.head_dim, kv_dtype or c.kv_dtype,
                      num_kv_heads=c.num_heads, head_dim=c.head_dim)


def fedkv_cache(model: LlamaModel, tokens: int, kv_dtype: str | None = "fp32", block: int = 16,
                **kw: Any) -> KVCache:
    """A cache holding ``tokens`` without eviction: the full-precision share of the pool (all
    of it in fp32/bf16/fp16, ``read_buffer_fraction`` in int8/int4, which keep decoded read
    buffers of active sessions there) fits 1.5x their fp32 bytes plus slack. ``kv_dtype``
    None: the model's own (bf16 for bf16 and int8 weights, as its server stores them)."""
    need = int(1.5 * (tokens + 8 * block) * bytes_per_token(model))
    if kv_dtype in ("int8", "int4"):
        need = int(need / model.cache_config().read_buffer_fraction)
    pool = max(need, model.cache_config(block_size=block).managed_block_bytes)
    if kv_dtype is not None:
        kw["kv_dtype"] = kv_dtype
    return KVCache(model.cache_config(pool_bytes=pool, block_size=block, **kw))


class Stepper(Protocol):
    def step(self) -> int:
        """One greedy decode step of every session it holds; returns the tokens made."""
        ...


def copy_session(src: KVCache, sid: int, dst: KVCache) -> int:
    """A new session of ``dst`` with the tokens and K/V of ``src``'s fp32 session ``sid``,
    stored through ``dst``'s public write path (after ``match_prefix``: a prefix ``dst``
    caches is shared, as ``prefill`` shares it): what a prefill into ``dst`` stores, without
    computing it again (an int8/int4 ``dst`` quantizes on commit as it would)."""
    if src.config.kv_dtype != "fp32":
        raise ValueError(f"copy_session reads full-precision K/V: the source cache is "
                         f"{src.config.kv_dtype}, not fp32")
    toks, new = src.tokens(sid), dst.open_session()
    n = dst.match_prefix(new, toks)
    dst.reserve(new, toks[n:])
    for layer in range(src.config.num_layers):
        k, v = src.read(sid, layer)
        dst.write(new, layer, k[:, n:], v[:, n:])
    return new


def prefilled(model: LlamaModel, prompts: list[list[int]], extra: int, block: int,
              dtypes: tuple[str, ...] = ("fp32",)
              ) -> tuple[list[tuple[KVCache, list[int]]], torch.Tensor]:
    """One cache per entry of ``dtypes`` (the first fp32) with a session per prompt: the
    first prefilled (later prompts reuse the shared prefix through the prefix cache), the
    others copies of it (``copy_session``); and the prompts' last logits."""
    if not dtypes or dtypes[0] != "fp32":
        raise ValueError(f"the first cache is the prefilled fp32 one, got dtypes {dtypes!r}")
    shared = len(os.path.commonprefix(prompts))
    held = shared + sum(len(p) - shared + extra + 2 * block for p in prompts)
    fp = fedkv_cache(model, held, "fp32", block)
    sids = [fp.open_session() for _ in prompts]
    logits = torch.stack([model.prefill(p, fp, s) for p, s in zip(prompts, sids)])
    out = [(fp, sids)]
    for d in dtypes[1:]:
        kv = fedkv_cache(model, held, d, block)
        out.append((kv, [copy_session(fp, s, kv) for s in sids]))
    return out, logits


class FedkvSessions:
    """Sessions of one cache decoded greedily: a step is one ``forward_batch`` or, with
    ``together=False``, one ``forward_cached`` per session, each alone."""

    def __init__(self, model: LlamaModel, kv: KVCache, sids: list[int], logits: torch.Tensor,
                 together: bool = False):
        self.model, self.kv, self.sids, self.together = model, kv, sids, together
        self.logits, self.tokens = logits, []

    def step(self) -> int:
        toks = greedy(self.logits).tolist()
        self.tokens.append(toks[0])
        if self.together:
            self.logits = self.model.forward_batch(toks, self.kv, self.sids)
        elif len(self.sids) == 1:  # its one token's logits are [1, vocab] already
            self.logits = self.model.forward_cached(toks, self.kv, self.sids[0])
        else:
            self.logits = torch.stack([self.model.forward_cached([t], self.kv, s)[-1]
                                       for t, s in zip(toks, self.sids)])
        return len(self.sids)

    def kv_bytes(self) -> int:
        st = self.kv.stats()  # the batch tail buffer is K/V memory too
        return int(st["bytes_allocated"] + st["batch_tail_buffer_bytes"])


def _cache_kw(hf: Any) -> str:
    """The keyword this transformers version's forward takes the cache under (``cache`` in
    5.x, where ``past_key_values`` is deprecated)."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _left_mask(lens: list[int]) -> torch.Tensor:
    n = max(lens)
    return torch.tensor([[0] * (n - m) + [1] * m for m in lens])


@torch.no_grad()
def hf_prefill(hf: Any, prompts: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """HF's own prefill of a left-padded batch: (DynamicCache, attention mask, last logits)."""
    from transformers import DynamicCache

    cache, mask = DynamicCache(config=hf.config), _left_mask([len(p) for p in prompts])
    pad = int(hf.config.pad_token_id or 0)
    ids = torch.tensor([[pad] * (mask.shape[1] - len(p)) + p for p in prompts])
    out = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
             use_cache=True, logits_to_keep=1, **{_cache_kw(hf): cache})
    return cache, mask, out.logits[:, -1]


def hf_cache_from(hf: Any, kv: KVCache, sids: list[int]) -> tuple[Any, torch.Tensor]:
    """A left-padded DynamicCache holding fedkv's fp32 K/V of ``sids`` (both store keys after
    RoPE, [kv_heads, T, head_dim] per layer): HF's prefill result without computing it."""
    from transformers import DynamicCache

    cache, mask = DynamicCache(config=hf.config), _left_mask([kv.length(s) for s in sids])
    for layer in range(kv.config.num_layers):
        kvs = [kv.read(s, layer) for s in sids]
        pad = [(0, 0, mask.shape[1] - k.shape[1], 0) for k, _ in kvs]
        cache.update(torch.stack([F.pad(k, p) for (k, _), p in zip(kvs, pad)]),
                     torch.stack([F.pad(v, p) for (_, v), p in zip(kvs, pad)]), layer)
    return cache, mask


class HFSessions:
    """HF's own loop, step by step: the model called with its ``DynamicCache`` (input [B, 1],
    positions from the attention mask, so left padding is skipped), last logits only."""

    def __init__(self, hf: Any, cache: Any, mask: torch.Tensor, logits: torch.Tensor):
        self.hf, self.cache, self.mask, self.logits = hf, cache, mask, logits
        self.kw, self.tokens = _cache_kw(hf), []

    @torch.no_grad()
    def step(self) -> int:
        toks = greedy(self.logits)
        self.tokens.append(int(toks[0]))
        self.mask = torch.cat((self.mask, torch.ones_like(self.mask[:, :1])), dim=1)
        out = self.hf(toks[:, None], attention_mask=self.mask, use_cache=True, logits_to_keep=1,
                      position_ids=self.mask.sum(-1, keepdim=True) - 1, **{self.kw: self.cache})
        self.logits = out.logits[:, -1]
        return self.mask.shape[0]

    def kv_bytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers
                   if layer.keys is not None)


def hf_sessions(hf: Any, prompts: list[list[int]], own_prefill: bool, kv: KVCache,
                sids: list[int], logits: torch.Tensor) -> HFSessions:
    """HF's contender: its own prefill, or its DynamicCache filled from fedkv's fp32 K/V of
    the same prompts (and fedkv's last logits) to save the untimed prefill."""
    if own_prefill:
        return HFSessions(hf, *hf_prefill(hf, prompts))
    return HFSessions(hf, *hf_cache_from(hf, kv, sids), logits)


def interleave(steppers: dict[str, Stepper], segments: int, steps: int, label: str,
               log: Callable[[str], None] = print) -> dict[str, list[float]]:
    """tokens/s of ``segments`` timed segments of ``steps`` steps per contender; the order
    rotates each segment so no contender owns a fixed slot; one untimed step each first."""
    names = list(steppers)
    for s in steppers.values():
        s.step()
    samples: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(segments):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            made = sum(steppers[name].step() for _ in range(steps))
            samples[name].append(made / (time.perf_counter() - t0))
        log(f"  {label} segment {rep + 1}: " + ", ".join(f"{n} {samples[n][-1]:.2f}"
                                                       for n in names))
    return samples


class StreamHandle:
    """A contender's ``node.engine.generation.GenerationHandle``: its tokens stream as they come."""

    def __init__(self, rid: str, prompt_tokens: int):
        self.request_id, self.prompt_tokens, self.cached_prompt_tokens = rid, prompt_tokens, 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.model_version: int | None = 0
        self.stream = TokenStream()
        self.tokens = self.stream.tokens

    def cancel(self) -> None:
        self.finish_reason = self.finish_reason or "cancelled"
