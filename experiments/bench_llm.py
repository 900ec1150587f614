"""Real-model benchmark: fedkv (``node.models.llama.LlamaModel`` over ``cache.KVCache``) side by side
with Hugging Face ``LlamaForCausalLM`` + ``DynamicCache`` on SmolLM2-135M-Instruct, same fp32
weights (both loaded from ``node.models.smollm2.default_dir()``), same torch thread count.

    python -m experiments.bench_llm --quick --json     # <= ~6 min on 2 cores; last line = JSON

Every figure is measured in this run; speeds are medians of interleaved segments (each
contender is prefilled once, untimed, then timed segments of greedy steps rotate over the
contenders, so load on the machine hits them alike) and every target is a ratio of two
contenders measured side by side. The JSON: the five sections below in their interface
shape, ``details`` (ratios, samples, checks, seconds per section), ``targets`` (each with
PASS/MISS, also printed), ``notes`` (how each section measures) and ``config``.

* ``decode_tokens_per_s`` -- greedy decode after a 512- / 2,048-token prompt of real text
  (standard-library source tokenized by the model's tokenizer). HF is called step by step
  with its ``DynamicCache`` (``cache=``, formerly ``past_key_values``), the same loop fedkv
  runs, not ``generate``. Each prompt is prefilled once, by fedkv fp32; the int8/int4 caches
  get copies of its K/V through their public write path (quantized on commit, as a prefill
  stores them) and, under ``--quick``, HF's DynamicCache is filled with them too (HF's own
  prefill otherwise; the tests check both equal real prefills). Prefills are untimed.
* ``batched`` -- 16 sessions sharing a 512-token system prompt, each with its own 32-token
  question: fedkv batched (the prefix prefilled once, later sessions reuse it through the
  prefix cache; then ``forward_batch`` steps), fedkv one session at a time (``forward_cached``
  per session, round-robin), HF batched (left padding + attention mask). KV bytes: fedkv
  ``stats()['bytes_allocated']`` plus the batch tail buffer; HF the DynamicCache tensors.
* ``ttft_s`` -- prefill + first token of a new session whose 1,024-token system prompt is
  cached: recompute (empty cache), hot (blocks in the arena), warm (``offload('warm')``),
  cold (``flush`` to a directory, a fresh ``KVCache.open`` on it; open time reported apart).
* ``active_capacity_tokens`` -- tokens that fit in open sessions at equal ``pool_bytes``.
* ``quality`` -- held-out text teacher-forced through the cache in chunks of one block (each
  chunk reads earlier chunks' K/V back in the cache's storage dtype), fp16/int8/int4 vs fp32.

``--weight-dtypes bfloat16,int8`` (default) also runs fedkv's model in those weight formats
(``node.models.precision``; ``experiments.llm_dtypes``): ``decode_tokens_per_s.<ctx>.fedkv_bf16`` and
``.fedkv_int8_weights`` in the same interleaved segments as fp32 (each prefilled by its own
model into its own cache, in the K/V format its server stores: bf16 for both), ``ratio_vs_fp32``;
``quality.bf16`` and ``quality.int8_weights`` (Δppl, top-1 vs fp32 weights in an fp32 cache,
each format through its own cache); in ``details``: prefill
ms of the prompt per format (interleaved), the read bandwidth of a buffer the size of each
format's weights (the fastest of torch's sum and the kernels' prefetched stream, on ordinary and
huge pages: ``read_bandwidth_by_reader_gbs``), then that reader's bandwidth again in every
decode segment's rotation (``<ctx>.read_bandwidth_gbs``: medians of reads timed beside the
decode segments, as this machine's bandwidth drifts within a run; each rotation's in
``read_bandwidth_samples_gbs``) and each format's fraction of its ceiling (decode tokens/s x
weight bytes per step / that bandwidth), the same counting the K/V of the context a step reads
besides (``step_bytes_fraction``), and the median of each rotation's fraction, its decode
segment over its own probe (``bandwidth_ceiling_fraction_paired``: where the bandwidth moves
between rotations, the median rate and the median bandwidth may come from different ones).
``config.kernels`` says whether the bf16/int8 forwards ran on the fused CPU kernels
(``node.models.kernels``; ``FEDKV_KERNELS=eager`` runs them on the eager ops instead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from cache import KVCache
from experiments.kv_capacity import active_capacity_tokens
from experiments.llm_contenders import (FedkvSessions, bytes_per_token, copy_session,
                                        fedkv_cache, hf_sessions, interleave, prefilled)
from experiments.output import make_run_dir, markdown_table, plot_lines, write_csv, write_json
from experiments import llm_dtypes
from node.models import kernels
from node.models.llama import LlamaModel
from node.models.precision import weight_bytes_per_token

DECODE = ("fedkv_fp32", "fedkv_int8", "fedkv_int4", "hf_dynamic_cache")
BATCHED = ("fedkv_batched", "fedkv_sequential", "hf_batched")
TTFT = ("recompute", "hot", "warm", "cold")
CAPACITY = ("fp32", "fp16", "int8", "int4")
QUALITY = ("fp16", "int8", "int4")
DTYPES = ("fp32", "int8", "int4")
PROMPT_FILES = ("argparse.py", "difflib.py", "inspect.py")
HELDOUT_FILES = ("textwrap.py", "heapq.py", "bisect.py", "calendar.py")
NOTES = {
    "decode_tokens_per_s": "greedy steps after a prompt of stdlib source; prefilled once by "
    "fedkv fp32, int8/int4 caches get its K/V through KVCache.write (quickly: HF's "
    "DynamicCache too); HF called step by step with its DynamicCache; medians of "
    "interleaved segments",
    "batched": "16 sessions, shared system prompt + own question; fedkv batched = prefix "
    "cache + forward_batch, sequential = forward_cached per session, HF = left-padded batch; "
    "KV bytes: stats() bytes_allocated + batch tail buffer vs DynamicCache tensors",
    "ttft_s": "prefill + first token of a new session, median over questions; hot = blocks in "
    "the arena, warm = offload('warm'), cold = flushed directory reopened by KVCache.open "
    "(open time apart: details.ttft_s.cold_open_s), recompute = empty cache",
    "active_capacity_tokens": "tokens open, still-decodable sessions hold at equal pool_bytes "
    "(experiments.kv_capacity), prompts fed in chunks as the scheduler's chunked prefill does "
    "(details.active_capacity_tokens.one_shot: each prompt in one call)",
    "quality": "held-out stdlib source teacher-forced through the cache one block per "
    "forward_cached call, so earlier blocks are read back in storage precision; vs fp32",
}


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (defaults: the full run; ``QUICK`` below)."""

    contexts: tuple[int, ...] = (512, 2048)
    decode_steps: int = 16
    """Greedy steps per timed segment."""
    repeats: int = 5
    """Timed segments per contender (the median is reported)."""
    batch_sessions: int = 16
    batch_prefix: int = 512
    batch_question: int = 32
    batch_steps: int = 64
    """New tokens per session, split into ``repeats`` interleaved segments."""
    ttft_prefix: int = 1024
    ttft_question: int = 32
    capacity_pool_bytes: int = 64 << 20
    capacity_session_tokens: int = 512
    capacity_chunk_tokens: int = 64
    quality_len: int = 512
    quality_windows: int = 4
    block_size: int = 16
    hf_prefill: bool = True
    """HF prefills with its own forward; False: its DynamicCache is filled with fedkv's fp32
    K/V of the same prompts (equal up to float rounding; untimed either way)."""


