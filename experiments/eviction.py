"""Eviction policies vs Bélády on KV-block traces: block and prefix hit ratio per cache size.

A small cache simulator with a fixed number of block slots drives the engine's own policy
classes (``cache.policy``) exactly as the engine does: on a request, every block hash in order
is looked up; a cached one is a hit (``hit``, then ``remove``: referenced while in use), a miss
takes a free slot or frees ``victims(EVICT_BATCH)`` first (a request longer than the cache
bypasses the blocks that find no slot). After the request its blocks are released into the
policy tail first (``insert(key, parent=...)``). Bélády's offline optimum evicts the evictable
block used furthest in the future, one at a time; ``oracle_dead`` (offline too) is LRU that
knows which blocks are never used again, to show how much of Bélády's lead is that alone. The prefix hit ratio counts a request's
blocks only while every earlier block of that request hit (after a miss the rest is
recomputed anyway).

    python -m experiments.eviction --trace TRACE.jsonl --quick --json

Traces: Mooncake jsonl (``hash_ids`` per line), ARC ``.lis`` (``start count ...``: blocks
start..start+count-1, one request per line), or none: a seeded generated trace with shared
prefixes, multi-turn conversations and loops.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from cache.policy import EVICT_BATCH, POLICIES, EvictionPolicy, LRUPolicy, make_policy
from experiments.output import (
    add_common_args, make_run_dir, markdown_table, plot_lines, print_estimate,
    print_results_dir, write_csv, write_json,
)

Trace = list[list[bytes]]
COLUMNS = ["policy", "capacity", "capacity_frac", "block_hit", "prefix_hit", "block_vs_belady",
           "prefix_vs_belady", "seconds"]
DEFAULT_FRACS = (0.01, 0.02, 0.05, 0.10)
# per block access, measured on the Mooncake conversation trace (2-core machine, CPython 3)
US_PER_ACCESS = {"lru": 0.8, "lfu": 5.0, "hybrid": 4.5, "arc": 1.8, "adaptive": 12.0,
                 "belady": 1.4, "oracle_dead": 1.2}


@dataclass(frozen=True)
class GenConfig:
    """The generated trace: ``conversations`` multi-turn chats over a few shared system prompts,
    plus one-off requests and a looping scan (defaults give ~2k requests, ~10k blocks)."""

    seed: int = 0
    requests: int = 2000
    prompts: int = 4            # shared system prompts (roots)
    prompt_blocks: int = 4
    turn_blocks: tuple[int, int] = (1, 6)
    new_conv_prob: float = 0.15
    one_off_prob: float = 0.2
    loop_every: int = 50        # every n-th request replays one fixed 60-block document
    loop_blocks: int = 60


# -- traces ------------------------------------------------------------------------------
def _key(table: dict[object, bytes], x: object) -> bytes:
    k = table.get(x)
    if k is None:
        k = table[x] = len(table).to_bytes(8, "little")
    return k


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> Trace:
    """Mooncake ``.jsonl`` or ARC ``.lis``; block ids become 8-byte keys (one object per id)."""
    table: dict[object, bytes] = {}
    out: Trace = []
    with open(path) as fh:
        for line in fh:
            if limit is not None and len(out) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                ids = json.loads(line)["hash_ids"]
            else:
                start, n = (int(x) for x in line.split()[:2])
                ids = range(start, start + n)
            out.append([_key(table, i) for i in ids])
    return out


def generated_trace(cfg: GenConfig = GenConfig()) -> Trace:
    rng = random.Random(cfg.seed)
    table: dict[object, bytes] = {}
    fresh = iter(range(10**9))
    prompts = [[("p", i, j) for j in range(cfg.prompt_blocks)] for i in range(cfg.prompts)]
    convs: list[list[object]] = []
    loop = [("loop", j) for j in range(cfg.loop_blocks)]
    out: Trace = []
    for r in range(cfg.requests):
        if cfg.loop_every and r % cfg.loop_every == cfg.loop_every - 1:
            ids: list[object] = loop
        elif rng.random() < cfg.one_off_prob:
            ids = list(rng.choice(prompts)) + [next(fresh) for _ in range(rng.randint(*cfg.turn_blocks) * 3)]
        else:
            if not convs or rng.random() < cfg.new_conv_prob:
                convs.append(list(rng.choice(prompts)))
            i = min(int(rng.expovariate(1.0 / 8)), len(convs) - 1)  # recent chats return sooner
            conv = convs[-1 - i]
            conv.extend(next(fresh) for _ in range(rng.randint(*cfg.turn_blocks)))
            ids = list(conv)
        out.append([_key(table, i) for i in ids])
    return out


def unique_blocks(trace: Trace) -> int:
    return len({k for req in trace for k in req})


def single_use_fraction(trace: Trace) -> float:
    """Share of the unique blocks used by one request only: what no online policy can tell
    apart at their first use, and where Bélády's lead comes from."""
    uses: dict[bytes, int] = {}
    for req in trace:
        for k in set(req):
            uses[k] = uses.get(k, 0) + 1
    return sum(1 for v in uses.values() if v == 1) / max(1, len(uses))


