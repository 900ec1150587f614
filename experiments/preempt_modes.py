"""Preemption by swap vs recompute (``node.engine.scheduler``): throughput under memory pressure and
the cost of one resume.

*Workload*: greedy requests whose K/V together need about twice the hot pool, run to
completion by a ``Scheduler`` in each mode: generated tokens/s, preemptions, and what resuming
took from the cache (hot or warm tier) vs recomputed. *Resume*: one context of ``--resume-len``
tokens brought back into a session, ``swap`` (its full blocks demoted to the warm tier, then
``match_prefix`` + the partial tail) vs ``recompute`` (every token through the model). Both
modes run in each repeat, in alternating order (drift on a shared machine hits both alike);
medians, and the ratio printed. Both modes must produce the same greedy tokens (checked).

    python -m experiments.preempt_modes --quick --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from cache import KVCache
from experiments.output import add_common_args, make_run_dir, markdown_table, print_results_dir, write_json
from node.engine.generation import GenerationRequest
from node.engine.scheduler import PREEMPT_MODES, Scheduler, SchedulerConfig
from node.tasks.tasks import lm_model


@dataclass(frozen=True)
class Setup:
    requests: int = 8
    prompt_min: int = 24
    prompt_max: int = 80
    max_tokens: int = 40
    """Prompt + max_tokens stays within the node LM's 128-token context."""
    pool_share: float = 0.5
    """Hot pool as a share of the blocks all requests need at once (< 1: they preempt)."""
    max_running: int = 8
    token_budget: int = 128
    resume_len: int = 120


def _cache(model, blocks: int, warm_bytes: int) -> KVCache:
    probe = model.cache_config()
    return KVCache(model.cache_config(pool_bytes=blocks * probe.block_bytes_fp32,
                                      warm_bytes=warm_bytes, tail_granule=0))