QUICK = Plan(decode_steps=8, repeats=3, batch_steps=12, quality_windows=1, hf_prefill=False)


def log(msg: str) -> None:
    print(msg, file=sys.stderr if _QUIET else sys.stdout, flush=True)


_QUIET = False


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# == text =================================================================================
def stdlib_tokens(encode: Callable[[str], list[int]], files: tuple[str, ...],
                  max_chars: int = 40_000) -> list[int]:
    """Real text: the standard library's own source files, tokenized (no download)."""
    root = Path(os.__file__).parent
    return [t for f in files for t in encode((root / f).read_text()[:max_chars])]


def _windows(text: list[int], n: int, length: int, start: int) -> list[list[int]]:
    """``n`` disjoint windows of ``length`` tokens from ``text[start:]``."""
    out = [text[start + i * length: start + (i + 1) * length] for i in range(n)]
    if len(out[-1]) != length:
        raise ValueError(f"text too short: {n} windows of {length} tokens after {start}")
    return out


# == decode ===============================================================================
def decode_section(model: LlamaModel, hf: Any, text: list[int], plan: Plan,
                   variants: dict[str, LlamaModel] | None = None) -> tuple[dict, dict]:
    """Greedy decode tokens/s at each context, fedkv fp32/int8/int4 vs HF DynamicCache, and
    fedkv's weight-format ``variants`` (``experiments.llm_dtypes``) in the same rotation."""
    variants = variants or {}
    out: dict[str, Any] = {}
    gbs, by_reader = llm_dtypes.read_bandwidths({"fedkv_fp32": model, **variants})
    info: dict[str, Any] = {"read_bandwidth_gbs": gbs, "read_bandwidth_by_reader_gbs": by_reader}
    extra = plan.decode_steps * plan.repeats + 2
    for ctx in plan.contexts:
        prompt = text[:ctx]
        if len(prompt) != ctx:
            raise ValueError(f"prompt text has {len(text)} tokens, fewer than {ctx}")
        t0 = time.perf_counter()
        caches, logits = prefilled(model, [prompt], extra, plan.block_size, DTYPES)
        st: dict[str, Any] = {f"fedkv_{d}": FedkvSessions(model, kv, sids, logits)
                              for d, (kv, sids) in zip(DTYPES, caches)}
        st["hf_dynamic_cache"] = hf_sessions(hf, [prompt], plan.hf_prefill, *caches[0], logits)
        st.update(llm_dtypes.variant_sessions(variants, prompt, extra, plan.block_size))
        probes = llm_dtypes.read_probes({"fedkv_fp32": model, **variants}, by_reader) \
            if variants else {}
        log(f"decode {ctx}: prefills {time.perf_counter() - t0:.1f}s")
        samples = interleave({**st, **probes}, plan.repeats, plan.decode_steps,
                             f"decode {ctx}", log)
        probed = llm_dtypes.probed_bandwidths(samples, probes)
        del probes
        med = {k: _median(v) for k, v in samples.items()}
        a, b = st["fedkv_fp32"].tokens, st["hf_dynamic_cache"].tokens
        out[str(ctx)] = {**med,
                         "ratio_vs_hf": {k: _ratio(med[k], med["hf_dynamic_cache"])
                                         for k in DECODE[:3]}}
        info[str(ctx)] = {"samples": samples, "greedy_tokens_agree_fp32_vs_hf":
                          sum(x == y for x, y in zip(a, b)) / len(a)}
        if variants:
            out[str(ctx)]["ratio_vs_fp32"] = {k: _ratio(med[k], med["fedkv_fp32"])
                                              for k in variants}
            gbs_med = {k: _median(v) for k, v in probed.items()}
            info[str(ctx)].update(_variant_details(model, variants, prompt, med, plan, gbs_med))
            info[str(ctx)]["read_bandwidth_gbs"] = gbs_med
            info[str(ctx)]["read_bandwidth_samples_gbs"] = probed
            info[str(ctx)]["bandwidth_ceiling_fraction_paired"] = {
                k: llm_dtypes.paired_ceiling_fraction(samples[k], m, probed[k])
                for k, m in {"fedkv_fp32": model, **variants}.items()}
        del st
    return out, info


