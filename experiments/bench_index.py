"""Block-index lookup latency: ``dict`` vs the cuckoo hash (``experiments/cuckoo_index.py``) at 50 % and 90 %
load, in one run.

    python -m experiments.bench_index --json [--size N] [--quick] [--seed S]   # < 60 s

``--size`` is the cuckoo table's capacity in slots (rounded up to a power-of-two number of
4-slot buckets; default 65,536, ``--quick`` 4,096). At each load the cuckoo table is filled to
that fraction of its capacity and the dict gets the same keys (blake2b digests, as
``cache.prefix.block_hash`` makes them). Timing: ``time.perf_counter_ns`` around a batch of
``--batch`` (100) single ``index.get(key)`` calls on random keys, divided by the batch size;
``--batches`` such batches per (index, load, hit/miss), the indexes interleaved batch by batch
(order alternating), garbage collector off. p50/p99 are over the batch means, in ns per
lookup, loop overhead included (reported as ``loop_ns``, a builtin call in the same loop).
Misses (keys not in the index) are reported under ``misses``. With ``--json`` the last stdout
line is one JSON object: ``{"dict": {"p50_ns": {"50": .., "90": ..}, "p99_ns": {..}},
"cuckoo": {..}, ...}`` plus ``default``, ``faster``, ``ratio``, ``timing``, ``n_keys`` etc.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.cuckoo_index import DEFAULT_KIND, CuckooIndex, make_index

LOADS = (50, 90)
KINDS = ("dict", "cuckoo")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quick", action="store_true", help="small table, few batches (tests)")
    p.add_argument("--size", type=int, default=None,
                   help="cuckoo capacity in slots (default 65536; --quick 4096)")
    p.add_argument("--batch", type=int, default=100, help="lookups per timed batch")
    p.add_argument("--batches", type=int, default=None,
                   help="timed batches per index, load and hit/miss (default 5000; --quick 100)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.size is None:
        args.size = 4096 if args.quick else 65536
    if args.batches is None:
        args.batches = 100 if args.quick else 5000
    if args.size < 8 or args.batch < 1 or args.batches < 1:
        p.error("--size >= 8, --batch >= 1, --batches >= 1")
    return args


def make_keys(n: int, salt: bytes) -> list[bytes]:
    """``n`` distinct 16-byte blake2b digests."""
    return [hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=16).digest()
            for i in range(n)]


def build(kind: str, keys: Sequence[bytes], capacity: int) -> Any:
    """An index of ``kind`` holding ``keys`` (value: the key's position)."""
    index = make_index(kind, capacity)  # type: ignore[arg-type]
    for i, k in enumerate(keys):
        index[k] = i
    return index


def sample_batches(pool: Sequence[bytes], batches: int, batch: int,
                   rng: random.Random) -> list[list[bytes]]:
    """``batches`` lists of ``batch`` keys drawn from ``pool`` with replacement."""
    return [rng.choices(pool, k=batch) for _ in range(batches)]


def time_batch(get: Callable[[bytes], Any], keys: list[bytes]) -> float:
    """Mean ns per call of ``get`` over ``keys``, one ``perf_counter_ns`` pair for the batch."""
    clock = time.perf_counter_ns
    t0 = clock()
    for k in keys:
        get(k)
    return (clock() - t0) / len(keys)


def interleaved(gets: dict[str, Callable[[bytes], Any]],
                batches: list[list[bytes]]) -> dict[str, list[float]]:
    """Time every batch on every index, interleaved, the order alternating batch by batch."""
    names = list(gets)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i, keys in enumerate(batches):
        for n in (names if i % 2 == 0 else names[::-1]):
            out[n].append(time_batch(gets[n], keys))
    return out


def percentiles(samples: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of ``samples``, rounded to 0.1 ns."""
    p50, p99 = np.percentile(np.asarray(samples, dtype=np.float64), [50, 99])
    return round(float(p50), 1), round(float(p99), 1)


def measure_load(load: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Build both indexes at ``load`` % and time hits and misses; per-kind sample lists."""
    capacity = CuckooIndex(args.size).capacity
    n = capacity * load // 100
    keys = make_keys(n, b"hit%d-" % load)
    absent = make_keys(max(n, 1024), b"miss%d-" % load)
    indexes = {kind: build(kind, keys, capacity) for kind in KINDS}
    cuckoo = indexes["cuckoo"]
    assert cuckoo.capacity == capacity, "the cuckoo table grew: load would be wrong"
    gets = {kind: idx.get for kind, idx in indexes.items()}
    hit_batches = sample_batches(keys, args.batches, args.batch, rng)
    miss_batches = sample_batches(absent, args.batches, args.batch, rng)
    hits = interleaved(gets, hit_batches)
    misses = interleaved(gets, miss_batches)
    loop = interleaved({"loop": len}, hit_batches[: max(1, args.batches // 4)])["loop"]
    return {"n": n, "capacity": capacity, "load_factor": round(cuckoo.load_factor, 4),
            "stash": cuckoo.stash_size, "hits": hits, "misses": misses, "loop": loop}


def summarise(per_load: dict[int, dict[str, Any]], field: str) -> dict[str, Any]:
    """``{kind: {"p50_ns": {"50": .., "90": ..}, "p99_ns": {..}}}`` of ``field`` (hits/misses)."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        p50s, p99s = {}, {}
        for load, r in per_load.items():
            p50s[str(load)], p99s[str(load)] = percentiles(r[field][kind])
        out[kind] = {"p50_ns": p50s, "p99_ns": p99s}
    return out


def faster_kind(hits: dict[str, Any]) -> str:
    """The kind with the lower p50 summed over the loads (hits)."""
    sums = {k: sum(hits[k]["p50_ns"].values()) for k in KINDS}
    return min(KINDS, key=lambda k: sums[k])


def ratios(hits: dict[str, Any]) -> dict[str, dict[str, float]]:
    """cuckoo / dict for p50 and p99 at each load."""
    return {stat: {load: round(hits["cuckoo"][stat][load] / hits["dict"][stat][load], 2)
                   for load in hits["dict"][stat]}
            for stat in ("p50_ns", "p99_ns")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; the JSON-ready result."""
    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        per_load = {load: measure_load(load, args, rng) for load in LOADS}
    finally:
        if gc_was:
            gc.enable()
    hits = summarise(per_load, "hits")
    faster = faster_kind(hits)
    return {
        **hits,
        "misses": summarise(per_load, "misses"),
        "default": DEFAULT_KIND,
        "faster": faster,
        "default_is_faster": DEFAULT_KIND == faster,
        "ratio": ratios(hits),
        "loop_ns": {str(l): percentiles(r["loop"])[0] for l, r in per_load.items()},
        "n_keys": {str(l): r["n"] for l, r in per_load.items()},
        "load_factor": {str(l): r["load_factor"] for l, r in per_load.items()},
        "stash": {str(l): r["stash"] for l, r in per_load.items()},
        "capacity": per_load[LOADS[0]]["capacity"],
        "timing": (f"time.perf_counter_ns around {args.batch} single index.get(key) calls on "
                   f"random keys, divided by {args.batch}; {args.batches} batches per index, "
                   "load and hit/miss, dict and cuckoo interleaved batch by batch (order "
                   "alternating), gc off; p50/p99 over batch means, ns per lookup, loop "
                   "overhead included (loop_ns: len() in the same loop)"),
        "batch": args.batch,
        "batches": args.batches,
        "quick": args.quick,
        "seed": args.seed,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def report(r: dict[str, Any]) -> None:
    """Human-readable lines."""
    print(f"block index lookups, ns (capacity {r['capacity']} slots, keys {r['n_keys']})")
    for section, data in (("hits", r), ("misses", r["misses"])):
        for kind in KINDS:
            d = data[kind]
            cells = "  ".join(f"p50@{l}%={d['p50_ns'][l]:>8}  p99@{l}%={d['p99_ns'][l]:>8}"
                              for l in d["p50_ns"])
            print(f"  {section:<6} {kind:<6} {cells}")
    print(f"  faster: {r['faster']}; default: {r['default']}; cuckoo/dict {r['ratio']}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    r = run(args)
    report(r)
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
