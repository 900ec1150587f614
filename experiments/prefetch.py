"""Prefetch modes vs none on a KV-block trace replayed through hot / warm / cold tiers.

A block access is a *hot hit*, a *tier-miss stall* (the block was computed before and sits in
warm or cold: it must be restored on the critical path) or a *compute* (never seen: no tier
can hold it, no prefetcher can fetch it). Hot holds ``--hot-frac`` of the trace's unique blocks
(as ``experiments.eviction`` sizes its cache) under the engine's eviction policy, warm
``--warm-frac`` (LRU, overflow to cold), cold everything else. After each access the
prefetcher (``cache.prefetch``) observes it and predicts up to ``--degree`` blocks; each one
held in warm or cold moves to hot at once, taking hot room like a demand block (it evicts the
policy's victim), and is usable ``--latency`` accesses later (1: by the next access). A
prefetch is *used* when its block is accessed while still hot, *wasted* when it leaves hot (or
the replay ends) first. Every mode replays the same trace in the same run; the figures are
counts, deterministic per seed (only ``us_per_access`` is a timing).

    python -m experiments.prefetch --trace TRACE.jsonl --quick --json

Target (issue 11): the best mode removes >= 50 % of the tier-miss stalls with <= 30 % wasted
prefetch bytes on the Mooncake conversation trace. Blocks there are 512 tokens each, so bytes
are counted per block (``--block-bytes``) and the wasted-bytes share equals the wasted-block
share.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cache.policy import make_policy
from cache.prefetch import PREFETCH_DEGREE, PREFETCH_MODES, Prefetcher, PrefetchLedger, make_prefetcher
from experiments.eviction import Trace, default_capacities, load_trace, unique_blocks
from experiments.output import (
    add_common_args, make_run_dir, markdown_table, plot_lines, print_estimate,
    print_results_dir, write_csv, write_json,
)
from node.tasks.workload import find_trace

QUICK_REQUESTS = 1500
COLUMNS = ["mode", "degree", "stalls", "stall_reduction", "accuracy", "wasted_fraction",
           "issued", "used", "wasted", "late", "stalled_requests", "hits", "computed", "warm_stalls", "cold_stalls",
           "accesses", "us_per_access"]
# per block access on the Mooncake conversation trace, 2-core machine (for the estimate line)
US_PER_ACCESS = {"none": 5.0, "sequential": 8.0, "heat": 70.0, "hybrid": 80.0, "lstm": 260.0}
TARGET_STALL_REDUCTION, TARGET_WASTED = 0.5, 0.3


class TraceNotFoundError(FileNotFoundError):
    """The trace path does not exist (no silent fallback to another trace)."""


@dataclass(frozen=True)
class TierModel:
    """Tier sizes of the replay, in blocks."""

    hot_blocks: int
    warm_blocks: int
    policy: str = "lru"
    """The engine's eviction policy for hot (``cache.policy``)."""
    block_bytes: int = 1
    latency: int = 1
    """Accesses between a prefetch and its block being usable (1: by the next access)."""


class TieredBlocks:
    """Hot (engine policy, fixed slots) over warm (LRU) over cold (unbounded); every block
    leaving hot goes to warm, every one leaving warm to cold. ``ledger`` hears evictions."""

    def __init__(self, model: TierModel, ledger: PrefetchLedger) -> None:
        self.model, self.ledger = model, ledger
        self.hot: set[bytes] = set()
        self.policy = make_policy(model.policy, model.hot_blocks)
        self.warm: OrderedDict[bytes, None] = OrderedDict()
        self.cold: set[bytes] = set()

    def tier_of(self, key: bytes) -> str | None:
        if key in self.hot:
            return "hot"
        if key in self.warm:
            return "warm"
        return "cold" if key in self.cold else None

    def touch(self, key: bytes) -> None:
        """A hot hit, as the engine tells its policy: hit, referenced (removed), released."""
        self.policy.hit(key)
        self.policy.remove(key)
        self.policy.insert(key)

    def bring_in(self, key: bytes) -> None:
        """Place ``key`` in hot (from warm, cold or computed), evicting to make room."""
        if key in self.warm:
            del self.warm[key]
        self.cold.discard(key)
        while len(self.hot) >= self.model.hot_blocks:
            self._evict_one()
        self.hot.add(key)
        self.policy.insert(key)

    def _evict_one(self) -> None:
        victim = self.policy.victims(1)[0]
        self.policy.remove(victim)
        self.hot.discard(victim)
        self.ledger.evicted(victim)
        self.warm[victim] = None
        if len(self.warm) > self.model.warm_blocks:
            self.cold.add(self.warm.popitem(last=False)[0])


