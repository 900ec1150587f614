"""KV-cache benchmark: memory per token, decode speed, quantization quality, prefix sharing,
pool utilisation and eviction collateral of the fedkv engine, side by side with Hugging Face's
DynamicCache, a naive torch.cat cache and no cache at all, in one run.

    python -m experiments.bench_kv --quick --json      # < 3 min on 2 cores; last line = JSON

Modes: default (fuller, slower), ``--quick`` and ``--tiny`` (a toy model and 128/512-token
contexts, for tests). Every figure is measured here, now; nothing is copied from the articles.
Human-readable lines go to stdout before the JSON; with ``--json`` the last line is one JSON
object. The engine is read only through its public API (``KVCache`` methods and ``stats()``).

What each section measures (also stated inside the JSON under ``notes``):

* ``bytes_per_token`` — ``KVCache.bytes_per_token(dtype)``: bytes of one full block's format
  (codes + fp16 scales + int4 zero points) over all layers, divided by the block size. The
  pool's page-rounded slot bytes per token are reported separately (``slot_bytes_per_token``).
* ``arena_bytes_per_token`` — ``KVCache.arena_bytes_per_token(dtype)`` for the federation's
  ``node.tasks.tasks.LM_MODEL`` (its node cache geometry) and for the benchmark model.
* ``decode_tokens_per_s`` (1,024 tokens of context) and ``decode_tokens_per_s_4096`` — prefill
  ``context`` tokens, then time greedy decode steps; variants are interleaved across repeats and
  medians are reported. Same model dimensions everywhere and the same torch thread count.
  ``hf_dynamic_cache`` runs a randomly initialised GPT-2 of the same size (4 layers, 4 heads,
  d_model 256, byte vocabulary) with ``DynamicCache``. At 4,096 tokens the trained checkpoint's
  position table is tiled to the longer context (timing does not depend on the weights).
* ``batched`` — 16 sessions sharing a 1,024-token held-out prefix, each with its own 64-token
  tail, 64 greedy steps: tokens/s and KV bytes of fedkv batched (``forward_batch``), fedkv one
  session at a time (``forward_cached``) and HF ``DynamicCache`` batched with left padding.
* ``quality`` — teacher-forced decode loop, one token per ``forward_cached`` call, on held-out
  stdlib modules with the briefly trained checkpoint (``node.tasks.lm.pretrained_tiny``); int8/int4
  against fp32 of the same model.
* ``prefix_sharing`` — one prefix session plus N sessions that each ``prefill(prefix + tail)``
  with the real model (the prefix blocks are reused via ``match_prefix``).
* ``pool_utilisation`` — a replay of sessions with long-tailed lengths, opened/closed
  interleaved, K/V fed through ``reserve``/``write`` with random tensors (memory accounting
  does not depend on the values).
* ``eviction_collateral`` — a pool full of cached (closed-session) prefix blocks with one free
  full-size slot; a 3-token ``reserve``; ``stats()["eviction_collateral"]`` (the most cached
  blocks one allocation evicted, ``cache.manager.BlockManager._note_collateral``).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import inspect
import io
import json
import math
import os
import pstats
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from cache import KVCache
from cache.attention import attend
from node.tasks.corpus import random_windows, split_corpus
from node.tasks.lm import pretrained_tiny
from node.models.byte_model import ModelConfig, TinyTransformer
from node.tasks.tasks import LM_MODEL

DTYPES = ("fp32", "fp16", "int8", "int4")
DECODE_VARIANTS = ("fedkv_fp32", "fedkv_int8", "fedkv_int4", "hf_dynamic_cache", "naive_concat",
                   "no_cache")
TARGETS = {
    "int4_vs_fp16 <= 0.28": None,
    "int8_vs_fp16 <= 0.53": None,
    "int8 top1_agreement >= 0.999": None,
    "int8 ppl_delta <= 0.02": None,
    "int4 top1_agreement >= 0.99": None,
    "int4 ppl_delta <= 0.1": None,
    "fedkv_fp32 >= hf_dynamic_cache": None,
    "fedkv_fp32 >= 10x no_cache": None,
    "prefix ratio <= 1.05": None,
    "restore warm >= 10x recompute": None,
    "restore cold >= 3x recompute": None,
    "pool_utilisation >= 0.96": None,
    "pool_utilisation_live_sessions >= 0.96": None,
    # issue 9
    "fedkv_fp32 >= 1.2x hf_dynamic_cache (1024)": None,
    "fedkv_fp32 >= 1.2x hf_dynamic_cache (4096)": None,
    "fedkv_fp32 >= naive_concat (1024)": None,
    "fedkv_fp32 >= naive_concat (4096)": None,
    "fedkv_int8 >= 0.9x fedkv_fp32": None,
    "fedkv_int4 >= 0.8x fedkv_fp32": None,
    "arena int8/fp16 <= 0.55 (lm_model, bench_model)": None,
    "arena int4/fp16 <= 0.30 (lm_model, bench_model)": None,
    "eviction_collateral <= 1": None,
    "fedkv_batched >= 3x hf_batched": None,
    "batched kv_bytes fedkv <= 1/8 hf": None,
}


@dataclass
class Plan:
    """Sizes of one benchmark run."""

    model: ModelConfig
    context: int
    decode_steps: int
    no_cache_steps: int
    repeats: int
    train_steps: int
    train_batch: int
    train_seq: int
    quality_seqs: int
    quality_len: int
    prefix_sessions: int
    tail_min: int
    tail_max: int
    pool_sessions: int
    pool_live: int
    pool_median_len: float
    pool_sigma: float
    pool_max_len: int
    long_context: int = 4096
    long_decode_steps: int = 32
    long_no_cache_steps: int = 2
    batch_sessions: int = 16
    batch_prefix: int = 1024
    batch_tail: int = 64
    batch_steps: int = 64


def make_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        ctx = args.context or 128
        model = ModelConfig(n_layers=2, n_heads=2, d_model=64, context_len=max(256, ctx + 64))
        return Plan(model, ctx, 4, 2, 1, args.train_steps or 3, 2, 64, 1, 128, 6, 4, 24,
                    24, 6, 48.0, 0.8, 256, long_context=4 * ctx, long_decode_steps=4,
                    long_no_cache_steps=1, batch_sessions=4, batch_prefix=64, batch_tail=8,
                    batch_steps=8)
    ctx = args.context or 1024
    model = ModelConfig(n_layers=4, n_heads=4, d_model=256, context_len=max(1280, ctx + 192))
    if args.quick:
        return Plan(model, ctx, 64, 8, 3, args.train_steps or 150, 4, 256, 4, 256, 100, 16,
                    64, 200, 16, 256.0, 0.9, 2048, long_decode_steps=32, long_no_cache_steps=2)
    # quality sequences never exceed the training length (positions beyond it are untrained)
    return Plan(model, ctx, 128, 16, 5, args.train_steps or 600, 8, 256, 8, 256, 100, 16, 64,
                200, 16, 256.0, 0.9, 2048, long_decode_steps=64, long_no_cache_steps=4)


def log(msg: str) -> None:
    print(msg, flush=True)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _pool_bytes_for(cfg: ModelConfig, block: int, tokens: int, slack: float = 1.5) -> int:
    """A pool whose full-precision share (all of it in fp caches, ``read_buffer_fraction``
    in quantized ones) holds ``tokens`` of K/V with room to spare."""
    cc = cfg.cache_config(block_size=block)
    blocks = -(-tokens // block) + 2
    need = int(blocks * cc.block_bytes_fp32 * slack / cc.read_buffer_fraction)
    return need + 2 * cc.managed_block_bytes


# == bytes per token =======================================================================
def _cache_for(cfg: ModelConfig, dtype: str, **kw) -> KVCache:
    return KVCache(cfg.cache_config(kv_dtype=dtype, pool_bytes=4 << 20, **kw))


def bytes_section(cfg: ModelConfig, block_size: int) -> dict:
    """Format, slot and arena bytes per token of every dtype for one block size."""
    bpt = {d: _cache_for(cfg, "fp32", block_size=block_size).bytes_per_token(d)
           for d in DTYPES}
    caches = {d: _cache_for(cfg, d, block_size=block_size) for d in DTYPES}
    slot = {d: kv.slot_bytes(d) / block_size for d, kv in caches.items()}
    arena = {d: kv.arena_bytes_per_token(d) for d, kv in caches.items()}
    return {
        "bytes_per_token": bpt,
        "int8_vs_fp16": bpt["int8"] / bpt["fp16"],
        "int4_vs_fp16": bpt["int4"] / bpt["fp16"],
        "slot_bytes_per_token": slot,
        "slot_int8_vs_fp16": slot["int8"] / slot["fp16"],
        "slot_int4_vs_fp16": slot["int4"] / slot["fp16"],
        "arena_bytes_per_token": arena,
        "arena_int8_vs_fp16": arena["int8"] / arena["fp16"],
        "arena_int4_vs_fp16": arena["int4"] / arena["fp16"],
    }


def arena_per_token(cfg: ModelConfig, **kw) -> dict[str, float]:
    """Real arena bytes per token of a full block, per dtype, for one cache geometry."""
    return {d: _cache_for(cfg, d, **kw).arena_bytes_per_token(d) for d in DTYPES}


def arena_section(bench_cfg: ModelConfig, block: int) -> dict:
    """``arena_bytes_per_token`` for LM_MODEL (the node's cache config: default block size)
    and for the benchmark model (``--block-size``), with int8/int4 over fp16 ratios."""
    per = {"lm_model": arena_per_token(LM_MODEL),
           "bench_model": arena_per_token(bench_cfg, block_size=block)}
    ratios = {g: {f"{d}_vs_fp16": v[d] / v["fp16"] for d in ("int8", "int4")}
              for g, v in per.items()}
    return {
        "arena_bytes_per_token": per,
        "arena_ratios": ratios,
        "arena_geometry": {
            "lm_model": {**asdict(LM_MODEL), "block_size": LM_MODEL.cache_config().block_size},
            "bench_model": {**asdict(bench_cfg), "block_size": block},
        },
    }


def log_bytes(result: dict, block: int) -> None:
    b = result
    log(f"bytes/token (block {block}): " + ", ".join(
        f"{k} {v:.0f}" for k, v in b["bytes_per_token"].items())
        + f"; int8 {b['int8_vs_fp16']:.3f}x (target <= 0.53), int4 {b['int4_vs_fp16']:.3f}x "
        "(target <= 0.28) fp16")
    log(f"  page-rounded slots: int8 {b['slot_int8_vs_fp16']:.3f}x, int4 "
        f"{b['slot_int4_vs_fp16']:.3f}x fp16")
    bb = b["by_block_size"]["16"]
    log(f"  block 16: int8 {bb['int8_vs_fp16']:.3f}x, int4 {bb['int4_vs_fp16']:.3f}x fp16 "
        f"(arena {bb['arena_int8_vs_fp16']:.3f}x, {bb['arena_int4_vs_fp16']:.3f}x)")
    for geom, per in b["arena_bytes_per_token"].items():
        r = b["arena_ratios"][geom]
        log(f"  arena bytes/token {geom}: " + ", ".join(f"{d} {v:.0f}" for d, v in per.items())
            + f"; int8/fp16 {r['int8_vs_fp16']:.3f} (target <= 0.55), int4/fp16 "
            f"{r['int4_vs_fp16']:.3f} (target <= 0.30)")


# == decode throughput: the contenders =====================================================
class NaiveConcat:
    """The article's cache: per-layer K/V tensors grown with torch.cat, same TinyTransformer
    weights (only its public submodules are used)."""

    def __init__(self, model: TinyTransformer):
        self.m = model
        self.past: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * model.cfg.n_layers
        self.length = 0

    @torch.no_grad()
    def step(self, tokens: list[int]) -> torch.Tensor:
        m, cfg = self.m, self.m.cfg
        H, D = cfg.n_heads, cfg.head_dim
        idx = torch.as_tensor(tokens, dtype=torch.long)
        T = idx.numel()
        x = m.tok(idx) + m.pos(torch.arange(self.length, self.length + T))
        for i, blk in enumerate(m.blocks):
            q, k, v = blk.qkv(blk.ln1(x)).split(cfg.d_model, dim=-1)
            q, k, v = (t.unflatten(-1, (H, D)).transpose(0, 1) for t in (q, k, v))
            if self.past[i] is not None:
                k = torch.cat((self.past[i][0], k), dim=1)
                v = torch.cat((self.past[i][1], v), dim=1)
            self.past[i] = (k, v)
            L = k.shape[1]
            mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=L - T) if T > 1 else None
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + blk.proj(a.transpose(0, 1).flatten(-2))
            x = x + blk.mlp(blk.ln2(x))
        self.length += T
        return m.head(m.ln_f(x))


def hf_model(cfg: ModelConfig):
    """A randomly initialised GPT-2 with TinyTransformer's dimensions (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hc = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.context_len, n_embd=cfg.d_model,
        n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.mlp_ratio * cfg.d_model,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    try:
        m = GPT2LMHeadModel._from_config(hc, attn_implementation="sdpa")
    except Exception:  # older/newer signature: fall back to the default attention
        m = GPT2LMHeadModel(hc)
    return m.eval(), hc


def _hf_cache_kw(model) -> str:
    """The keyword this transformers version's forward takes the cache under."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFRunner:
    def __init__(self, model, hc):
        from transformers import DynamicCache

        self.m, self.hc = model, hc
        self.cache = DynamicCache(config=hc)
        self.kw = _hf_cache_kw(model)

    @torch.no_grad()
    def step(self, tokens: list[int]) -> torch.Tensor:
        out = self.m(torch.tensor([tokens]), use_cache=True, **{self.kw: self.cache})
        return out.logits[0]


def long_context_model(model: TinyTransformer, context_len: int) -> TinyTransformer:
    """The same weights with the position table tiled to ``context_len`` rows (for timing
    decode at contexts longer than the checkpoint was trained for)."""
    if context_len <= model.cfg.context_len:
        return model
    long = TinyTransformer(dataclasses.replace(model.cfg, context_len=context_len))
    state = dict(model.state_dict())
    pos = state["pos.weight"]
    state["pos.weight"] = pos.repeat(-(-context_len // pos.shape[0]), 1)[:context_len]
    long.load_state_dict(state)
    return long.eval()


# == decode throughput: timing =============================================================
Runner = Callable[[], tuple[float, torch.Tensor]]


def _decode_loop(step, prompt: list[int], n: int) -> tuple[float, torch.Tensor]:
    """Prefill (untimed), then n greedy steps timed; returns (tokens/s, first-step logits)."""
    logits = step(prompt)[-1]
    first = None
    t0 = time.perf_counter()
    for _ in range(n):
        logits = step([int(logits.argmax())])[-1]
        if first is None:
            first = logits
    return n / (time.perf_counter() - t0), first


def decode_variants(model: TinyTransformer, hf, prompt: list[int], steps: int,
                    no_cache_steps: int, block: int) -> dict[str, Runner]:
    """One runner per contender; each builds a fresh cache, prefills ``prompt`` and times
    ``steps`` greedy decode steps (``no_cache_steps`` for the recompute-everything one)."""
    cfg = model.cfg
    pool = _pool_bytes_for(cfg, block, len(prompt) + steps + 2 * block)
    hfm, hc = hf

    def fedkv(dtype: str) -> Runner:
        def run():
            kv = KVCache(cfg.cache_config(block_size=block, kv_dtype=dtype, pool_bytes=pool))
            sid = kv.open_session()
            return _decode_loop(lambda t: model.forward_cached(t, kv, sid), prompt, steps)
        return run

    def naive():
        return _decode_loop(NaiveConcat(model).step, prompt, steps)

    def hf_cache():
        return _decode_loop(HFRunner(hfm, hc).step, prompt, steps)

    def no_cache():
        seq: list[int] = []

        @torch.no_grad()
        def step(toks):  # recompute the whole sequence every step
            seq.extend(toks)
            return model(torch.tensor([seq]))[0]

        return _decode_loop(step, prompt, no_cache_steps)

    runners = {"fedkv_fp32": fedkv("fp32"), "fedkv_int8": fedkv("int8"),
               "fedkv_int4": fedkv("int4"), "hf_dynamic_cache": hf_cache,
               "naive_concat": naive, "no_cache": no_cache}
    assert tuple(runners) == DECODE_VARIANTS
    return runners


def time_interleaved(runners: dict[str, Runner], repeats: int, warmup: bool,
                     label: str) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Run every variant ``repeats`` times, rotating the order each repeat so no variant
    owns a fixed slot; returns the tokens/s samples and each variant's first-step logits."""
    names = list(runners)
    if warmup:  # one untimed pass (allocator, kernels, lazy imports); no_cache needs none
        for name in names:
            if name != "no_cache":
                runners[name]()
    samples: dict[str, list[float]] = {k: [] for k in names}
    firsts: dict[str, torch.Tensor] = {}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            tps, first = runners[name]()
            samples[name].append(tps)
            firsts.setdefault(name, first)
        log(f"  decode {label} repeat {rep + 1}: " + ", ".join(
            f"{n} {samples[n][-1]:.1f}" for n in names))
    return samples, firsts


def decode_ratios(med: dict[str, float]) -> dict[str, float]:
    return {
        "fedkv_fp32_vs_hf": _ratio(med["fedkv_fp32"], med["hf_dynamic_cache"]),
        "fedkv_fp32_vs_no_cache": _ratio(med["fedkv_fp32"], med["no_cache"]),
        "fedkv_fp32_vs_naive_concat": _ratio(med["fedkv_fp32"], med["naive_concat"]),
        "fedkv_int8_vs_fp32": _ratio(med["fedkv_int8"], med["fedkv_fp32"]),
        "fedkv_int4_vs_fp32": _ratio(med["fedkv_int4"], med["fedkv_fp32"]),
    }


def decode_consistency(firsts: dict[str, torch.Tensor]) -> dict[str, float]:
    """The cached fedkv decode must produce the torch.cat cache's and no cache's logits."""
    ref = firsts["fedkv_fp32"]
    return {f"max_abs_logit_diff_fedkv_fp32_vs_{k}": float((firsts[k] - ref).abs().max())
            for k in ("naive_concat", "no_cache")}


def decode_section(model: TinyTransformer, plan: Plan, prompt: list[int], block: int) -> dict:
    """Decode tokens/s at ``plan.context`` tokens (today's keys, unchanged)."""
    hf = hf_model(model.cfg)
    runners = decode_variants(model, hf, prompt, plan.decode_steps, plan.no_cache_steps, block)
    samples, firsts = time_interleaved(runners, plan.repeats, True, str(len(prompt)))
    med = {k: _median(v) for k, v in samples.items()}
    return {
        "hf_attn_implementation": getattr(hf[0].config, "_attn_implementation", None),
        "decode_tokens_per_s": med,
        "decode_samples": samples,
        **decode_ratios(med),
        "decode_consistency": decode_consistency(firsts),
    }


def decode_long_section(model: TinyTransformer, plan: Plan, prompt: list[int],
                        block: int) -> dict:
    """The same contenders at ``plan.long_context`` tokens: ``decode_tokens_per_s_4096`` and
    its details (steps timed per variant: ``no_cache`` over fewer)."""
    long = long_context_model(model, plan.long_context + plan.long_decode_steps + 64)
    hf = hf_model(long.cfg)
    runners = decode_variants(long, hf, prompt, plan.long_decode_steps,
                              plan.long_no_cache_steps, block)
    # the short-context section already warmed allocator and kernels up
    samples, firsts = time_interleaved(runners, plan.repeats, False, str(len(prompt)))
    med = {k: _median(v) for k, v in samples.items()}
    return {
        "decode_tokens_per_s_4096": med,
        "decode_4096": {
            "context": len(prompt),
            "decode_steps": plan.long_decode_steps,
            "no_cache_steps": plan.long_no_cache_steps,
            "repeats": plan.repeats,
            "samples": samples,
            **decode_ratios(med),
            "decode_consistency": decode_consistency(firsts),
            "weights": "trained checkpoint, position table tiled to the longer context",
        },
    }


def log_decode(med: dict[str, float], ratios: dict[str, float], context: int,
               repeats: int, seconds: float) -> None:
    log("decode tokens/s at %d context (median of %d): %s" % (context, repeats, ", ".join(
        f"{k} {v:.1f}" for k, v in med.items())))
    log(f"  fedkv_fp32 / hf = {ratios['fedkv_fp32_vs_hf']:.2f}x (target >= 1.2), / naive_concat"
        f" = {ratios['fedkv_fp32_vs_naive_concat']:.2f}x (target >= 1.0), / no_cache = "
        f"{ratios['fedkv_fp32_vs_no_cache']:.1f}x; int8/fp32 = "
        f"{ratios['fedkv_int8_vs_fp32']:.2f} (target >= 0.9), int4/fp32 = "
        f"{ratios['fedkv_int4_vs_fp32']:.2f} (target >= 0.8)  ({seconds:.1f}s)")


# == batched decode: many sessions over one shared prefix ==================================
def hf_kv_bytes(cache) -> int:
    """Bytes of every layer's key and value tensors in a DynamicCache (``layers[i].keys``
    in recent transformers, ``key_cache``/``value_cache`` lists in older ones)."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:
        pairs = list(zip(cache.key_cache, cache.value_cache))
    return sum(k.nbytes + v.nbytes for k, v in pairs if k is not None)


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest], shorter prompts padded on the left."""
    n = max(map(len, prompts))
    ids = torch.tensor([[pad] * (n - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class HFBatched:
    """HF GPT-2 with one DynamicCache over a left-padded batch: an untimed prefill, then
    greedy steps of input [B, 1]; positions follow the attention mask (padding skipped)."""

    def __init__(self, hf, prompts: list[list[int]]):
        from transformers import DynamicCache

        self.m, hc = hf
        self.cache = DynamicCache(config=hc)
        self.kw = _hf_cache_kw(self.m)
        self.ids, self.mask = left_pad(prompts)

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.m(ids, attention_mask=self.mask, position_ids=pos, use_cache=True,
                     **{self.kw: self.cache})
        return out.logits[:, -1]

    def prefill(self) -> torch.Tensor:
        return self._forward(self.ids, (self.mask.cumsum(-1) - 1).clamp(min=0))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat((self.mask, torch.ones_like(self.mask[:, :1])), dim=1)
        return self._forward(tokens[:, None], self.mask.sum(-1, keepdim=True) - 1)


def _fedkv_prefilled(model: TinyTransformer, prompts: list[list[int]], block: int,
                     pool: int, **cfg) -> tuple[KVCache, list[int], torch.Tensor]:
    """A fresh cache with one session per prompt; later sessions reuse the cached prefix."""
    kv = KVCache(model.cfg.cache_config(block_size=block, pool_bytes=pool, **cfg))
    sids = [kv.open_session() for _ in prompts]
    return kv, sids, torch.stack([model.prefill(p, kv, s) for p, s in zip(prompts, sids)])


def _decode_together(model: TinyTransformer, kv: KVCache, sids: list[int],
                     logits: torch.Tensor, steps: int) -> list[list[int]]:
    """``steps`` greedy steps, each one ``forward_batch`` over all sessions."""
    fed = []
    for _ in range(steps):
        fed.append(logits.argmax(-1).tolist())
        logits = model.forward_batch(fed[-1], kv, sids)
    return [list(t) for t in zip(*fed)]


def _decode_one_by_one(model: TinyTransformer, kv: KVCache, sids: list[int],
                       logits: torch.Tensor, steps: int) -> list[list[int]]:
    """Each session decodes ``steps`` greedy steps alone, one session after another."""
    out = []
    for sid, last in zip(sids, logits):
        fed: list[int] = []
        for _ in range(steps):
            fed.append(int(last.argmax()))
            last = model.forward_cached([fed[-1]], kv, sid)[-1]
        out.append(fed)
    return out


def batched_runners(model: TinyTransformer, hf, prompts: list[list[int]], steps: int,
                    block: int) -> dict[str, Runner]:
    """Each runner prefills its contender afresh (untimed), times ``steps`` greedy steps of
    every session and returns (tokens/s, {kv_bytes, tokens fed})."""
    n_tok = len(prompts) * steps
    shared = len(os.path.commonprefix(prompts))
    held = shared + sum(len(p) - shared + steps + 2 * block for p in prompts)
    pool = _pool_bytes_for(model.cfg, block, held)

    def fedkv(decode, **cfg) -> Runner:
        def run():
            kv, sids, logits = _fedkv_prefilled(model, prompts, block, pool, **cfg)
            t0 = time.perf_counter()
            fed = decode(model, kv, sids, logits, steps)
            tps = n_tok / (time.perf_counter() - t0)
            st = kv.stats()  # the batch's tail buffer is K/V memory too
            held = st["bytes_allocated"] + st["batch_tail_buffer_bytes"]
            return tps, {"kv_bytes": held, "tokens": fed}
        return run

    def hf_batched():
        r = HFBatched(hf, prompts)
        logits = r.prefill()
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = r.step(logits.argmax(-1))
        tps = n_tok / (time.perf_counter() - t0)
        return tps, {"kv_bytes": hf_kv_bytes(r.cache), "tokens": None}

    return {"fedkv_batched": fedkv(_decode_together),
            "fedkv_batched_no_tail_buffer": fedkv(_decode_together, batch_tail_buffer=False),
            "fedkv_sequential": fedkv(_decode_one_by_one), "hf_batched": hf_batched}


def batched_prompts(plan: Plan, text: list[int], heldout: bytes,
                    seed: int) -> list[list[int]]:
    """``batch_sessions`` prompts: one shared held-out prefix, each its own held-out tail."""
    g = torch.Generator().manual_seed(seed + 31)
    tails = random_windows(heldout, plan.batch_tail - 1, plan.batch_sessions, g).tolist()
    prefix = text[: plan.batch_prefix]
    assert len(prefix) == plan.batch_prefix, "held-out prompt shorter than batch_prefix"
    return [prefix + t for t in tails]


def batched_section(model: TinyTransformer, plan: Plan, prompts: list[list[int]],
                    block: int) -> dict:
    """tokens/s and KV bytes of fedkv batched, fedkv one session at a time and HF batched."""
    t = time.perf_counter()
    long = long_context_model(model, max(map(len, prompts)) + plan.batch_steps + 1)
    runners = batched_runners(long, hf_model(long.cfg), prompts, plan.batch_steps, block)
    runners["hf_batched"]()  # untimed warm-up: HF's first [B, L] batch runs cold
    samples, info = time_interleaved(runners, plan.repeats, False, "batched")
    med = {k: _median(v) for k, v in samples.items()}
    kvb = {k: info[k]["kv_bytes"] for k in runners}
    shared = len(os.path.commonprefix(prompts))
    held = shared + sum(len(p) - shared + plan.batch_steps for p in prompts)
    padded = len(prompts) * (max(map(len, prompts)) + plan.batch_steps)
    return {
        **med,
        "kv_bytes": kvb,
        "fedkv_batched_vs_hf_batched": _ratio(med["fedkv_batched"], med["hf_batched"]),
        "fedkv_batched_vs_sequential": _ratio(med["fedkv_batched"], med["fedkv_sequential"]),
        "tail_buffer_speedup": _ratio(med["fedkv_batched"], med["fedkv_batched_no_tail_buffer"]),
        "kv_bytes_fedkv_vs_hf": _ratio(kvb["fedkv_batched"], kvb["hf_batched"]),
        "tokens_held_fedkv_vs_hf": held / padded,
        "tokens_agree": info["fedkv_batched"]["tokens"] == info["fedkv_sequential"]["tokens"],
        "sessions": len(prompts),
        "prefix_tokens": plan.batch_prefix,
        "tail_tokens": plan.batch_tail,
        "steps": plan.batch_steps,
        "repeats": plan.repeats,
        "samples": samples,
        "seconds": time.perf_counter() - t,
    }


def log_batched(r: dict) -> None:
    kb = r["kv_bytes"]
    log(f"batched: {r['sessions']} sessions x ({r['prefix_tokens']}-token shared prefix + "
        f"{r['tail_tokens']}-token tail), {r['steps']} steps; tokens/s fedkv batched "
        f"{r['fedkv_batched']:.1f}, one at a time {r['fedkv_sequential']:.1f}, hf batched "
        f"{r['hf_batched']:.1f}: {r['fedkv_batched_vs_hf_batched']:.2f}x hf (target >= 3)")
    log(f"  KV MiB: fedkv batched {kb['fedkv_batched'] / 2**20:.1f}, sequential "
        f"{kb['fedkv_sequential'] / 2**20:.1f}, hf {kb['hf_batched'] / 2**20:.1f}: "
        f"{r['kv_bytes_fedkv_vs_hf']:.3f} of hf (target <= 0.125; tokens held "
        f"{r['tokens_held_fedkv_vs_hf']:.3f} of hf's); greedy tokens batched == sequential: "
        f"{r['tokens_agree']}  ({r['seconds']:.1f}s)")


# == profile ===============================================================================
def _time_us(f, n: int = 50) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def _profiled_decode(model: TinyTransformer, kv: KVCache, sid: int, logits: torch.Tensor,
                     steps: int) -> tuple[float, list[tuple[float, float, str]]]:
    """Decode ``steps`` tokens under cProfile; (seconds, rows of (tottime, cumtime, name))."""
    pr = cProfile.Profile()
    pr.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward_cached([int(logits.argmax())], kv, sid)[-1]
    total = time.perf_counter() - t0
    pr.disable()
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = [(tt, ct, f"{os.path.basename(fn)}:{line}({name})")
            for (fn, line, name), (_, _, tt, ct, _) in st.stats.items()]
    return total, sorted(rows, reverse=True)


def gather_micro(cfg: ModelConfig, block: int, n_blocks: int, slot_floats: int,
                 context: int) -> dict[str, float]:
    """Per-layer costs of the ways to read K/V, on a synthetic arena with the engine's slot
    size and block count (8 slots per slab, blocks scattered): advanced indexing vs one
    index_select, the transpose to [heads, tokens, dim], HF-style torch.cat, one SDPA."""
    H, D = cfg.n_heads, cfg.head_dim
    E = 2 * H * block * D  # one layer's K and V of one block
    per_slab = 8
    slabs_n = -(-2 * n_blocks // per_slab)
    arena = torch.randn(slabs_n, per_slab, max(slot_floats, E))
    where = torch.randperm(slabs_n * per_slab)[:n_blocks]
    slabs, idxs = where // per_slab, where % per_slab
    layer0 = arena[:, :, :E]
    flat = layer0.flatten(0, 1)
    g = layer0[slabs, idxs].view(-1, 2, H, block, D)
    kc, kn = torch.randn(1, H, context, D), torch.randn(1, H, 1, D)
    q, kk = torch.randn(H, 1, D), torch.randn(H, context, D)
    return {
        "advanced_index_gather_us": _time_us(lambda: layer0[slabs, idxs]),
        "index_select_gather_us": _time_us(lambda: flat.index_select(0, where)),
        "transpose_reshape_us": _time_us(lambda: g[:, 0].transpose(0, 1).reshape(H, -1, D)),
        "hf_style_cat_k_and_v_us": _time_us(
            lambda: (torch.cat((kc, kn), -2), torch.cat((kc, kn), -2))),
        "sdpa_one_query_us": _time_us(lambda: F.scaled_dot_product_attention(q, kk, kk)),
        "attend_one_query_us": _time_us(lambda: attend(q, [(kk, kk)])),
    }


def profile_section(model: TinyTransformer, prompt: list[int], block: int, steps: int) -> dict:
    """Where a fedkv fp32 decode step spends its time, what one ``KVCache.read`` costs, and
    the gather alternatives on a synthetic arena of the same shape."""
    cfg = model.cfg
    pool = _pool_bytes_for(cfg, block, len(prompt) + steps + 2 * block)
    kv = KVCache(cfg.cache_config(block_size=block, pool_bytes=pool))
    sid = kv.open_session()
    total, rows = _profiled_decode(model, kv, sid, model.prefill(prompt, kv, sid), steps)
    share = {op: sum(r[1] for r in rows if r[2].endswith(f"({op})") and "engine" in r[2])
             / total for op in ("read_runs", "write")}
    n_blocks = kv.stats()["blocks_used"]
    micro = {"engine_read_us": _time_us(lambda: kv.read(sid, 0))}
    micro.update(gather_micro(cfg, block, n_blocks, kv.slot_bytes("fp32") // 4, kv.length(sid)))
    return {
        "context": len(prompt),
        "steps": steps,
        "step_ms": total / steps * 1e3,
        "share_in_KVCache_read": share["read_runs"],
        "share_in_KVCache_write": share["write"],
        "top_functions": [{"function": n, "tottime_share": tt / total,
                           "cumtime_share": ct / total} for tt, ct, n in rows[:8]],
        "micro_per_layer": micro,
        "micro_gathers_on": "synthetic arena: same slot size and block count as the engine's",
        "n_blocks_gathered_per_read": n_blocks,
    }


# == quality ===============================================================================
@torch.no_grad()
def _teacher_forced(model: TinyTransformer, kv: KVCache, seqs: list[list[int]],
                    n: int) -> tuple[list[float], list[int]]:
    """Cross-entropy and argmax of every position, one ``forward_cached`` call per token."""
    ce, top = [], []
    for seq in seqs:
        sid = kv.open_session()
        for t in range(n):
            logits = model.forward_cached([seq[t]], kv, sid)[-1]
            ce.append(float(F.cross_entropy(logits[None], torch.tensor([seq[t + 1]]))))
            top.append(int(logits.argmax()))
        kv.close_session(sid)
    return ce, top


def _quality_vs_fp32(r: dict, base: dict, targets: list[int], pos: list[int],
                     first_quant: int, expected_q: int) -> dict:
    mce, base_ce = sum(r["ce"]) / len(r["ce"]), sum(base["ce"]) / len(base["ce"])
    agree = [a == b for a, b in zip(r["top"], base["top"])]
    agree_q = [a for a, p in zip(agree, pos) if p >= first_quant]
    return {
        "top1_agreement": sum(agree) / len(agree),
        "top1_agreement_on_quantized_positions": (
            sum(agree_q) / len(agree_q) if agree_q else float("nan")),
        "ppl": math.exp(mce),
        "ppl_delta": math.exp(mce) - math.exp(base_ce),
        "nats_per_byte_delta": mce - base_ce,
        "top1_accuracy": sum(a == b for a, b in zip(r["top"], targets)) / len(targets),
        "quantized_blocks": r["quantized_blocks"],
        "expected_quantized_blocks": expected_q,
        "kept_full_precision_blocks": r["kept_full_precision_blocks"],
        "mean_block_relative_error": r["mean_quant_error"],
        "seconds": r["seconds"],
    }


def quality_section(model: TinyTransformer, heldout: bytes, plan: Plan, block: int,
                    seed: int) -> dict:
    """int8/int4 vs fp32 in a teacher-forced decode loop on held-out text."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed + 7)
    seqs = random_windows(heldout, plan.quality_len, plan.quality_seqs, g).tolist()
    fp_window = cfg.cache_config(block_size=block).fp_window
    first_quant = fp_window + block  # first position whose read includes a quantized block
    # room for every sequence: no eviction, so no quantization is skipped for lack of space
    pool = _pool_bytes_for(cfg, block, plan.quality_seqs * (plan.quality_len + 2 * block))
    expected_q = plan.quality_seqs * max(0, (plan.quality_len - fp_window) // block)
    res: dict[str, dict] = {}
    for dtype in ("fp32", "int8", "int4"):
        kv = KVCache(cfg.cache_config(block_size=block, kv_dtype=dtype, pool_bytes=pool))
        t0 = time.perf_counter()
        ce, top = _teacher_forced(model, kv, seqs, plan.quality_len)
        st = kv.stats()
        res[dtype] = {"ce": ce, "top": top, "seconds": time.perf_counter() - t0,
                      "quantized_blocks": st["quantized_blocks"],
                      "kept_full_precision_blocks": st["kept_full_precision_blocks"],
                      "mean_quant_error": st["mean_quant_error"]}
    targets = [s[t + 1] for s in seqs for t in range(plan.quality_len)]
    pos = [t for _ in seqs for t in range(plan.quality_len)]
    base = res["fp32"]
    base_ce = sum(base["ce"]) / len(base["ce"])
    return {
        "tokens": len(targets),
        "sequences": len(seqs),
        "sequence_len": plan.quality_len,
        "block_size": block,
        "fp_window": fp_window,
        "positions_reading_quantized_blocks": sum(p >= first_quant for p in pos),
        "fp32": {
            "nats_per_byte": base_ce,
            "ppl": math.exp(base_ce),
            "top1_accuracy": sum(a == b for a, b in zip(base["top"], targets)) / len(targets),
        },
        **{dt: _quality_vs_fp32(res[dt], base, targets, pos, first_quant, expected_q)
           for dt in ("int8", "int4")},
    }


def log_quality(q: dict, seconds: float) -> None:
    for dt, top, dppl in (("int8", 0.999, 0.02), ("int4", 0.99, 0.1)):
        r = q[dt]
        log(f"quality {dt}: top1 agreement {r['top1_agreement']:.4f} (target >= {top}), ppl "
            f"{r['ppl']:.4f} vs fp32 {q['fp32']['ppl']:.4f} (delta {r['ppl_delta']:+.4f}, "
            f"target <= {dppl}), {r['quantized_blocks']} blocks quantized, "
            f"{r['kept_full_precision_blocks']} kept fp")
    log(f"  ({q['tokens']} tokens, {seconds:.1f}s)")


# == prefix sharing ========================================================================
def _prefill_shared(model: TinyTransformer, kv: KVCache, prefix: list[int],
                    tails: list[list[int]]) -> float:
    """prefill(prefix) once, then prefill(prefix + tail) per session; returns seconds."""
    t0 = time.perf_counter()
    model.prefill(prefix, kv, kv.open_session())
    for tail in tails:
        model.prefill(prefix + tail, kv, kv.open_session())
    return time.perf_counter() - t0


def prefix_section(model: TinyTransformer, prefix: list[int], plan: Plan, block: int,
                   seed: int) -> dict:
    """Bytes held by N sessions sharing a prefix vs the ideal and vs no sharing."""
    cfg = model.cfg
    rng = random.Random(seed + 11)
    tails = [[rng.randrange(256) for _ in range(rng.randint(plan.tail_min, plan.tail_max))]
             for _ in range(plan.prefix_sessions)]
    tokens = len(prefix) + sum(len(t) for t in tails) + block * (len(tails) + 2)
    kv = KVCache(cfg.cache_config(block_size=block,
                                  pool_bytes=_pool_bytes_for(cfg, block, tokens, slack=1.2)))
    secs = _prefill_shared(model, kv, prefix, tails)
    st = kv.stats()
    bpt, slot = kv.bytes_per_token("fp32"), kv.slot_bytes("fp32")
    n_tail = sum(len(t) for t in tails)
    shared = st["bytes_allocated"]
    ideal = (len(prefix) + n_tail) * bpt
    unshared = sum(len(prefix) + len(t) for t in tails) * bpt
    ideal_blocks = (-(-len(prefix) // block) + sum(-(-len(t) // block) for t in tails)) * slot
    return {
        "sessions": len(tails),
        "prefix_tokens": len(prefix),
        "tail_tokens_min_max_mean": [min(map(len, tails)), max(map(len, tails)),
                                     n_tail / len(tails)],
        "storage": "fp32",
        "fed_with": "real model: prefill(prefix) once, then prefill(prefix + tail) per session",
        "prefix_tokens_reused_per_session": st["prefix_hit_tokens"] / len(tails),
        "bytes_shared": shared,
        "bytes_ideal": ideal,
        "bytes_unshared": unshared,
        "ratio": shared / ideal,
        "bytes_ideal_block_granular": ideal_blocks,
        "ratio_vs_block_granular_ideal": shared / ideal_blocks,
        "saving_vs_unshared": 1 - shared / unshared,
        "blocks_shared": st["blocks_shared"],
        "seconds": secs,
    }


def log_prefix(ps: dict, po: dict, other: int) -> None:
    log(f"prefix sharing: {ps['sessions']} sessions x {ps['prefix_tokens']}-token prefix: "
        f"{ps['bytes_shared'] / 2**20:.1f} MiB held vs ideal {ps['bytes_ideal'] / 2**20:.1f} MiB "
        f"(ratio {ps['ratio']:.3f}, target <= 1.05; vs block-granular ideal "
        f"{ps['ratio_vs_block_granular_ideal']:.3f}), unshared {ps['bytes_unshared'] / 2**20:.1f}"
        f" MiB ({ps['seconds']:.1f}s); block {other}: ratio {po['ratio']:.3f}")


# == pool utilisation ======================================================================
def session_lengths(plan: Plan, rng: random.Random) -> list[int]:
    """Long-tailed (lognormal) session lengths, clipped to [1, pool_max_len]."""
    return [max(1, min(plan.pool_max_len, int(rng.lognormvariate(
        math.log(plan.pool_median_len), plan.pool_sigma)))) for _ in range(plan.pool_sessions)]


class Replay:
    """Sessions opened, grown and closed interleaved, K/V fed with random tensors."""

    def __init__(self, kv: KVCache, plan: Plan, rng: random.Random, seed: int):
        self.kv, self.plan, self.rng = kv, plan, rng
        c = kv.config
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(c.num_heads, 64 + plan.pool_max_len, c.head_dim, generator=g)
        fp = kv.full_precision_dtype
        self.bpt, self.fresh_slot = kv.bytes_per_token(fp), kv.slot_bytes(fp)
        self.live: dict[int, int] = {}  # sid -> target length
        self.samples: list[float] = []
        self.live_samples: list[float] = []
        self.events = 0

    def feed(self, sid: int, n: int) -> None:
        self.kv.reserve(sid, [self.rng.randrange(256) for _ in range(n)])
        off = self.rng.randrange(64)
        for layer in range(self.kv.config.num_layers):
            self.kv.write(sid, layer, self.noise[:, off:off + n],
                          self.noise[:, off + 1:off + 1 + n])

    def live_util(self) -> float:
        """Token bytes of open sessions over slot bytes of the blocks they reference (fp32
        storage only: with quantized blocks the storage of each block is not public)."""
        if self.kv.config.kv_dtype != "fp32":
            return float("nan")
        blocks_live = self.kv.stats()["blocks_referenced"]
        toks = sum(self.kv.length(s) for s in self.live)
        return toks * self.bpt / (blocks_live * self.fresh_slot) if blocks_live else 0.0

    def open_up_to_capacity(self, lengths: list[int], opened: int) -> int:
        while len(self.live) < self.plan.pool_live and opened < len(lengths):
            sid = self.kv.open_session()
            self.live[sid] = lengths[opened]
            opened += 1
            self.feed(sid, max(1, int(self.live[sid] * self.rng.uniform(0.3, 0.9))))  # prompt
        return opened

    def step(self) -> None:
        """One event: a random open session grows a little, or closes when done."""
        sid = self.rng.choice(list(self.live))
        have = self.kv.length(sid)
        if have >= self.live[sid]:
            self.kv.close_session(sid)
            del self.live[sid]
        else:
            self.feed(sid, min(self.live[sid] - have, self.rng.randint(1, 16)))
        self.events += 1
        if self.events % 10 == 0:
            self.samples.append(self.kv.stats()["kv_utilisation"])
            self.live_samples.append(self.live_util())

    def run(self, lengths: list[int]) -> None:
        """Until the last session has been opened (snapshot with the last wave still open)."""
        opened = 0
        while True:
            opened = self.open_up_to_capacity(lengths, opened)
            if opened >= len(lengths) or not self.live:
                return
            self.step()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def pool_section(cfg: ModelConfig, plan: Plan, block: int, seed: int,
                 kv_dtype: str = "fp32") -> dict:
    """Utilisation of the pool after a replay of sessions with long-tailed lengths."""
    rng = random.Random(seed + 23)
    lengths = session_lengths(plan, rng)
    peak_tokens = sum(sorted(lengths)[-plan.pool_live:]) + plan.pool_live * block
    pool = _pool_bytes_for(cfg, block, peak_tokens, slack=1.3)
    kv = KVCache(cfg.cache_config(block_size=block, kv_dtype=kv_dtype, pool_bytes=pool))
    replay = Replay(kv, plan, rng, seed)
    t0 = time.perf_counter()
    replay.run(lengths)
    st = kv.stats()
    return {
        "kv_dtype": kv_dtype,
        "block_size": block,
        "sessions": len(lengths),
        "max_open_sessions": plan.pool_live,
        "length_distribution": (
            f"lognormal(median={plan.pool_median_len:g}, sigma={plan.pool_sigma}) clipped to "
            f"[1, {plan.pool_max_len}]; mean {sum(lengths) / len(lengths):.1f} tokens"),
        "kv_utilisation": st["kv_utilisation"],
        "kv_utilisation_mean_during_replay": _mean(replay.samples),
        "live_utilisation": replay.live_util(),
        "live_utilisation_mean_during_replay": _mean(replay.live_samples),
        "slab_slot_fill": st["pool_slot_fill"],
        "kv_utilisation_of_slab_bytes": st["kv_utilisation"] * st["pool_slot_fill"],
        "bytes_allocated": st["bytes_allocated"],
        "bytes_holding_tokens": st["bytes_holding_tokens"],
        "blocks_cached_unreferenced": st["blocks_cached_unreferenced"],
        "evictions": st["evictions"],
        "events": replay.events,
        "seconds": time.perf_counter() - t0,
    }


def pool_other_configs(cfg: ModelConfig, plan: Plan, block: int, seed: int) -> dict:
    """The replay at block 16 (fp32) and with int8 storage, headline figures only."""
    extra = {}
    for bs, dt in ((16, "fp32"), (block, "int8")):
        if (bs, dt) != (block, "fp32"):
            e = pool_section(cfg, plan, bs, seed, dt)
            extra[f"block{bs}_{dt}"] = {k: e[k] for k in (
                "kv_utilisation", "kv_utilisation_mean_during_replay", "live_utilisation",
                "live_utilisation_mean_during_replay", "slab_slot_fill",
                "kv_utilisation_of_slab_bytes") if math.isfinite(e[k])}
    return extra


# == eviction collateral ===================================================================
def _feed_random(kv: KVCache, sid: int, tokens: list[int], g: torch.Generator) -> None:
    c = kv.config
    kv.reserve(sid, tokens)
    for layer in range(c.num_layers):
        kv.write(sid, layer, torch.randn(c.num_heads, len(tokens), c.head_dim, generator=g),
                 torch.randn(c.num_heads, len(tokens), c.head_dim, generator=g))


def eviction_section(cfg: ModelConfig, pool_bytes: int = 2 << 20, reserve: int = 3) -> dict:
    """Fill a pool with one-block sessions, closing each (its block stays a cached prefix
    entry), until one free full-size slot is left; then a ``reserve``-token allocation.
    Collateral = the most cached blocks one allocation evicted (``stats()
    ['eviction_collateral']``, counted per allocation, not clamped: > 1 means prefix-cache
    entries evicted that the allocation did not need)."""
    kv = KVCache(cfg.cache_config(pool_bytes=pool_bytes))
    B = kv.config.block_size
    g = torch.Generator().manual_seed(0)
    n = 0
    while kv.stats()["blocks_free_fresh"] > 1:
        sid = kv.open_session()
        _feed_random(kv, sid, list(range(B * n, B * n + B)), g)  # distinct content per block
        kv.close_session(sid)
        n += 1
    before = kv.stats()
    _feed_random(kv, kv.open_session(), [7] * reserve, g)
    after = kv.stats()
    return {
        "eviction_collateral": int(after["eviction_collateral"]),
        "eviction_scenario": {
            "geometry": {**asdict(cfg), "block_size": B, "pool_bytes": pool_bytes},
            "cached_blocks_before": before["blocks_cached_unreferenced"],
            "free_full_slots_before": before["blocks_free_fresh"],
            "reserve_tokens": reserve,
            "evictions": after["evictions"] - before["evictions"],
            "cached_blocks_after": after["blocks_cached_unreferenced"],
        },
    }


# == summary ===============================================================================
NOTES = {
    "bytes_per_token": "KVCache.bytes_per_token(dtype): format bytes of a full block (codes + "
    "fp16 scales + packed int4 zero points), all layers, K and V, divided by block_size. "
    "slot_bytes_per_token: KVCache.slot_bytes(dtype) (the pool slot, rounded up to whole 4 KB "
    "pages) per token. by_block_size[*].arena_bytes_per_token and arena_int*_vs_fp16: "
    "KVCache.arena_bytes_per_token(dtype) for the benchmark model, i.e. what a block really "
    "costs in the arena once the slab's unusable tail is counted.",
    "arena_bytes_per_token": "{lm_model, bench_model} x {dtype: KVCache.arena_bytes_per_token"
    "(dtype)}: lm_model = node.tasks.tasks.LM_MODEL with the node's cache config (default block "
    "size), bench_model = the benchmark model at --block-size; geometries in arena_geometry.",
    "decode": "median tokens/s of greedy decode steps after an untimed prefill of `context` "
    "tokens of held-out text; variants interleaved (rotated order) across repeats; same torch "
    "thread count for all. no_cache recomputes the full sequence each step (fewer steps). "
    "decode_tokens_per_s is at config.context (1,024), decode_tokens_per_s_4096 at "
    "decode_4096.context, with decode_4096.decode_steps steps per variant except no_cache "
    "(decode_4096.no_cache_steps); no separate warm-up there (the 1,024 run warmed up).",
    "quality": "teacher-forced decode loop, one forward_cached call per token, on held-out "
    "stdlib modules; int8/int4 vs fp32 of the same trained checkpoint. ppl = exp(mean nats/byte). "
    "top1_agreement_on_quantized_positions counts only positions >= fp_window + block_size.",
    "prefix_sharing": "bytes_shared = stats()['bytes_allocated'] (slot bytes of every live "
    "block, prefix session included); bytes_ideal = (prefix + all tails) tokens x "
    "bytes_per_token (token-exact, no partial-block padding); bytes_ideal_block_granular = one "
    "copy of the prefix blocks + each tail's blocks, at slot size.",
    "pool_utilisation": "kv_utilisation = stats()['bytes_holding_tokens'] / "
    "stats()['bytes_allocated']: format bytes of the tokens stored in every allocated block "
    "(blocks of open sessions AND full blocks of closed sessions kept as prefix-cache entries) "
    "over the slot bytes allocated (page rounding and partially filled last blocks are the "
    "waste). live_utilisation counts only blocks referenced by open sessions. slab_slot_fill "
    "= stats()['pool_slot_fill'] (slot bytes / bytes of the managed blocks in use) and "
    "kv_utilisation_of_slab_bytes = kv_utilisation x slab_slot_fill also count the unusable "
    "tail of each managed block. Snapshot taken when the last session has been opened, with "
    "the last wave still open.",
    "batched": "sessions prompts = one shared held-out prefix of prefix_tokens + each its own "
    "held-out tail of tail_tokens; steps greedy decode steps per session, timed after an "
    "untimed prefill; tokens/s = sessions x steps / decode seconds, median over repeats, the "
    "three contenders interleaved (rotated order), a fresh cache and prefill for each run. "
    "fedkv_batched: one KVCache (fp32, --block-size), prefill(prompt) per session (the later "
    "sessions reuse the cached prefix blocks), then one model.forward_batch per step. "
    "fedkv_sequential: the same cache setup, each session decoding its steps alone with "
    "forward_cached, one session after another. hf_batched: random GPT-2 of the same dims, one "
    "DynamicCache, input [sessions, longest prompt] left-padded with an attention_mask "
    "(position ids from the mask), then input [sessions, 1] per step. kv_bytes: "
    "stats()['bytes_allocated'] + stats()['batch_tail_buffer_bytes'] after the decode (fedkv), "
    "sum of every layer's key and value "
    "tensor bytes in the DynamicCache after the decode (hf). tokens_held_fedkv_vs_hf: token "
    "positions stored, one copy of the prefix + each session's tail and decoded tokens over "
    "sessions x (longest prompt + steps) (the kv_bytes ratio at equal precision and no "
    "block padding). hf_batched is run once untimed first (its first big batch runs cold). "
    "tokens_agree: the greedy tokens of fedkv_batched and fedkv_sequential are identical.",
    "eviction_collateral": "LM_MODEL geometry, 2 MB pool: one-block sessions opened, fed and "
    "closed (their blocks stay cached) until stats()['blocks_free_fresh'] == 1, then a 3-token "
    "reserve; eviction_collateral = stats()['eviction_collateral'] (the most cached blocks "
    "evicted for one allocation); details in eviction_scenario.",
}


def target_checks(r: dict) -> dict[str, bool]:
    q, d4 = r["quality"], r["decode_4096"]
    arena = r["arena_ratios"].values()
    checks = {
        "int4_vs_fp16 <= 0.28": r["int4_vs_fp16"] <= 0.28,
        "int8_vs_fp16 <= 0.53": r["int8_vs_fp16"] <= 0.53,
        "int8 top1_agreement >= 0.999": q["int8"]["top1_agreement"] >= 0.999,
        "int8 ppl_delta <= 0.02": q["int8"]["ppl_delta"] <= 0.02,
        "int4 top1_agreement >= 0.99": q["int4"]["top1_agreement"] >= 0.99,
        "int4 ppl_delta <= 0.1": q["int4"]["ppl_delta"] <= 0.1,
        "fedkv_fp32 >= hf_dynamic_cache": r["fedkv_fp32_vs_hf"] >= 1.0,
        "fedkv_fp32 >= 10x no_cache": r["fedkv_fp32_vs_no_cache"] >= 10.0,
        "prefix ratio <= 1.05": r["prefix_sharing"]["ratio"] <= 1.05,
        "restore warm >= 10x recompute": r["restore_vs_recompute"]["warm_speedup"] >= 10,
        "restore cold >= 3x recompute": r["restore_vs_recompute"]["cold_speedup"] >= 3,
        "pool_utilisation >= 0.96": r["pool_utilisation"] >= 0.96,
        "pool_utilisation_live_sessions >= 0.96": r["pool_utilisation_live_sessions"] >= 0.96,
        "fedkv_fp32 >= 1.2x hf_dynamic_cache (1024)": r["fedkv_fp32_vs_hf"] >= 1.2,
        "fedkv_fp32 >= 1.2x hf_dynamic_cache (4096)": d4["fedkv_fp32_vs_hf"] >= 1.2,
        "fedkv_fp32 >= naive_concat (1024)": r["fedkv_fp32_vs_naive_concat"] >= 1.0,
        "fedkv_fp32 >= naive_concat (4096)": d4["fedkv_fp32_vs_naive_concat"] >= 1.0,
        "fedkv_int8 >= 0.9x fedkv_fp32": r["fedkv_int8_vs_fp32"] >= 0.9,
        "fedkv_int4 >= 0.8x fedkv_fp32": r["fedkv_int4_vs_fp32"] >= 0.8,
        "arena int8/fp16 <= 0.55 (lm_model, bench_model)": all(
            a["int8_vs_fp16"] <= 0.55 for a in arena),
        "arena int4/fp16 <= 0.30 (lm_model, bench_model)": all(
            a["int4_vs_fp16"] <= 0.30 for a in arena),
        "eviction_collateral <= 1": r["eviction_collateral"] <= 1,
        "fedkv_batched >= 3x hf_batched": r["batched"]["fedkv_batched_vs_hf_batched"] >= 3.0,
        "batched kv_bytes fedkv <= 1/8 hf": r["batched"]["kv_bytes_fedkv_vs_hf"] <= 1 / 8,
    }
    assert set(checks) == set(TARGETS)
    return checks


# == main ==================================================================================
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_kv", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="< 3 min on 2 cores")
    p.add_argument("--tiny", action="store_true", help="toy model and context for tests")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size in tokens (default 32, KIVI's group size)")
    p.add_argument("--context", type=int, default=None, help="context tokens (default 1024)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for every variant (default 1: the machine is shared; "
                   "oversubscribed OpenMP threads make timings erratic)")
    p.add_argument("--train-threads", type=int, default=None,
                   help="torch threads while training the checkpoint (default: --threads)")
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--cache-dir", default=None,
                   help="checkpoint directory (default $FEDKV_CACHE_DIR or ~/.cache/fedkv)")
    p.add_argument("--no-profile", action="store_true", help="skip the decode profile")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    return p


@dataclass
class Bench:
    """What every section needs: the plan, the trained model and held-out text."""

    args: argparse.Namespace
    plan: Plan
    block: int
    model: TinyTransformer
    info: dict
    ckpt_s: float
    heldout: bytes
    prompt: list[int]
    long_prompt: list[int]


def setup(args: argparse.Namespace) -> Bench:
    """Validate flags, train (or load) the checkpoint and cut the prompts."""
    plan = make_plan(args)
    block = args.block_size
    if block < 1:
        raise SystemExit("--block-size must be >= 1")
    if plan.context + plan.decode_steps + 8 > plan.model.context_len:
        raise SystemExit(f"--context {plan.context} too long for the model")
    torch.manual_seed(args.seed)
    warnings.filterwarnings("ignore", category=FutureWarning)
    log(f"fedkv bench_kv ({mode_of(args)}): model {asdict(plan.model)}, block {block}, "
        f"context {plan.context} and {plan.long_context}, threads {args.threads}")
    torch.set_num_threads(args.train_threads or args.threads)
    t = time.perf_counter()
    small = 2_000_000 if args.tiny else None
    model, info = pretrained_tiny(
        plan.model, args.cache_dir, plan.train_steps, batch_size=plan.train_batch,
        seq_len=plan.train_seq, seed=args.seed, return_info=True, log=log, max_bytes=small)
    ckpt_s = time.perf_counter() - t
    log(f"checkpoint {'loaded' if info['cached'] else 'trained'} in {ckpt_s:.1f}s "
        f"(held-out {info['heldout_loss']:.3f} nats/byte)")
    torch.set_num_threads(args.threads)
    model.eval()
    heldout = split_corpus(1, seed=args.seed, max_bytes=small).heldout
    g = torch.Generator().manual_seed(args.seed + 3)
    prompt = random_windows(heldout, plan.context - 1, 1, g)[0].tolist()  # context tokens
    long_prompt = random_windows(heldout, plan.long_context - 1, 1, g)[0].tolist()
    return Bench(args, plan, block, model, info, ckpt_s, heldout, prompt, long_prompt)


def mode_of(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "quick" if args.quick else "full"


def run_bytes(b: Bench, result: dict) -> None:
    result.update(bytes_section(b.plan.model, b.block))
    result["by_block_size"] = {str(bs): bytes_section(b.plan.model, bs) for bs in (16, 32)}
    result.update(arena_section(b.plan.model, b.block))
    log_bytes(result, b.block)


def run_decode(b: Bench, result: dict) -> None:
    t = time.perf_counter()
    d = decode_section(b.model, b.plan, b.prompt, b.block)
    result.update(d)
    log_decode(d["decode_tokens_per_s"], d, b.plan.context, b.plan.repeats,
               time.perf_counter() - t)
    t = time.perf_counter()
    d4 = decode_long_section(b.model, b.plan, b.long_prompt, b.block)
    result.update(d4)
    log_decode(d4["decode_tokens_per_s_4096"], d4["decode_4096"], b.plan.long_context,
               b.plan.repeats, time.perf_counter() - t)
    log(f"  (at {b.plan.long_context}: {b.plan.long_decode_steps} steps per variant, no_cache "
        f"{b.plan.long_no_cache_steps})")


def run_batched(b: Bench, result: dict) -> None:
    prompts = batched_prompts(b.plan, b.long_prompt, b.heldout, b.args.seed)
    result["batched"] = batched_section(b.model, b.plan, prompts, b.block)
    log_batched(result["batched"])


def run_profile(b: Bench, result: dict) -> None:
    if b.args.no_profile:
        return
    p = profile_section(b.model, b.prompt, b.block, 8 if b.args.tiny else 32)
    result["profile"] = p
    log(f"profile: fedkv fp32 step {p['step_ms']:.2f} ms, {p['share_in_KVCache_read']:.0%} "
        f"in KVCache.read; per layer: " + ", ".join(
            f"{k} {v:.0f}" for k, v in p["micro_per_layer"].items()))


def run_quality(b: Bench, result: dict) -> None:
    t = time.perf_counter()
    result["quality"] = quality_section(b.model, b.heldout, b.plan, b.block, b.args.seed)
    log_quality(result["quality"], time.perf_counter() - t)


def run_prefix(b: Bench, result: dict) -> None:
    prefix = b.prompt[: b.plan.context]
    ps = prefix_section(b.model, prefix, b.plan, b.block, b.args.seed)
    other = 16 if b.block != 16 else 32
    po = prefix_section(b.model, prefix, b.plan, other, b.args.seed)
    result["prefix_sharing"] = ps
    result["prefix_sharing_other_block_size"] = {str(other): {k: po[k] for k in (
        "bytes_shared", "bytes_ideal", "ratio", "ratio_vs_block_granular_ideal")}}
    log_prefix(ps, po, other)


def run_pool(b: Bench, result: dict) -> None:
    pu = pool_section(b.plan.model, b.plan, b.block, b.args.seed)
    extra = pool_other_configs(b.plan.model, b.plan, b.block, b.args.seed)
    result["pool_utilisation"] = pu["kv_utilisation"]
    result["pool_utilisation_live_sessions"] = pu["live_utilisation"]
    result["pool"] = pu
    result["pool_other_configs"] = extra
    log(f"pool utilisation: {pu['kv_utilisation']:.4f} (target >= 0.96; live sessions only "
        f"{pu['live_utilisation']:.4f}; mean during replay "
        f"{pu['kv_utilisation_mean_during_replay']:.4f})"
        + "".join(f"; {k}: {v['kv_utilisation']:.4f}" for k, v in extra.items()))


def run_eviction(b: Bench, result: dict) -> None:
    e = eviction_section(LM_MODEL)
    result.update(e)
    s = e["eviction_scenario"]
    log(f"eviction collateral: {e['eviction_collateral']} (target <= 1) cached blocks evicted "
        f"for a {s['reserve_tokens']}-token reserve ({s['cached_blocks_before']} cached, "
        f"{s['free_full_slots_before']} free full slot; {s['evictions']} evictions)")


def run_restore(b: Bench, result: dict) -> None:
    from experiments.bench_restore import restore_section

    r = restore_section(b.model, b.prompt, b.block, 2 if b.args.tiny else 3)
    result["restore_vs_recompute"] = r
    log(f"restore vs recompute ({r['prefix_tokens']} tokens, {r['disk']}): warm "
        f"{r['warm_speedup']:.1f}x (target >= 10), cold {r['cold_speedup']:.1f}x (target >= 3; "
        f"{r['cold_speedup_incl_open']:.1f}x including the store's open)")


SECTIONS = (run_bytes, run_decode, run_batched, run_restore, run_profile, run_quality, run_prefix, run_pool,
            run_eviction)


def finish(b: Bench, result: dict, load0: float, t_start: float) -> None:
    """Targets, configuration, checkpoint and notes."""
    checks = target_checks(result)
    result["targets_met"] = checks
    p = b.plan
    result["config"] = {
        "model": asdict(p.model), "context": p.context, "decode_steps": p.decode_steps,
        "no_cache_steps": p.no_cache_steps, "repeats": p.repeats,
        "long_context": p.long_context, "long_decode_steps": p.long_decode_steps,
        "long_no_cache_steps": p.long_no_cache_steps,
        "torch_threads": b.args.threads, "seed": b.args.seed, "hf_model": "GPT2LMHeadModel, "
        "random init, same dims, sdpa attention, DynamicCache",
        "torch": torch.__version__, "python": sys.version.split()[0],
    }
    result["checkpoint"] = {k: b.info.get(k) for k in (
        "cached", "path", "steps", "batch_size", "seq_len", "lr", "train_seconds",
        "first_loss", "final_loss", "heldout_loss", "heldout_ppl")}
    result["checkpoint"]["seconds_this_run"] = b.ckpt_s
    result["notes"] = NOTES
    result["load_average_start_end"] = [load0, os.getloadavg()[0]]
    result["elapsed_s"] = time.perf_counter() - t_start
    log(f"targets met: {sum(checks.values())}/{len(checks)}; missed: "
        + (", ".join(k for k, v in checks.items() if not v) or "none"))
    log(f"elapsed {result['elapsed_s']:.1f}s")


def run(args: argparse.Namespace) -> dict:
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    b = setup(args)
    result: dict = {"mode": mode_of(args), "block_size": b.block}
    for section in SECTIONS:
        section(b, result)
    finish(b, result, load0, t_start)
    return result


def _finite(x):
    """JSON-safe: NaN/inf become null (and are caught by the tests)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    result = _finite(run(args))
    blob = json.dumps(result, sort_keys=False)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(blob + "\n")
    if args.json:
        print(blob, flush=True)
    return result


if __name__ == "__main__":
    main()