def _variant_details(model: LlamaModel, variants: dict[str, LlamaModel], prompt: list[int],
                     med: dict[str, float], plan: Plan, gbs: dict[str, float]) -> dict[str, Any]:
    """Prefill ms of the prompt (interleaved, medians) and each format's fraction of the
    memory-bandwidth ceiling at its measured decode rate: of the weight bytes a step reads
    (``bandwidth_ceiling_fraction``), and of those plus the K/V of its context at the timed
    steps' mean length (``step_bytes_fraction``)."""
    models = {"fedkv_fp32": model, **variants}
    pre = llm_dtypes.prefill_ms(models, prompt, plan.repeats, plan.block_size)
    log("  prefill ms: " + ", ".join(f"{k} {_median(v):.0f}" for k, v in pre.items()))
    context = len(prompt) + plan.decode_steps * plan.repeats / 2
    return {"prefill_ms": {k: _median(v) for k, v in pre.items()}, "prefill_ms_samples": pre,
            "bandwidth_ceiling_fraction": {k: llm_dtypes.ceiling_fraction(med[k], m, gbs[k])
                                           for k, m in models.items()},
            "step_bytes_fraction": {k: llm_dtypes.step_bytes_fraction(med[k], m, gbs[k], context)
                                    for k, m in models.items()}}


