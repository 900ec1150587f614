"""KV-cache benchmark: memory per token, decode speed, quantization quality, prefix sharing and
pool utilisation of the fedkv engine, side by side with Hugging Face's DynamicCache, a naive
torch.cat cache and no cache at all, in one run.

    python -m experiments.bench_kv --quick --json      # < 3 min on 2 cores; last line = JSON

Modes: default (fuller, slower), ``--quick`` and ``--tiny`` (a toy model and 128-token
context, for tests). Every figure is measured here, now; nothing is copied from the articles.
Human-readable lines go to stdout before the JSON; with ``--json`` the last line is one JSON
object.

What each section measures (also stated inside the JSON under ``notes``):

* ``bytes_per_token`` — ``KVCache.bytes_per_token(dtype)``: bytes of one full block's format
  (codes + fp16 scales + int4 zero points) over all layers, divided by the block size. The
  pool's page-rounded slot bytes per token are reported separately (``slot_bytes_per_token``).
* ``decode_tokens_per_s`` — prefill ``context`` tokens, then time greedy decode steps; variants
  are interleaved across repeats and medians are reported. Same model dimensions everywhere and
  the same torch thread count. ``hf_dynamic_cache`` runs a randomly initialised GPT-2 of the same
  size (4 layers, 4 heads, d_model 256, byte vocabulary) with ``DynamicCache``.
* ``quality`` — teacher-forced decode loop, one token per ``forward_cached`` call, on held-out
  stdlib modules with the briefly trained checkpoint (``node.lm.pretrained_tiny``); int8/int4
  against fp32 of the same model.
* ``prefix_sharing`` — one prefix session plus N sessions that each ``prefill(prefix + tail)``
  with the real model (the prefix blocks are reused via ``match_prefix``).
* ``pool_utilisation`` — a replay of sessions with long-tailed lengths, opened/closed
  interleaved, K/V fed through ``reserve``/``write`` with random tensors (memory accounting
  does not depend on the values).
"""

from __future__ import annotations

import argparse
import cProfile
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

import torch
import torch.nn.functional as F

from cache import KVCache
from node.corpus import random_windows, split_corpus
from node.lm import pretrained_tiny
from node.model import ModelConfig, TinyTransformer

DTYPES = ("fp32", "fp16", "int8", "int4")
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
    "pool_utilisation >= 0.96": None,
    "pool_utilisation_live_sessions >= 0.96": None,
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


def make_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        ctx = args.context or 128
        model = ModelConfig(n_layers=2, n_heads=2, d_model=64, context_len=max(256, ctx + 64))
        return Plan(model, ctx, 4, 2, 1, args.train_steps or 3, 2, 64, 1, 128, 6, 4, 24,
                    24, 6, 48.0, 0.8, 256)
    ctx = args.context or 1024
    model = ModelConfig(n_layers=4, n_heads=4, d_model=256, context_len=max(1280, ctx + 192))
    if args.quick:
        return Plan(model, ctx, 64, 8, 3, args.train_steps or 150, 4, 256, 4, 256, 100, 16,
                    64, 200, 16, 256.0, 0.9, 2048)
    # quality sequences never exceed the training length (positions beyond it are untrained)
    return Plan(model, ctx, 128, 16, 5, args.train_steps or 600, 8, 256, 8, 256, 100, 16, 64,
                200, 16, 256.0, 0.9, 2048)


def log(msg: str) -> None:
    print(msg, flush=True)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# == bytes per token =======================================================================
def bytes_section(cfg: ModelConfig, block_size: int) -> dict:
    cc = cfg.cache_config(block_size=block_size, pool_bytes=4 << 20)
    kv = KVCache(cc)
    bpt = {d: kv.bytes_per_token(d) for d in DTYPES}
    slot, arena = {}, {}
    for d in DTYPES:
        k = KVCache(cfg.cache_config(block_size=block_size, kv_dtype=d, pool_bytes=4 << 20))
        sc = k.pool.classes[d]
        slot[d] = sc.slot_bytes / block_size
        arena[d] = k.pool.slab_bytes / sc.slots_per_slab / block_size
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


# == decode throughput =====================================================================
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