@dataclass
class Replay:
    """One mode's counts over the trace."""

    mode: str
    accesses: int = 0
    hits: int = 0
    computed: int = 0
    warm_stalls: int = 0
    cold_stalls: int = 0
    late: int = 0
    """Accesses of a prefetched block before it arrived (``--latency`` > 1): still a stall."""
    stalled_requests: int = 0
    """Requests with at least one stall."""
    curve: list[int] = field(default_factory=list)
    seconds: float = 0.0
    ledger: PrefetchLedger = field(default_factory=PrefetchLedger)
    extra: dict = field(default_factory=dict)

    @property
    def stalls(self) -> int:
        return self.warm_stalls + self.cold_stalls + self.late


def _access(tiers: TieredBlocks, r: Replay, key: bytes, step: int, arrives: dict[bytes, int]
            ) -> None:
    where = tiers.tier_of(key)
    if where == "hot":
        late = arrives.pop(key, step) > step
        r.late += late
        r.hits += not late
        tiers.touch(key)
    elif where is None:
        r.computed += 1
        tiers.bring_in(key)
    else:
        r.warm_stalls += where == "warm"
        r.cold_stalls += where == "cold"
        tiers.bring_in(key)


def _prefetch(tiers: TieredBlocks, p: Prefetcher, step: int, arrives: dict[bytes, int]) -> None:
    for k in p.predict(tiers.hot):
        if tiers.tier_of(k) in ("warm", "cold"):
            tiers.bring_in(k)
            p.ledger.issue(k, tiers.model.block_bytes)
            arrives[k] = step + tiers.model.latency