# == batched ==============================================================================
def batched_section(model: LlamaModel, hf: Any, text: list[int],
                    plan: Plan) -> tuple[dict, dict]:
    prefix = text[: plan.batch_prefix]
    qs = _windows(text, plan.batch_sessions, plan.batch_question, plan.batch_prefix)
    prompts = [prefix + q for q in qs]
    per_seg = max(1, plan.batch_steps // plan.repeats)
    t0 = time.perf_counter()
    caches, logits = prefilled(model, prompts, plan.batch_steps, plan.block_size,
                               ("fp32", "fp32"))
    reused = caches[0][0].stats()["prefix_hit_tokens"]
    st: dict[str, Any] = {"fedkv_batched": FedkvSessions(model, *caches[0], logits, True),
                          "fedkv_sequential": FedkvSessions(model, *caches[1], logits)}
    t1 = time.perf_counter()
    st["hf_batched"] = hf_sessions(hf, prompts, plan.hf_prefill, *caches[0], logits)
    prefill_s = {"fedkv": t1 - t0, "hf": time.perf_counter() - t1}
    log("batched prefill s: " + ", ".join(f"{k} {v:.1f}" for k, v in prefill_s.items()))
    samples = interleave(st, plan.repeats, per_seg, "batched", log)
    med = {k: _median(v) for k, v in samples.items()}
    kvb = {k: st[k].kv_bytes() for k in BATCHED}
    return {**med, "kv_bytes": kvb}, {
            "ratio_vs_hf": _ratio(med["fedkv_batched"], med["hf_batched"]),
            "ratio_vs_sequential": _ratio(med["fedkv_batched"], med["fedkv_sequential"]),
            "kv_bytes_ratio_vs_hf": _ratio(kvb["fedkv_batched"], kvb["hf_batched"]),
            "prefix_reused_tokens": reused, "prefill_s": prefill_s,
            "sessions": plan.batch_sessions, "new_tokens": 1 + per_seg * plan.repeats,
            "samples": samples}


# == time to first token ==================================================================
def _first_token(model: LlamaModel, kv: KVCache, prompt: list[int]) -> tuple[float, int, dict]:
    """Seconds to prefill ``prompt`` into a new session and pick its first token; the session
    is closed after. Also the prefix-hit blocks per tier of this prefill."""
    kv.reset_stats()
    sid = kv.open_session()
    t0 = time.perf_counter()
    tok = int(model.prefill(prompt, kv, sid).argmax())
    dt = time.perf_counter() - t0
    kv.close_session(sid)
    return dt, tok, dict(kv.stats()["tier_hits"])


def _holding(kv: KVCache, src: KVCache, sid: int) -> KVCache:
    """``kv`` with ``src``'s session copied in and closed: its blocks stay cached."""
    kv.close_session(copy_session(src, sid, kv))
    return kv


def _ttft_runners(model: LlamaModel, system: list[int], plan: Plan, workdir: str,
                  open_s: list[float]) -> dict[str, Callable[[list[int]], tuple]]:
    """One ``prompt -> (seconds, first token, tier hits)`` per variant; the system prompt is
    prefilled once (into the hot cache) and copied into the warm and cold ones."""
    room = plan.ttft_prefix + plan.repeats * (plan.ttft_question + 2 * plan.block_size)
    fresh = lambda **kw: fedkv_cache(model, room, block=plan.block_size, **kw)  # noqa: E731
    hot = fresh()
    sid = hot.open_session()
    model.prefill(system, hot, sid)
    warm = _holding(fresh(warm_bytes=2 * room * bytes_per_token(model)), hot, sid)
    cold_dir, cold_cfg = os.path.join(workdir, "cold"), fresh().config
    _holding(KVCache.open(cold_dir, cold_cfg), hot, sid).close()  # flushed to disk
    hot.close_session(sid)

    def cold(prompt: list[int]) -> tuple:
        t0 = time.perf_counter()
        kv = KVCache.open(cold_dir, cold_cfg)  # a fresh cache object on the flushed directory
        open_s.append(time.perf_counter() - t0)
        try:
            return _first_token(model, kv, prompt)
        finally:
            kv.release()  # the directory stays as flushed: every repeat restores from disk

    def warm_run(prompt: list[int]) -> tuple:
        warm.offload("warm")  # every cached block (the last repeat's too) leaves hot
        return _first_token(model, warm, prompt)

    return {"recompute": lambda p: _first_token(model, fresh(), p),
            "hot": lambda p: _first_token(model, hot, p), "warm": warm_run, "cold": cold}


def ttft_section(model: LlamaModel, text: list[int], plan: Plan,
                 workdir: str) -> tuple[dict, dict]:
    """TTFT of a new session whose system prompt is cached hot / warm / cold, or not at all;
    each repeat asks its own question, the variants in rotating order."""
    system = text[: plan.ttft_prefix]
    qs = _windows(text, plan.repeats, plan.ttft_question, plan.ttft_prefix)
    open_s: list[float] = []
    runs = _ttft_runners(model, system, plan, workdir, open_s)
    samples: dict[str, list[float]] = {k: [] for k in TTFT}
    firsts: dict[str, list[int]] = {k: [] for k in TTFT}
    hits: dict[str, dict] = {}
    for rep, q in enumerate(qs):
        for name in TTFT[rep % 4:] + TTFT[: rep % 4]:
            dt, tok, hits[name] = runs[name](system + q)
            samples[name].append(dt)
            firsts[name].append(tok)
        log(f"  ttft repeat {rep + 1}: " + ", ".join(f"{k} {samples[k][-1]:.3f}s" for k in TTFT))
    med = {k: _median(v) for k, v in samples.items()}
    return med, {"speedup_vs_recompute": {k: _ratio(med["recompute"], med[k]) for k in TTFT[1:]},
                 "prefix_hit_blocks_by_tier": hits, "cold_open_s": _median(open_s),
                 "same_first_tokens": all(v == firsts["recompute"] for v in firsts.values()),
                 "samples": samples}


# == active capacity ======================================================================
def capacity_section(model: LlamaModel, plan: Plan) -> tuple[dict, dict]:
    """Sessions prefilled in chunks of ``capacity_chunk_tokens`` (as the scheduler's chunked
    prefill feeds them); ``details.one_shot`` has each 512-token prompt in one
    ``forward_cached`` -- whose whole prompt must fit the full-precision arena first."""
    c = model.cfg

    def cap(d: str, chunk: int) -> int:
        return int(active_capacity_tokens(
            d, plan.capacity_pool_bytes, num_layers=c.num_layers, num_heads=c.num_kv_heads,
            head_dim=c.head_dim, block_size=plan.block_size,
            session_tokens=plan.capacity_session_tokens, chunk_tokens=chunk))
    toks = {d: cap(d, plan.capacity_chunk_tokens) for d in CAPACITY}
    one_shot = {d: cap(d, 0) for d in CAPACITY}
    log("active capacity tokens: " + ", ".join(f"{k} {v}" for k, v in toks.items()))
    return toks, {"ratio_vs_fp32": {d: _ratio(toks[d], toks["fp32"]) for d in CAPACITY},
                  "pool_bytes": plan.capacity_pool_bytes,
                  "chunk_tokens": plan.capacity_chunk_tokens, "one_shot": one_shot}


# == quality ==============================================================================
@torch.no_grad()
def _teacher_forced(model: LlamaModel, kv: KVCache, window: list[int],
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-probabilities [T - 1, vocab] of ``window``, fed ``chunk`` tokens per
    ``forward_cached`` call (later chunks read earlier ones back in storage precision)."""
    sid = kv.open_session()
    logits = torch.cat([model.forward_cached(window[i: i + chunk], kv, sid)
                        for i in range(0, len(window) - 1, chunk)])[: len(window) - 1]
    kv.close_session(sid)
    return F.log_softmax(logits.float(), -1), torch.tensor(window[1: len(logits) + 1])


def quality_section(model: LlamaModel, heldout: list[int], plan: Plan,
                    variants: dict[str, LlamaModel] | None = None) -> tuple[dict, dict]:
    wins = _windows(heldout, plan.quality_windows, plan.quality_len, 0)
    res = {}
    for dtype in ("fp32",) + QUALITY:
        kv = fedkv_cache(model, plan.quality_len, dtype, plan.block_size)
        lps, tgts = zip(*(_teacher_forced(model, kv, w, plan.block_size) for w in wins))
        lp, tgt = torch.cat(lps), torch.cat(tgts)
        res[dtype] = (lp, float(-lp.gather(1, tgt[:, None]).mean()), kv.stats()["quantized_blocks"])
    base_lp, base_nll, _ = res["fp32"]
    out: dict[str, Any] = {}
    info: dict[str, Any] = {"fp32_ppl": math.exp(base_nll), "tokens": int(base_lp.shape[0]),
                            "chunk_tokens": plan.block_size}
    for d in QUALITY:
        lp, nll, nq = res[d]
        out[d] = {"ppl_delta": math.exp(nll) - math.exp(base_nll),
                  "top1_agreement": float((lp.argmax(-1) == base_lp.argmax(-1)).float().mean())}
        info[d] = {"ppl": math.exp(nll), "quantized_blocks": nq}
    if variants:
        def score(m: LlamaModel) -> tuple[torch.Tensor, float]:
            kv = fedkv_cache(m, plan.quality_len, None, plan.block_size)
            lps, tgts = zip(*(_teacher_forced(m, kv, w, plan.block_size) for w in wins))
            lp, tgt = torch.cat(lps), torch.cat(tgts)
            return lp, float(-lp.gather(1, tgt[:, None]).mean())
        more, more_info = llm_dtypes.quality((base_lp, base_nll), variants, score)
        out.update(more)
        info.update(more_info, fp32_weight_bytes_per_token=weight_bytes_per_token(model))
    return out, info


# == targets, output, command line ========================================================
def target_checks(r: dict) -> list[tuple[str, float, str, bool]]:
    """(what, measured, target, met) of every target: figures, never test assertions."""
    d, b, bi = r["decode_tokens_per_s"], r["batched"], r["details"]["batched"]
    sp, cap, q = (r["details"]["ttft_s"]["speedup_vs_recompute"],
                  r["details"]["active_capacity_tokens"]["ratio_vs_fp32"], r["quality"])
    rows = [(f"decode {c}: fedkv fp32 / hf", d[c]["ratio_vs_hf"]["fedkv_fp32"], ">= 1.2", 1.2)
            for c in d]
    rows += [("batched: fedkv / hf tokens/s", bi["ratio_vs_hf"], ">= 4", 4.0),
             ("batched: hf / fedkv KV bytes", _ratio(b["kv_bytes"]["hf_batched"],
                                                     b["kv_bytes"]["fedkv_batched"]), ">= 4", 4.0)]
    rows += [(f"ttft {k}: speedup vs recompute", sp[k], f">= {t:g}", t)
             for k, t in (("hot", 20.0), ("warm", 10.0), ("cold", 5.0))]
    rows += [("capacity int8 / fp32", cap["int8"], ">= 1.8", 1.8),
             ("capacity int4 / fp32", cap["int4"], ">= 3", 3.0),
             ("quality int8 top-1", q["int8"]["top1_agreement"], ">= 0.99", 0.99),
             ("quality int4 top-1", q["int4"]["top1_agreement"], ">= 0.97", 0.97)]
    out = [(w, v, t, bool(v >= lim)) for w, v, t, lim in rows]
    return out + [(f"quality {k} ppl delta", q[k]["ppl_delta"], f"<= {lim:g}",
                   bool(q[k]["ppl_delta"] <= lim)) for k, lim in (("int8", 0.05), ("int4", 0.3))]


def run_all(model: LlamaModel, hf: Any, text: list[int], heldout: list[int], plan: Plan,
            threads: int, weight_dtypes: tuple[str, ...] = ()) -> dict:
    """Every section, in one process, same weights and thread count; fedkv's model also in
    each of ``weight_dtypes`` (``node.models.precision``) in the decode and quality sections."""
    torch.set_num_threads(threads)
    variants = llm_dtypes.variant_models(model, weight_dtypes)
    r: dict[str, Any] = {"details": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_llm_") as work:
        for key, fn in (("decode_tokens_per_s", lambda: decode_section(model, hf, text, plan, variants)),
                        ("batched", lambda: batched_section(model, hf, text, plan)),
                        ("ttft_s", lambda: ttft_section(model, text, plan, work)),
                        ("active_capacity_tokens", lambda: capacity_section(model, plan)),
                        ("quality", lambda: quality_section(model, heldout, plan, variants))):
            t = time.perf_counter()
            r[key], r["details"][key] = fn()
            r["details"][key]["seconds"] = time.perf_counter() - t
            log(f"{key}: {r['details'][key]['seconds']:.0f}s")
    r["notes"] = NOTES
    r["targets"] = {w: {"value": v, "target": t, "pass": ok} for w, v, t, ok in target_checks(r)}
    r["config"] = {"threads": threads, "plan": asdict(plan), "torch": torch.__version__,
                   "weight_dtypes": list(weight_dtypes), "kernels": kernels.status(),
                   "hf_decode": "model called step by step with its DynamicCache (not generate)",
                   "seconds": time.perf_counter() - t0}
    return r


def summary_lines(r: dict) -> list[str]:
    return [f"{'PASS' if t['pass'] else 'MISS'}  {w}: {t['value']:.4g} (target {t['target']})"
            for w, t in r["targets"].items()]


def flat_rows(r: dict) -> list[dict]:
    """Every figure of the shaped sections as (section, key, value) rows for the CSV."""
    rows: list[dict] = []

    def walk(section: str, prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(section, f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            rows.append({"section": section, "key": prefix, "value": float(obj)})

    for s in ("decode_tokens_per_s", "batched", "ttft_s", "active_capacity_tokens", "quality"):
        walk(s, "", r[s])
    return rows


def write_outputs(r: dict, out: str) -> Path:
    run_dir = make_run_dir(out, "bench_llm")
    write_json(run_dir / "result.json", r)
    write_csv(run_dir / "figures.csv", flat_rows(r), ("section", "key", "value"))
    rows = [{"target": w, "value": t["value"], "wanted": t["target"],
             "result": "PASS" if t["pass"] else "MISS"} for w, t in r["targets"].items()]
    (run_dir / "summary.md").write_text("# bench_llm\n\n" + markdown_table(rows))
    d = r["decode_tokens_per_s"]
    ctx = [int(c) for c in d]
    plot_lines(run_dir / "decode.png", {k: (ctx, [d[c][k] for c in d]) for k in DECODE},
               xlabel="prompt tokens", ylabel="decode tokens/s", logy=False,
               title=f"greedy decode, {r['config']['threads']} thread(s)")
    return run_dir


def load_real(model_dir: str | None) -> tuple[LlamaModel, Any, list[int], list[int]]:
    """fedkv's and HF's model from the same converted directory, and the real text."""
    from transformers import LlamaForCausalLM

    from node.models import smollm2 as models
    from node.models.chat import ChatCodec

    d = Path(model_dir).expanduser() if model_dir else models.default_dir()
    ours = LlamaModel.from_pretrained(d)
    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    enc = ChatCodec.from_dir(d).encode
    return ours, hf, stdlib_tokens(enc, PROMPT_FILES), stdlib_tokens(enc, HELDOUT_FILES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps (<= ~6 min)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object last (the progress lines go to stderr)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both (default 1)")
    p.add_argument("--weight-dtypes", default="bfloat16,int8",
                   help="fedkv weight formats measured beside fp32 (node.models.precision; "
                        "comma-separated, '' for none; default bfloat16,int8)")
    p.add_argument("--model-dir", default=None,
                   help="converted model directory (default: node.models.smollm2.default_dir())")
    p.add_argument("--out", default="results",
                   help="writes <out>/bench_llm/<timestamp>/ (default results)")
    return p


def main(argv: list[str] | None = None) -> int:
    global _QUIET
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    weights = tuple(d for d in args.weight_dtypes.split(",") if d)
    if not set(weights) <= set(llm_dtypes.KEYS):
        raise SystemExit(f"--weight-dtypes {args.weight_dtypes!r}: use some of "
                         f"{','.join(llm_dtypes.KEYS)}")
    _QUIET = args.json
    from node.models.smollm2 import ModelError

    try:
        ours, hf, text, heldout = load_real(args.model_dir)
    except (ModelError, FileNotFoundError) as e:
        print(f"bench_llm: the real model is missing or unreadable ({e}); run "
              f"`python -m node.models.smollm2 fetch` first", file=sys.stderr)
        return 2
    r = run_all(ours, hf, text, heldout, QUICK if args.quick else Plan(), args.threads, weights)
    for line in summary_lines(r):
        log(line)
    log(f"results: {write_outputs(r, args.out).resolve()}")
    if args.json:
        print(json.dumps(r, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