def _prompts(setup: Setup, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(setup.prompt_min, setup.prompt_max + 1, (setup.requests,), generator=g)
    return [tuple(torch.randint(0, 256, (int(n),), generator=g).tolist()) for n in lens]


def workload(model, mode: str, setup: Setup, prompts: list[tuple[int, ...]]) -> dict:
    """Every prompt through one scheduler in ``mode``; throughput and resume figures."""
    B = model.cache_config().block_size
    need = sum(-(-(len(p) + setup.max_tokens) // B) for p in prompts)
    longest = max(-(-(len(p) + setup.max_tokens) // B) for p in prompts) + 1
    kv = _cache(model, max(longest, int(need * setup.pool_share)), 64 << 20)
    s = Scheduler(model, kv, SchedulerConfig(max_running=setup.max_running,
                                             token_budget=setup.token_budget, preempt_mode=mode))
    seqs = [s.add(GenerationRequest(p, setup.max_tokens))[0] for p in prompts]
    start = time.perf_counter()
    while s.has_work:
        s.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(q.generated) for q in seqs)
    digest = hashlib.sha256(json.dumps([q.generated for q in seqs]).encode()).hexdigest()[:16]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "steps": s.counters["steps"],
            "preemptions": s.counters["preemptions"],
            "resume_cached_tokens": s.counters["resume_cached_tokens"],
            "resume_computed_tokens": s.counters["resume_computed_tokens"],
            "outputs_sha256": digest}


@torch.no_grad()
def resume_once(model, mode: str, context: list[int]) -> dict:
    """Seconds to bring ``context`` back into a session after a preemption in ``mode``."""
    B = model.cache_config().block_size
    kv = _cache(model, 4 * -(-len(context) // B), 64 << 20)
    sid = kv.open_session()
    model.forward_cached(context, kv, sid)
    kv.close_session(sid)  # what a swap preemption does: full blocks stay cached ...
    kv.offload("warm")  # ... and pressure demotes them to the warm tier
    start = time.perf_counter()
    sid = kv.open_session()
    reused = kv.match_prefix(sid, context) if mode == "swap" else 0
    model.forward_cached(context[reused:], kv, sid)
    return {"seconds": time.perf_counter() - start, "reused_tokens": reused}


def measure(setup: Setup, repeats: int, seed: int) -> dict:
    model = lm_model(seed).eval()
    prompts = _prompts(setup, seed)
    context = list(_prompts(Setup(requests=1, prompt_min=setup.resume_len,
                                  prompt_max=setup.resume_len), seed + 1)[0])
    runs: dict[str, dict[str, list[dict]]] = {m: {"workload": [], "resume": []}
                                              for m in PREEMPT_MODES}
    for r in range(repeats):
        for mode in PREEMPT_MODES if r % 2 == 0 else PREEMPT_MODES[::-1]:
            runs[mode]["workload"].append(workload(model, mode, setup, prompts))
            runs[mode]["resume"].append(resume_once(model, mode, context))
    return runs


def summarise(runs: dict, setup: Setup, repeats: int) -> dict:
    med = statistics.median
    modes = {}
    for mode, r in runs.items():
        w = r["workload"]
        modes[mode] = {
            "tokens_per_s": med(x["tokens_per_s"] for x in w),
            "preemptions": med(x["preemptions"] for x in w),
            "resume_cached_tokens": med(x["resume_cached_tokens"] for x in w),
            "resume_computed_tokens": med(x["resume_computed_tokens"] for x in w),
            "resume_ms": 1e3 * med(x["seconds"] for x in r["resume"]),
            "resume_reused_tokens": r["resume"][0]["reused_tokens"],
            "outputs_sha256": sorted({x["outputs_sha256"] for x in w}),
        }
    swap, rec = modes["swap"], modes["recompute"]
    return {"setup": asdict(setup), "repeats": repeats, "modes": modes,
            "same_outputs": swap["outputs_sha256"] == rec["outputs_sha256"]
            and len(swap["outputs_sha256"]) == 1,
            "ratios": {"throughput_swap_vs_recompute": swap["tokens_per_s"] / rec["tokens_per_s"],
                       "resume_ms_swap_vs_recompute": swap["resume_ms"] / rec["resume_ms"]}}


def summary_md(res: dict) -> str:
    rows = [{"mode": m, **{k: v for k, v in row.items() if k != "outputs_sha256"}}
            for m, row in res["modes"].items()]
    r = res["ratios"]
    return ("# Preemption: swap vs recompute\n\n"
            f"{res['setup']}; medians of {res['repeats']} interleaved repeats.\n\n"
            + markdown_table(rows, ["mode", "tokens_per_s", "preemptions", "resume_cached_tokens",
                                    "resume_computed_tokens", "resume_ms"])
            + f"\n\nswap / recompute: throughput x{r['throughput_swap_vs_recompute']:.3f}, "
              f"resume time x{r['resume_ms_swap_vs_recompute']:.3f}; same greedy outputs: "
              f"{res['same_outputs']}.\n")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, quick_help="CI-sized run: 4 requests, 2 repeats (seconds on 2 cores)")
    p.add_argument("--repeats", type=int, default=None, help="default 2 quick, 5 full")
    p.add_argument("--requests", type=int, default=None, help="default 4 quick, 8 full")
    p.add_argument("--json", action="store_true", help="print the result JSON last")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.requests is not None and args.requests < 2:
        p.error(f"--requests must be >= 2 (one alone never preempts), got {args.requests}")
    torch.set_num_threads(1)  # tiny matrices: a second thread only contends on 2 cores
    quick = dict(requests=4, max_tokens=24) if args.quick else {}
    if args.requests is not None:
        quick["requests"] = args.requests
    setup = Setup(**quick)
    repeats = args.repeats or (2 if args.quick else 5)
    res = summarise(measure(setup, repeats, args.seed), setup, repeats)
    run_dir = make_run_dir(args.out, "preempt_modes")
    write_json(run_dir / "results.json", res)
    (run_dir / "summary.md").write_text(summary_md(res))
    print(summary_md(res))
    print_results_dir(run_dir)
    if args.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