# -- simulation --------------------------------------------------------------------------
@dataclass
class Result:
    block_hits: int
    prefix_hits: int
    accesses: int
    seconds: float

    @property
    def block_hit(self) -> float:
        return self.block_hits / max(1, self.accesses)

    @property
    def prefix_hit(self) -> float:
        return self.prefix_hits / max(1, self.accesses)


def simulate(trace: Trace, capacity: int, policy_name: str, batch: int = EVICT_BATCH,
             policy: EvictionPolicy | None = None) -> Result:
    """Replay ``trace`` through a ``capacity``-slot cache run by the named engine policy (or
    the given ``policy`` object)."""
    t0 = time.perf_counter()
    policy = policy if policy is not None else make_policy(policy_name, capacity)
    cached: set[bytes] = set()
    hits = phits = accesses = 0
    for req in trace:
        used: list[bytes] = []
        parents: dict[bytes, bytes | None] = {}
        in_req: set[bytes] = set()
        prefix = True
        prev: bytes | None = None
        for key in req:
            accesses += 1
            if key in in_req:  # repeated inside the request: already referenced
                hits += 1
                phits += prefix
                continue
            if key in cached:
                hits += 1
                phits += prefix
                policy.hit(key)
                policy.remove(key)
            else:
                prefix = False
                if len(cached) >= capacity:
                    for v in policy.victims(batch):
                        cached.discard(v)
                        policy.remove(v)
                    if len(cached) >= capacity:  # every slot referenced by this request
                        prev = key
                        continue
                cached.add(key)
            in_req.add(key)
            used.append(key)
            parents[key] = prev
            prev = key
        for key in reversed(used):
            policy.insert(key, parent=parents[key])
    return Result(hits, phits, accesses, time.perf_counter() - t0)