class HFRunner:
    def __init__(self, model, hc):
        from transformers import DynamicCache

        self.m, self.hc = model, hc
        self.cache = DynamicCache(config=hc)
        params = inspect.signature(model.forward).parameters
        self.kw = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def step(self, tokens: list[int]) -> torch.Tensor:
        out = self.m(torch.tensor([tokens]), use_cache=True, **{self.kw: self.cache})
        return out.logits[0]


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


def decode_section(model: TinyTransformer, plan: Plan, prompt: list[int], block: int) -> dict:
    cfg = model.cfg
    hfm, hc = hf_model(cfg)
    pool = _pool_bytes_for(cfg, block, plan.context + plan.decode_steps + 2 * block)

    def fedkv(dtype):
        def run():
            kv = KVCache(cfg.cache_config(block_size=block, kv_dtype=dtype, pool_bytes=pool))
            sid = kv.open_session()
            return _decode_loop(lambda t: model.forward_cached(t, kv, sid), prompt,
                                plan.decode_steps)
        return run

    def naive():
        nc = NaiveConcat(model)
        return _decode_loop(nc.step, prompt, plan.decode_steps)

    def hf():
        r = HFRunner(hfm, hc)
        return _decode_loop(r.step, prompt, plan.decode_steps)

    def no_cache():
        seq: list[int] = []

        @torch.no_grad()
        def step(toks):  # recompute the whole sequence every step
            seq.extend(toks)
            return model(torch.tensor([seq]))[0]

        return _decode_loop(step, prompt, plan.no_cache_steps)

    variants = {
        "fedkv_fp32": fedkv("fp32"), "fedkv_int8": fedkv("int8"), "fedkv_int4": fedkv("int4"),
        "hf_dynamic_cache": hf, "naive_concat": naive, "no_cache": no_cache,
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    firsts: dict[str, torch.Tensor] = {}
    names = list(variants)
    # one untimed warm-up pass of each variant (allocator, kernels, lazy imports)
    for name in names:
        if name != "no_cache":
            variants[name]()
    for rep in range(plan.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: no fixed slot
        for name in order:
            tps, first = variants[name]()
            samples[name].append(tps)
            firsts.setdefault(name, first)
        log("  decode repeat %d: %s" % (rep + 1, ", ".join(
            f"{n} {samples[n][-1]:.1f}" for n in names)))
    med = {k: _median(v) for k, v in samples.items()}
    ref = firsts["fedkv_fp32"]
    consistency = {
        f"max_abs_logit_diff_fedkv_fp32_vs_{k}": float((firsts[k] - ref).abs().max())
        for k in ("naive_concat", "no_cache")
    }
    return {
        "hf_attn_implementation": getattr(hfm.config, "_attn_implementation", None),
        "decode_tokens_per_s": med,
        "decode_samples": samples,
        "fedkv_fp32_vs_hf": med["fedkv_fp32"] / med["hf_dynamic_cache"],
        "fedkv_fp32_vs_no_cache": med["fedkv_fp32"] / med["no_cache"],
        "fedkv_fp32_vs_naive_concat": med["fedkv_fp32"] / med["naive_concat"],
        "fedkv_int8_vs_fp32": med["fedkv_int8"] / med["fedkv_fp32"],
        "fedkv_int4_vs_fp32": med["fedkv_int4"] / med["fedkv_fp32"],
        "decode_consistency": consistency,
    }


def _pool_bytes_for(cfg: ModelConfig, block: int, tokens: int, slack: float = 1.5) -> int:
    cc = cfg.cache_config(block_size=block)
    blocks = -(-tokens // block) + 2
    need = int(blocks * cc.block_bytes_fp32 * slack)
    # every storage class (full, quantized, each tail-slot size) holds at least one slab
    classes = 2 + (block // cc.tail_granule if 0 < cc.tail_granule < block else 0)
    need += classes * cc.managed_block_bytes
    sb = cc.superblock_bytes
    return max(sb, -(-need // sb) * sb)


# == profile ===============================================================================
def profile_section(model: TinyTransformer, prompt: list[int], block: int, steps: int) -> dict:
    """Where a fedkv fp32 decode step spends its time, and what the K/V gather would cost
    with index_select instead of advanced indexing (public pool APIs only)."""
    cfg = model.cfg
    pool = _pool_bytes_for(cfg, block, len(prompt) + steps + 2 * block)
    kv = KVCache(cfg.cache_config(block_size=block, pool_bytes=pool))
    sid = kv.open_session()
    logits = model.prefill(prompt, kv, sid)
    pr = cProfile.Profile()
    pr.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward_cached([int(logits.argmax())], kv, sid)[-1]
    total = time.perf_counter() - t0
    pr.disable()
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append((tt, ct, f"{os.path.basename(fn)}:{line}({name})"))
    rows.sort(reverse=True)
    top = [{"function": r[2], "tottime_share": r[0] / total, "cumtime_share": r[1] / total}
           for r in rows[:8]]
    read_ct = sum(r[1] for r in rows if r[2].endswith("(read)") and "engine" in r[2])
    write_ct = sum(r[1] for r in rows if r[2].endswith("(write)") and "engine" in r[2])

    def timeit(f, n=50):
        f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e6

    # the engine's gather: advanced indexing of the strided arena view; vs index_select
    view = kv.pool.view("fp32", torch.float32)  # [slabs, slots, slot floats]
    H, D = cfg.n_heads, cfg.head_dim
    E = 2 * H * block * D
    locs = [kv.pool.location(h) for h in kv.pool.blocks]
    slabs = torch.tensor([s for _, s, _ in locs])
    idxs = torch.tensor([i for _, _, i in locs])
    layer0 = view[:, :, :E]
    micro = {
        "engine_read_us": timeit(lambda: kv.read(sid, 0)),
        "advanced_index_gather_us": timeit(lambda: layer0[slabs, idxs]),
    }
    spp = view.shape[1]
    if view.stride(0) == spp * view.stride(1):
        flat = layer0.flatten(0, 1)
        lin = slabs * spp + idxs
        micro["index_select_gather_us"] = timeit(lambda: flat.index_select(0, lin))
    g = layer0[slabs, idxs].view(-1, 2, H, block, D)
    micro["transpose_reshape_us"] = timeit(
        lambda: g[:, 0].transpose(0, 1).reshape(H, -1, D))
    n = len(prompt) + steps
    kc, kn = torch.randn(1, H, n, D), torch.randn(1, H, 1, D)
    micro["hf_style_cat_k_and_v_us"] = timeit(
        lambda: (torch.cat((kc, kn), -2), torch.cat((kc, kn), -2)))
    q = torch.randn(H, 1, D)
    kk = torch.randn(H, n, D)
    micro["sdpa_one_query_us"] = timeit(lambda: F.scaled_dot_product_attention(q, kk, kk))
    return {
        "context": len(prompt),
        "steps": steps,
        "step_ms": total / steps * 1e3,
        "share_in_KVCache_read": read_ct / total,
        "share_in_KVCache_write": write_ct / total,
        "top_functions": top,
        "micro_per_layer": micro,
        "n_blocks_gathered_per_read": len(locs),
    }


# == quality ===============================================================================
@torch.no_grad()
def quality_section(model: TinyTransformer, heldout: bytes, plan: Plan, block: int,
                    seed: int) -> dict:
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed + 7)
    seqs = random_windows(heldout, plan.quality_len, plan.quality_seqs, g).tolist()
    fp_window = cfg.cache_config(block_size=block).fp_window
    first_quant = fp_window + block  # first position whose read includes a quantized block
    # room for every sequence: no eviction, so no quantization is skipped for lack of space
    # (the engine skips quantizing a block when the pool is full of evictable cached blocks)
    pool = _pool_bytes_for(cfg, block, plan.quality_seqs * (plan.quality_len + 2 * block))
    expected_q = plan.quality_seqs * max(0, (plan.quality_len - fp_window) // block)
    res: dict[str, dict] = {}
    for dtype in ("fp32", "int8", "int4"):
        kv = KVCache(cfg.cache_config(block_size=block, kv_dtype=dtype, pool_bytes=pool))
        ce, top, t0 = [], [], time.perf_counter()
        for seq in seqs:
            sid = kv.open_session()
            for t in range(plan.quality_len):
                logits = model.forward_cached([seq[t]], kv, sid)[-1]
                ce.append(float(F.cross_entropy(logits[None], torch.tensor([seq[t + 1]]))))
                top.append(int(logits.argmax()))
            kv.close_session(sid)
        st = kv.stats()
        res[dtype] = {
            "ce": ce, "top": top, "seconds": time.perf_counter() - t0,
            "quantized_blocks": st["quantized_blocks"],
            "kept_full_precision_blocks": st["rematerialised_blocks"],
            "mean_quant_error": st["mean_quant_error"],
        }
    targets = [s[t + 1] for s in seqs for t in range(plan.quality_len)]
    pos = [t for _ in seqs for t in range(plan.quality_len)]
    base = res["fp32"]
    base_ce = sum(base["ce"]) / len(base["ce"])
    out = {
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
    }
    for dtype in ("int8", "int4"):
        r = res[dtype]
        mce = sum(r["ce"]) / len(r["ce"])
        agree = [a == b for a, b in zip(r["top"], base["top"])]
        agree_q = [a for a, p in zip(agree, pos) if p >= first_quant]
        out[dtype] = {
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
    return out


# == prefix sharing ========================================================================
def prefix_section(model: TinyTransformer, prefix: list[int], plan: Plan, block: int,
                   seed: int) -> dict:
    cfg = model.cfg
    rng = random.Random(seed + 11)
    tails = [[rng.randrange(256) for _ in range(rng.randint(plan.tail_min, plan.tail_max))]
             for _ in range(plan.prefix_sessions)]
    tokens = len(prefix) + sum(len(t) for t in tails) + block * (len(tails) + 2)
    pool = _pool_bytes_for(cfg, block, tokens, slack=1.2)
    kv = KVCache(cfg.cache_config(block_size=block, pool_bytes=pool))
    t0 = time.perf_counter()
    root = kv.open_session()
    model.prefill(prefix, kv, root)
    for tail in tails:
        sid = kv.open_session()
        model.prefill(prefix + tail, kv, sid)
    secs = time.perf_counter() - t0
    st = kv.stats()
    bpt = kv.bytes_per_token("fp32")
    slot = kv.pool.classes["fp32"].slot_bytes
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


# == pool utilisation ======================================================================
def pool_section(cfg: ModelConfig, plan: Plan, block: int, seed: int,
                 kv_dtype: str = "fp32") -> dict:
    rng = random.Random(seed + 23)
    lengths = [max(1, min(plan.pool_max_len, int(rng.lognormvariate(
        math.log(plan.pool_median_len), plan.pool_sigma)))) for _ in range(plan.pool_sessions)]
    peak_tokens = sum(sorted(lengths)[-plan.pool_live:]) + plan.pool_live * block
    pool = _pool_bytes_for(cfg, block, peak_tokens, slack=1.3)
    kv = KVCache(cfg.cache_config(block_size=block, kv_dtype=kv_dtype, pool_bytes=pool))
    H, D, L = cfg.n_heads, cfg.head_dim, cfg.n_layers
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(H, 64 + plan.pool_max_len, D, generator=g)
    bpt = kv.bytes_per_token(kv.fresh)
    fresh_slot = kv.pool.classes[kv.fresh].slot_bytes
    live: dict[int, int] = {}  # sid -> target length
    opened, samples, live_samples, events = 0, [], [], 0

    def feed(sid: int, n: int) -> None:
        kv.reserve(sid, [rng.randrange(256) for _ in range(n)])
        off = rng.randrange(64)
        for layer in range(L):
            kv.write(sid, layer, noise[:, off:off + n], noise[:, off + 1:off + 1 + n])

    def live_util() -> float:
        """Token bytes of open sessions over slot bytes of the blocks they reference (fp32
        storage only: with quantized blocks the slot class of each block is not public)."""
        if kv_dtype != "fp32":
            return float("nan")
        st = kv.stats()
        toks = sum(kv.length(s) for s in live)
        blocks_live = st["blocks_referenced"]
        return toks * bpt / (blocks_live * fresh_slot) if blocks_live else 0.0

    t0 = time.perf_counter()
    while opened < len(lengths) or live:
        while len(live) < plan.pool_live and opened < len(lengths):
            sid = kv.open_session()
            target = lengths[opened]
            opened += 1
            live[sid] = target
            feed(sid, max(1, int(target * rng.uniform(0.3, 0.9))))  # the prompt
        if opened >= len(lengths):
            break  # snapshot with the last wave still open
        sid = rng.choice(list(live))
        have = kv.length(sid)
        if have >= live[sid]:
            kv.close_session(sid)
            del live[sid]
        else:
            feed(sid, min(live[sid] - have, rng.randint(1, 16)))
        events += 1
        if events % 10 == 0:
            samples.append(kv.stats()["kv_utilisation"])
            live_samples.append(live_util())
    st = kv.stats()
    final_live = live_util()
    return {
        "kv_dtype": kv_dtype,
        "block_size": block,
        "sessions": len(lengths),
        "max_open_sessions": plan.pool_live,
        "length_distribution": (
            f"lognormal(median={plan.pool_median_len:g}, sigma={plan.pool_sigma}) clipped to "
            f"[1, {plan.pool_max_len}]; mean {sum(lengths) / len(lengths):.1f} tokens"),
        "kv_utilisation": st["kv_utilisation"],
        "kv_utilisation_mean_during_replay": (
            sum(samples) / len(samples) if samples else float("nan")),
        "live_utilisation": final_live,
        "live_utilisation_mean_during_replay": (
            sum(live_samples) / len(live_samples) if live_samples else float("nan")),
        "slab_slot_fill": st["pool_slot_fill"],
        "kv_utilisation_of_slab_bytes": st["kv_utilisation"] * st["pool_slot_fill"],
        "bytes_allocated": st["bytes_allocated"],
        "bytes_holding_tokens": st["bytes_holding_tokens"],
        "blocks_cached_unreferenced": st["blocks_cached_unreferenced"],
        "evictions": st["evictions"],
        "events": events,
        "seconds": time.perf_counter() - t0,
    }


# == main ==================================================================================
NOTES = {
    "bytes_per_token": "KVCache.bytes_per_token(dtype): format bytes of a full block (codes + "
    "fp16 scales + packed int4 zero points), all layers, K and V, divided by block_size. "
    "slot_bytes_per_token: the pool slot (rounded up to whole 4 KB pages) per token. "
    "arena_bytes_per_token: managed block (slab) bytes / slots per slab / block_size, i.e. "
    "what a block really costs in the arena once the slab's unusable tail is counted.",
    "decode": "median tokens/s of greedy decode steps after an untimed prefill of `context` "
    "tokens of held-out text; variants interleaved (rotated order) across repeats; same torch "
    "thread count for all. no_cache recomputes the full sequence each step (fewer steps).",
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
}


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


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    plan = make_plan(args)
    block = args.block_size
    if block < 1:
        raise SystemExit("--block-size must be >= 1")
    if plan.context + plan.decode_steps + 8 > plan.model.context_len:
        raise SystemExit(f"--context {plan.context} too long for the model")
    torch.manual_seed(args.seed)
    warnings.filterwarnings("ignore", category=FutureWarning)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    log(f"fedkv bench_kv ({mode}): model {asdict(plan.model)}, block {block}, "
        f"context {plan.context}, threads {args.threads}")

    # -- checkpoint (trained once, then cached) ---------------------------------------------
    torch.set_num_threads(args.train_threads or args.threads)
    t = time.perf_counter()
    model, info = pretrained_tiny(
        plan.model, args.cache_dir, plan.train_steps, batch_size=plan.train_batch,
        seq_len=plan.train_seq, seed=args.seed, return_info=True, log=log,
        max_bytes=2_000_000 if args.tiny else None)
    ckpt_s = time.perf_counter() - t
    log(f"checkpoint {'loaded' if info['cached'] else 'trained'} in {ckpt_s:.1f}s "
        f"(held-out {info['heldout_loss']:.3f} nats/byte)")
    torch.set_num_threads(args.threads)
    model.eval()
    split = split_corpus(1, seed=args.seed, max_bytes=2_000_000 if args.tiny else None)
    heldout = split.heldout
    g = torch.Generator().manual_seed(args.seed + 3)
    prompt = random_windows(heldout, plan.context - 1, 1, g)[0].tolist()  # context tokens

    result: dict = {"mode": mode, "block_size": block}
    # -- bytes -------------------------------------------------------------------------------
    b = bytes_section(plan.model, block)
    result.update(b)
    result["by_block_size"] = {str(bs): bytes_section(plan.model, bs) for bs in (16, 32)}
    log(f"bytes/token (block {block}): " + ", ".join(
        f"{k} {v:.0f}" for k, v in b["bytes_per_token"].items())
        + f"; int8 {b['int8_vs_fp16']:.3f}x, int4 {b['int4_vs_fp16']:.3f}x fp16")
    log(f"  page-rounded slots: int8 {b['slot_int8_vs_fp16']:.3f}x, int4 "
        f"{b['slot_int4_vs_fp16']:.3f}x; in the arena (slab tails counted): int8 "
        f"{b['arena_int8_vs_fp16']:.3f}x, int4 {b['arena_int4_vs_fp16']:.3f}x fp16")
    bb = result["by_block_size"]["16"]
    log(f"  block 16: int8 {bb['int8_vs_fp16']:.3f}x, int4 {bb['int4_vs_fp16']:.3f}x fp16 "
        f"(arena {bb['arena_int8_vs_fp16']:.3f}x, {bb['arena_int4_vs_fp16']:.3f}x)")

    # -- decode ------------------------------------------------------------------------------
    t = time.perf_counter()
    d = decode_section(model, plan, prompt, block)
    result.update(d)
    med = d["decode_tokens_per_s"]
    log("decode tokens/s at %d context (median of %d): %s" % (plan.context, plan.repeats,
        ", ".join(f"{k} {v:.1f}" for k, v in med.items())))
    log(f"  fedkv_fp32 / hf = {d['fedkv_fp32_vs_hf']:.2f}x, / no_cache = "
        f"{d['fedkv_fp32_vs_no_cache']:.1f}x, / naive_concat = "
        f"{d['fedkv_fp32_vs_naive_concat']:.2f}x  ({time.perf_counter() - t:.1f}s)")

    if not args.no_profile:
        p = profile_section(model, prompt, block, 8 if args.tiny else 32)
        result["profile"] = p
        log(f"profile: fedkv fp32 step {p['step_ms']:.2f} ms, {p['share_in_KVCache_read']:.0%} "
            f"in KVCache.read; per layer: " + ", ".join(
                f"{k} {v:.0f}" for k, v in p["micro_per_layer"].items()))

    # -- quality -----------------------------------------------------------------------------
    t = time.perf_counter()
    q = quality_section(model, heldout, plan, block, args.seed)
    result["quality"] = q
    for dt in ("int8", "int4"):
        log(f"quality {dt}: top1 agreement {q[dt]['top1_agreement']:.4f}, ppl "
            f"{q[dt]['ppl']:.4f} vs fp32 {q['fp32']['ppl']:.4f} (delta {q[dt]['ppl_delta']:+.4f})"
            f", {q[dt]['quantized_blocks']} blocks quantized, "
            f"{q[dt]['kept_full_precision_blocks']} kept fp")
    log(f"  ({q['tokens']} tokens, {time.perf_counter() - t:.1f}s)")

    # -- prefix sharing ----------------------------------------------------------------------
    prefix = prompt[: plan.context]
    ps = prefix_section(model, prefix, plan, block, args.seed)
    result["prefix_sharing"] = ps
    other = 16 if block != 16 else 32
    po = prefix_section(model, prefix, plan, other, args.seed)
    result["prefix_sharing_other_block_size"] = {str(other): {k: po[k] for k in (
        "bytes_shared", "bytes_ideal", "ratio", "ratio_vs_block_granular_ideal")}}
    log(f"prefix sharing: {ps['sessions']} sessions x {ps['prefix_tokens']}-token prefix: "
        f"{ps['bytes_shared'] / 2**20:.1f} MiB held vs ideal {ps['bytes_ideal'] / 2**20:.1f} MiB "
        f"(ratio {ps['ratio']:.3f}; vs block-granular ideal "
        f"{ps['ratio_vs_block_granular_ideal']:.3f}), unshared {ps['bytes_unshared'] / 2**20:.1f}"
        f" MiB ({ps['seconds']:.1f}s); block {other}: ratio {po['ratio']:.3f}")

    # -- pool utilisation --------------------------------------------------------------------
    pu = pool_section(plan.model, plan, block, args.seed)
    result["pool_utilisation"] = pu["kv_utilisation"]
    result["pool_utilisation_live_sessions"] = pu["live_utilisation"]
    result["pool"] = pu
    extra = {}
    for bs, dt in ((16, "fp32"), (block, "int8")):
        if (bs, dt) != (block, "fp32"):
            e = pool_section(plan.model, plan, bs, args.seed, dt)
            extra[f"block{bs}_{dt}"] = {k: e[k] for k in (
                "kv_utilisation", "kv_utilisation_mean_during_replay", "live_utilisation",
                "live_utilisation_mean_during_replay", "slab_slot_fill",
                "kv_utilisation_of_slab_bytes") if math.isfinite(e[k])}
    result["pool_other_configs"] = extra
    log(f"pool utilisation: {pu['kv_utilisation']:.4f} (live sessions only "
        f"{pu['live_utilisation']:.4f}; mean during replay {pu['kv_utilisation_mean_during_replay']:.4f})"
        + "".join(f"; {k}: {v['kv_utilisation']:.4f}" for k, v in extra.items()))

    # -- summary -----------------------------------------------------------------------------
    checks = {
        "int4_vs_fp16 <= 0.28": b["int4_vs_fp16"] <= 0.28,
        "int8_vs_fp16 <= 0.53": b["int8_vs_fp16"] <= 0.53,
        "int8 top1_agreement >= 0.999": q["int8"]["top1_agreement"] >= 0.999,
        "int8 ppl_delta <= 0.02": q["int8"]["ppl_delta"] <= 0.02,
        "int4 top1_agreement >= 0.99": q["int4"]["top1_agreement"] >= 0.99,
        "int4 ppl_delta <= 0.1": q["int4"]["ppl_delta"] <= 0.1,
        "fedkv_fp32 >= hf_dynamic_cache": d["fedkv_fp32_vs_hf"] >= 1.0,
        "fedkv_fp32 >= 10x no_cache": d["fedkv_fp32_vs_no_cache"] >= 10.0,
        "prefix ratio <= 1.05": ps["ratio"] <= 1.05,
        "pool_utilisation >= 0.96": pu["kv_utilisation"] >= 0.96,
        "pool_utilisation_live_sessions >= 0.96": pu["live_utilisation"] >= 0.96,
    }
    assert set(checks) == set(TARGETS)
    result["targets_met"] = checks
    result["config"] = {
        "model": asdict(plan.model), "context": plan.context, "decode_steps": plan.decode_steps,
        "no_cache_steps": plan.no_cache_steps, "repeats": plan.repeats,
        "torch_threads": args.threads, "seed": args.seed, "hf_model": "GPT2LMHeadModel, random "
        "init, same dims, sdpa attention, DynamicCache",
        "torch": torch.__version__, "python": sys.version.split()[0],
    }
    result["checkpoint"] = {k: info.get(k) for k in (
        "cached", "path", "steps", "batch_size", "seq_len", "lr", "train_seconds",
        "first_loss", "final_loss", "heldout_loss", "heldout_ppl")}
    result["checkpoint"]["seconds_this_run"] = ckpt_s
    result["notes"] = NOTES
    result["load_average_start_end"] = [load0[0], os.getloadavg()[0]]
    result["elapsed_s"] = time.perf_counter() - t_start
    met = sum(checks.values())
    log(f"targets met: {met}/{len(checks)}; missed: "
        + (", ".join(k for k, v in checks.items() if not v) or "none"))
    log(f"elapsed {result['elapsed_s']:.1f}s")
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