def replay(trace: Trace, model: TierModel, mode: str, degree: int = PREFETCH_DEGREE,
           seed: int = 0, points: int = 50) -> Replay:
    """Replay ``trace`` through the tiers with the named prefetch mode."""
    p = make_prefetcher(mode, degree, seed=seed)
    r = Replay(mode, ledger=p.ledger)
    tiers = TieredBlocks(model, p.ledger)
    arrives: dict[bytes, int] = {}
    every = max(1, sum(map(len, trace)) // points)
    t0 = time.perf_counter()
    for req in trace:
        before = r.stalls
        for key in req:
            r.accesses += 1
            _access(tiers, r, key, r.accesses, arrives)
            p.ledger.access(key)
            p.observe(key)
            _prefetch(tiers, p, r.accesses, arrives)
            if r.accesses % every == 0:
                r.curve.append(r.stalls)
        r.stalled_requests += r.stalls > before
    r.seconds = time.perf_counter() - t0
    p.ledger.close()
    r.extra = {k: v for k, v in p.stats().items() if k in ("switches", "active", "trainings")}
    return r


# -- report -------------------------------------------------------------------------------------
def rows_for(results: dict[str, Replay], degree: int) -> list[dict]:
    base = results["none"].stalls if "none" in results else None
    rows = []
    for name, r in results.items():
        led = r.ledger
        rows.append({"mode": name, "degree": degree, "stalls": r.stalls,
                     "stall_reduction": 1 - r.stalls / base if base else float("nan"),
                     "accuracy": led.accuracy, "wasted_fraction": led.wasted_fraction,
                     "issued": led.issued, "used": led.used, "wasted": led.wasted, "late": r.late,
                     "stalled_requests": r.stalled_requests,
                     "hits": r.hits, "computed": r.computed, "warm_stalls": r.warm_stalls,
                     "cold_stalls": r.cold_stalls, "accesses": r.accesses,
                     "us_per_access": r.seconds / max(1, r.accesses) * 1e6})
    return rows


def _nan_to_none(v: float) -> float | None:
    return None if v != v else v


def report(rows: list[dict], results: dict[str, Replay]) -> dict:
    """The JSON: per mode stalls, accuracy, wasted_fraction (+ counts), and the target."""
    modes = {row["mode"]: {k: (_nan_to_none(v) if isinstance(v, float) else v)
                           for k, v in row.items() if k != "mode"} | results[row["mode"]].extra
             for row in rows}
    ok = [m for m, d in modes.items() if m != "none" and d["wasted_fraction"] is not None
          and d["wasted_fraction"] <= TARGET_WASTED]
    cands = [m for m in modes if m != "none"]
    best = max(ok or cands, key=lambda m: modes[m]["stall_reduction"] or 0.0) if cands else None
    out: dict = {"modes": modes, "best_mode": best}
    if best is not None:
        b = modes[best]
        out["target"] = {"stall_reduction_min": TARGET_STALL_REDUCTION,
                         "wasted_fraction_max": TARGET_WASTED,
                         "best_stall_reduction": b["stall_reduction"],
                         "best_wasted_fraction": b["wasted_fraction"],
                         "met": bool(b["stall_reduction"] is not None
                                     and b["stall_reduction"] >= TARGET_STALL_REDUCTION
                                     and b["wasted_fraction"] is not None
                                     and b["wasted_fraction"] <= TARGET_WASTED)}
    return out


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def summary_md(res: dict, rows: list[dict]) -> str:
    t = res.get("target", {})
    return "\n".join([
        f"# Prefetch modes on {res['trace']} ({res['requests']:,} requests, {res['accesses']:,} "
        f"block accesses, {res['unique_blocks']:,} unique blocks)\n",
        f"Hot {res['hot_blocks']:,} blocks ({res['hot_frac']:.0%} of unique, policy "
        f"{res['policy']}), warm {res['warm_blocks']:,} blocks, cold unbounded; degree "
        f"{res['degree']}, prefetch latency {res['latency']} access(es). A stall is an access to a "
        "block held in warm or cold (or a prefetch not arrived yet); prefetched blocks take hot "
        "room like demand blocks. wasted_fraction = prefetched bytes that left hot (or were "
        "still unused at the end) / prefetched bytes.\n",
        markdown_table(rows, COLUMNS),
        f"\n## Target\n\nbest mode within {TARGET_WASTED:.0%} waste: **{res.get('best_mode')}**, "
        f"stall reduction {_pct(t.get('best_stall_reduction'))}, wasted "
        f"{_pct(t.get('best_wasted_fraction'))} "
        f"(target >= {TARGET_STALL_REDUCTION:.0%} and <= {TARGET_WASTED:.0%}): "
        f"{'met' if t.get('met') else 'NOT met'}.\n",
        "## What the model assumes\n\n"
        "- A prefetch moves its block at once and it is usable `latency` accesses later (the "
        "restore overlaps the work on the blocks before it); `--latency 2` or more shows late "
        "prefetches as stalls (`late`).\n"
        "- Accesses are per block, in request order. Inside one request the engine knows the "
        "whole prompt, so the within-request part of a sequential prefetch is the engine "
        "restoring the prompt's next blocks ahead instead of one by one on the critical path; "
        "`stalled_requests` counts the requests with at least one stall: what a prefetch that "
        "only restores the known prompt ahead could not avoid.\n"
        "- Bytes are uniform per block (`--block-bytes`), so wasted bytes = wasted blocks.\n"])


# -- command line -------------------------------------------------------------------------------
def resolve_trace(path: str | None) -> Path:
    p = Path(path) if path else find_trace()
    if p is None or not p.is_file():
        raise TraceNotFoundError(f"trace not found: {p}" if path else
                                 "no trace: pass --trace PATH or set $FEDKV_SERVE_TRACE")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, quick_help=f"the first {QUICK_REQUESTS:,} requests of the trace (< 1 min "
                                  "on 2 cores)")
    p.add_argument("--trace", default=None, help="Mooncake .jsonl or ARC .lis (default $FEDKV_SERVE_TRACE)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--modes", nargs="+", default=list(PREFETCH_MODES), choices=PREFETCH_MODES)
    p.add_argument("--degree", type=int, default=PREFETCH_DEGREE, help="prefetch_degree (default 2)")
    p.add_argument("--hot-frac", type=float, default=0.05, help="hot = this share of unique blocks")
    p.add_argument("--warm-frac", type=float, default=0.10, help="warm = this share of unique blocks")
    p.add_argument("--policy", default="lru", help="hot tier eviction policy (cache.policy)")
    p.add_argument("--latency", type=int, default=1, help="accesses until a prefetch is usable")
    p.add_argument("--block-bytes", type=int, default=1, help="bytes per block (uniform)")
    p.add_argument("--json", action="store_true", help="print the result JSON last")
    args = p.parse_args(argv)
    for name in ("degree", "latency", "block_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.hot_frac < 1 or not 0 <= args.warm_frac < 1:
        p.error("--hot-frac must be in (0, 1) and --warm-frac in [0, 1)")
    try:
        args.trace_path = resolve_trace(args.trace)
    except TraceNotFoundError as e:
        p.error(str(e))
    return args


def run_modes(trace: Trace, model: TierModel, modes: Sequence[str], degree: int, seed: int
              ) -> dict[str, Replay]:
    """Every mode over the same trace ('none' first: the baseline of the ratios)."""
    order = ["none", *[m for m in modes if m != "none"]]
    return {m: replay(trace, model, m, degree, seed) for m in order}


def write_outputs(run: Path, out_json: dict, rows: list[dict], results: dict[str, Replay]) -> None:
    write_csv(run / "points.csv", rows, COLUMNS)
    write_json(run / "results.json", out_json)
    (run / "summary.md").write_text(summary_md(out_json, rows))
    n = max(len(r.curve) for r in results.values())
    step = out_json["accesses"] / max(1, n)
    plot_lines(run / "stalls.png",
               {m: ([step * (i + 1) for i in range(len(r.curve))], r.curve) for m, r in results.items()},
               xlabel="block accesses replayed", ylabel="cumulative tier-miss stalls",
               title=f"prefetch modes on {Path(out_json['trace']).name} (degree {out_json['degree']})",
               logx=False, logy=False, styles={"none": {"linestyle": "--", "color": "black"}})


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    limit = args.limit if args.limit is not None else (QUICK_REQUESTS if args.quick else None)
    trace = load_trace(args.trace_path, limit)
    unique = unique_blocks(trace)
    accesses = sum(map(len, trace))
    model = TierModel(default_capacities(trace, (args.hot_frac,))[0],
                      max(1, round(args.warm_frac * unique)), args.policy, args.block_bytes,
                      args.latency)
    us = sum(US_PER_ACCESS.get(m, 50.0) for m in {"none", *args.modes})
    print_estimate(accesses * us * 1e-6 + 1.0, f"{accesses:,} block accesses x {us:.0f} us summed "
                   f"over the modes (measured on 2 cores)")
    results = run_modes(trace, model, args.modes, args.degree, args.seed)
    rows = rows_for(results, args.degree)
    out_json = report(rows, results) | {
        "trace": str(args.trace_path), "requests": len(trace), "accesses": accesses,
        "unique_blocks": unique, "hot_blocks": model.hot_blocks, "hot_frac": args.hot_frac,
        "warm_blocks": model.warm_blocks, "policy": model.policy, "degree": args.degree,
        "latency": model.latency, "seconds": time.perf_counter() - t0}
    run = make_run_dir(args.out, "prefetch")
    write_outputs(run, out_json, rows, results)
    print(markdown_table(rows, ["mode", "stalls", "stall_reduction", "accuracy", "wasted_fraction",
                                "issued", "us_per_access"]))
    print_results_dir(run)
    if args.json:
        print(json.dumps(out_json), flush=True)
    return out_json | {"run_dir": str(run)}


if __name__ == "__main__":
    main()