def belady(trace: Trace, capacity: int) -> Result:
    """Bélády's MIN: evict the evictable block whose next use is furthest (never = infinity);
    referenced blocks of the running request stay, as in the online simulator."""
    t0 = time.perf_counter()
    flat = [k for req in trace for k in req]
    inf = len(flat) + 1
    nxt = [inf] * len(flat)
    last: dict[bytes, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = last.get(flat[i], inf)
        last[flat[i]] = i
    cached: dict[bytes, int] = {}  # key -> next use (for evictable keys: heap entries match)
    heap: list[tuple[int, bytes]] = []  # (-next use, key) over evictable keys, lazy
    evictable: set[bytes] = set()
    hits = phits = 0
    pos = 0
    for req in trace:
        used: list[bytes] = []
        cached_here: set[bytes] = set()
        prefix = True
        for key in req:
            nu = nxt[pos]
            pos += 1
            if key in cached:
                hits += 1
                phits += prefix
                evictable.discard(key)
                if key not in cached_here:
                    cached_here.add(key)
                    used.append(key)
                cached[key] = nu
                continue
            prefix = False
            if len(cached) >= capacity:
                while heap:
                    neg, v = heapq.heappop(heap)
                    if v in evictable and cached[v] == -neg:
                        evictable.discard(v)
                        del cached[v]
                        break
                if len(cached) >= capacity:
                    continue
            cached[key] = nu
            cached_here.add(key)
            used.append(key)
        for key in used:
            evictable.add(key)
            heapq.heappush(heap, (-cached[key], key))
    return Result(hits, phits, len(flat), time.perf_counter() - t0)


class DeadBlockOracle(LRUPolicy):
    """LRU that knows which blocks will never be used again and evicts those first: an offline
    bound isolating how much of Bélády's lead is dead-block prediction alone."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.left: dict[bytes, int] = {}
        for req in trace:
            for key in dict.fromkeys(req):  # the simulator signals a key once per request
                self.left[key] = self.left.get(key, 0) + 1
        self.dead: dict[bytes, None] = {}
        self._hit: set[bytes] = set()

    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        if key in self._hit:
            self._hit.discard(key)
        else:
            self.left[key] -= 1
        if self.left[key] == 0:
            self.dead[key] = None
        else:
            super().insert(key)

    def hit(self, key: bytes) -> None:
        self.left[key] -= 1
        self._hit.add(key)
        super().hit(key)

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self.dead.pop(key, None)

    def victims(self, n: int) -> list[bytes]:
        out = list(islice(self.dead, n))
        return out + super().victims(n - len(out))

    def __len__(self) -> int:
        return super().__len__() + len(self.dead)

    def __contains__(self, key: object) -> bool:
        return key in self.dead or super().__contains__(key)


OFFLINE = ("belady", "oracle_dead")


def _run(args: tuple[Trace, int, str]) -> tuple[str, int, Result]:
    trace, cap, name = args
    if name == "belady":
        return name, cap, belady(trace, cap)
    policy = DeadBlockOracle(trace) if name == "oracle_dead" else None
    return name, cap, simulate(trace, cap, name, policy=policy)


_TRACE: Trace = []


def _run_shared(job: tuple[int, str]) -> tuple[str, int, Result]:
    return _run((_TRACE, job[0], job[1]))


def _init(trace: Trace) -> None:
    global _TRACE
    _TRACE = trace


def run_all(trace: Trace, capacities: Sequence[int], names: Sequence[str],
            workers: int = 1) -> dict[str, dict[int, Result]]:
    jobs = [(c, n) for n in names for c in capacities]
    out: dict[str, dict[int, Result]] = {n: {} for n in names}
    if workers <= 1:
        _init(trace)
        results = map(_run_shared, jobs)
    else:
        pool = ProcessPoolExecutor(workers, initializer=_init, initargs=(trace,))
        results = pool.map(_run_shared, jobs)
    for name, cap, res in results:
        out[name][cap] = res
    if workers > 1:
        pool.shutdown()
    return out


# -- report ------------------------------------------------------------------------------
def default_capacities(trace: Trace, fracs: Sequence[float] = DEFAULT_FRACS) -> list[int]:
    n = unique_blocks(trace)
    return sorted({max(1, round(f * n)) for f in fracs})


def report(results: dict[str, dict[int, Result]], capacities: Sequence[int], unique: int) -> dict:
    """The JSON: per policy one value per capacity, ratios to Bélády, targets and the claim."""
    caps = list(capacities)
    pol = {n: {"block_hit": [r[c].block_hit for c in caps], "prefix_hit": [r[c].prefix_hit for c in caps]}
           for n, r in results.items()}
    bel = pol.get("belady")
    ratios = {} if bel is None else {
        n: {m: [v / b if b else float("nan") for v, b in zip(d[m], bel[m])] for m in d}
        for n, d in pol.items() if n != "belady"}
    online = [n for n in pol if n not in OFFLINE]
    out: dict = {"capacities": caps, "capacity_frac": [c / unique for c in caps],
                 "unique_blocks": unique, "policies": pol, "ratio_to_belady": ratios}
    if "arc" in pol and online:
        best = [max(online, key=lambda n: pol[n]["block_hit"][i]) for i in range(len(caps))]
        out["best_online"] = best
        out["targets"] = {
            "best_online_ge_arc_every_capacity": all(
                pol[b]["block_hit"][i] >= pol["arc"]["block_hit"][i] for i, b in enumerate(best)),
        }
        if ratios:
            i5 = min(range(len(caps)), key=lambda i: abs(caps[i] / unique - 0.05))
            out["targets"]["best_online_vs_belady_at_5pct"] = ratios[best[i5]]["block_hit"][i5]
            out["targets"]["arc_vs_belady_at_5pct"] = ratios["arc"]["block_hit"][i5]
            out["targets"]["goal_0.85x_belady_at_5pct_met"] = ratios[best[i5]]["block_hit"][i5] >= 0.85
    if "hybrid" in pol and "lru" in pol:
        gain = [h / l - 1 if l else float("nan") for h, l in zip(pol["hybrid"]["block_hit"], pol["lru"]["block_hit"])]
        out["claims"] = {"hybrid_vs_lru_block_hit_gain": {
            "article": 0.23, "measured": gain, "mean": sum(gain) / len(gain),
            "holds_at_every_capacity": all(g >= 0.23 for g in gain)}}
    return out


def rows_for(results: dict[str, dict[int, Result]], capacities: Sequence[int], unique: int) -> list[dict]:
    bel = results.get("belady", {})
    rows = []
    for name, per in results.items():
        for c in capacities:
            r, b = per[c], bel.get(c)
            rows.append({"policy": name, "capacity": c, "capacity_frac": c / unique,
                         "block_hit": r.block_hit, "prefix_hit": r.prefix_hit,
                         "block_vs_belady": r.block_hit / b.block_hit if b and b.block_hit else float("nan"),
                         "prefix_vs_belady": r.prefix_hit / b.prefix_hit if b and b.prefix_hit else float("nan"),
                         "seconds": r.seconds})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, quick_help="CI-sized run: a 2,000-request generated trace when no --trace "
                                  "(a file trace is always replayed whole; < 1 min on 2 cores)")
    p.add_argument("--trace", default=None, help="Mooncake .jsonl or ARC .lis trace (default: generated)")
    p.add_argument("--capacities", type=int, nargs="+", default=None,
                   help="cache sizes in blocks (default 1%%, 2%%, 5%%, 10%% of the unique blocks)")
    p.add_argument("--policies", nargs="+", default=[*POLICIES, *OFFLINE],
                   help=f"default: {' '.join(POLICIES)} {' '.join(OFFLINE)} (oracle_dead: LRU that "
                        "evicts never-reused blocks first, an offline bound)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", action="store_true", help="print the result JSON last")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.trace:
        trace, source = load_trace(args.trace, args.limit), str(args.trace)
    else:
        trace = generated_trace(GenConfig(seed=args.seed, requests=2000 if args.quick else 20000))[: args.limit]
        source = "generated"
    unique = unique_blocks(trace)
    caps = sorted(args.capacities) if args.capacities else default_capacities(trace)
    names = list(dict.fromkeys(args.policies))
    accesses = sum(map(len, trace))
    us = sum(US_PER_ACCESS.get(n, 5.0) for n in names)
    print_estimate(accesses * len(caps) * us * 1e-6 / max(1, args.workers) + 1.0,
                   f"{accesses:,} block accesses x {len(caps)} capacities x {us:.0f} us summed over "
                   f"{len(names)} policies (measured on 2 cores), {args.workers} worker(s)")
    results = run_all(trace, caps, names, args.workers)
    out_json = report(results, caps, unique) | {"trace": source, "requests": len(trace),
                                                "single_use_block_frac": single_use_fraction(trace),
                                                "accesses": accesses, "evict_batch": EVICT_BATCH,
                                                "seconds": time.perf_counter() - t0}
    rows = rows_for(results, caps, unique)
    run = make_run_dir(args.out, "eviction")
    write_csv(run / "points.csv", rows, COLUMNS)
    write_json(run / "results.json", out_json)
    (run / "summary.md").write_text(summary_md(out_json, rows))
    plot_lines(run / "hit_ratio.png",
               {n: (caps, out_json["policies"][n]["block_hit"]) for n in names},
               xlabel="cache capacity (blocks)", ylabel="block hit ratio",
               title=f"eviction policies on {Path(source).name}", logx=True, logy=False,
               styles={"belady": {"linestyle": "--", "color": "black"},
                       "oracle_dead": {"linestyle": ":", "color": "gray"}})
    print(markdown_table(rows, ["policy", "capacity", "block_hit", "prefix_hit", "block_vs_belady"]))
    print_results_dir(run)
    if args.json:
        print(json.dumps(out_json), flush=True)
    return out_json | {"run_dir": str(run)}


def summary_md(res: dict, rows: list[dict]) -> str:
    lines = [f"# Eviction policies on {res['trace']} ({res['requests']:,} requests, "
             f"{res['accesses']:,} block accesses, {res['unique_blocks']:,} unique blocks)\n",
             f"Capacities in blocks: {res['capacities']}; eviction in batches of {res['evict_batch']}; "
             "Bélády = offline MIN (furthest next use, one block at a time); oracle_dead = LRU that "
             "knows which blocks are never used again (offline: how much of Bélády's lead is "
             "dead-block prediction). prefix_hit counts a request's blocks only up to its first "
             "miss.\n",
             markdown_table(rows, COLUMNS)]
    if "targets" in res:
        lines.append("\n## Targets\n\n" + "\n".join(f"- {k}: {v}" for k, v in res["targets"].items())
                     + f"\n- best online per capacity: {res['best_online']}\n")
    if "oracle_dead" in res["policies"] and res.get("ratio_to_belady"):
        r = [round(x, 3) for x in res["ratio_to_belady"]["oracle_dead"]["block_hit"]]
        lines.append(f"\n## Why online policies trail Bélády\n\n{res['single_use_block_frac']:.0%} of the "
                     f"unique blocks are used by one request only. LRU that merely knows which blocks "
                     f"are dead (oracle_dead) reaches {r} of Bélády per capacity: the gap is "
                     "dead-block prediction, which frequency, recency, depth and leaf-ness only "
                     "weakly provide at a block's first use.\n")
    if "claims" in res:
        c = res["claims"]["hybrid_vs_lru_block_hit_gain"]
        lines.append("\n## Claim: hybrid +23 % hit ratio over LRU\n\n"
                     f"measured gain per capacity: {[round(g, 3) for g in c['measured']]} "
                     f"(mean {c['mean']:.3f}); holds at every capacity: {c['holds_at_every_capacity']}\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
