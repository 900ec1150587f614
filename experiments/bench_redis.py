"""The Redis cold tier, measured (issue: a shared cold tier on a real Redis).

Three sections, each against its own ``redis-server`` (``experiments.redis_server``):

* **ttft**: time to first token of a cached prompt (1,024 tokens; ``--quick``: the byte model's
  context) restored from Redis by a fresh cache (another process's view: nothing hot, nothing
  on its disk), vs the local cold tier (an encrypted segment store, reopened without prewarm:
  ``experiments.bench_restore.cold_once``) vs recompute. Interleaved repeats, medians; restore
  bandwidth = K/V bytes restored over the Redis read time and over the whole TTFT.
* **second_process**: two real ``node.serving.openai_api`` processes on one Redis; the first serves a
  shared-prefix load, then the second serves the same kind of load (other suffixes). Hit rate
  = prefix blocks hit (``/metrics``, every tier) over the prompts' full blocks.
* **restart**: 16 clients against one server process while Redis is SIGKILLed and restarted;
  every failed request counted.

Prints one JSON object (keys ``ttft_s.redis``, ``ttft_s.cold``, ``ttft_s.recompute``,
``redis.second_process_hit_rate``, ``redis.failed_requests_during_restart``, ...) and writes it
under ``--out``. ``python -m experiments.bench_redis [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cache import KVCache
from cache.redis_store import RedisOptions, RedisStore
from experiments.bench_restore import KEY, cold_once, recompute_once
from experiments.output import add_common_args, make_run_dir, write_json
from experiments.redis_server import start_in
from experiments.redis_load import second_process_section, restart_section

NS = b"bench|weights"


def _model(name: str):
    import torch
    from node.serving.served_model import load_model
    torch.manual_seed(0)
    return load_model(name)[0]


def _redis_cache(cfg, url: str) -> KVCache:
    return KVCache(cfg, store=RedisStore(RedisOptions(url=url, namespace=NS, ttl_s=0), KEY))


def _redis_once(model, prompt: list[int], cfg, url: str) -> tuple[float, dict]:
    """A fresh cache (another process: nothing hot) prefilling ``prompt`` from Redis."""
    kv = _redis_cache(cfg, url)
    t0 = time.perf_counter()
    model.prefill(prompt, kv, kv.open_session())
    took = time.perf_counter() - t0
    st = kv.stats()
    kv.store.close()
    return took, {"hits": st["tier_hits"]["redis"], **st["remote"]}


def ttft_section(model, prompt: list[int], repeats: int, url: str) -> dict[str, Any]:
    cfg = model.cache_config(pool_bytes=96 << 20, block_size=16)
    writer = _redis_cache(cfg, url)
    model.prefill(prompt, writer, writer.open_session())  # the first process computes it
    writer.store.commit()
    block_bytes = writer.arena.block_bytes
    writer.store.close()
    samples: dict[str, list[float]] = {"recompute": [], "cold": [], "redis": []}
    reads: list[dict] = []
    order = ["recompute", "cold", "redis"]
    for i in range(repeats):  # interleaved, rotated: no contender always runs first
        for name in order[i % 3:] + order[:i % 3]:
            if name == "recompute":
                samples[name].append(recompute_once(model, prompt, cfg))
            elif name == "cold":
                samples[name].append(cold_once(model, prompt, cfg)[0])
            else:
                took, st = _redis_once(model, prompt, cfg, url)
                samples[name].append(took)
                reads.append(st)
    med = {k: statistics.median(v) for k, v in samples.items()}
    blocks = (len(prompt) - 1) // cfg.block_size
    kv_bytes = blocks * block_bytes
    read_s = statistics.median(r["read_s"] for r in reads)
    return {"median": med, "samples": samples, "prompt_tokens": len(prompt), "blocks": blocks,
            "kv_bytes": kv_bytes, "redis_hits": [r["hits"] for r in reads],
            "restore_MBps_redis_read": kv_bytes / read_s / 1e6 if read_s else None,
            "restore_MBps_ttft": kv_bytes / med["redis"] / 1e6,
            "speedup_vs_recompute": med["recompute"] / med["redis"],
            "ratio_to_cold": med["redis"] / med["cold"]}


def _prompt(model, n: int, seed: int) -> list[int]:
    import torch
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None) or 256
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_redis", description=__doc__.split("\n\n")[0])
    add_common_args(p, quick_help="the byte model, short loads (< 3 min on 2 cores)")
    p.add_argument("--model", choices=("byte", "smollm2"), default=None,
                   help="default: smollm2, byte with --quick")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="the cached prompt (default 1024)")
    p.add_argument("--load-s", type=float, default=None, help="seconds of the 16-client load")
    args = p.parse_args(argv)
    name = args.model or ("byte" if args.quick else "smollm2")
    model = _model(name)
    tokens = args.tokens or min(1024, model.context_len - 8)
    repeats = args.repeats or (3 if args.quick else 5)
    out: dict[str, Any] = {"model": name, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="fedkv-bench-redis-") as tmp:
        server = start_in(Path(tmp), "ttft")
        try:
            t = ttft_section(model, _prompt(model, tokens, args.seed), repeats, server.url)
        finally:
            server.stop()
        out.update({f"ttft_s.{k}": v for k, v in t["median"].items()})
        out["redis.restore_MBps"] = t["restore_MBps_redis_read"]
        out["redis.restore_MBps_ttft"] = t["restore_MBps_ttft"]
        out["ttft"] = t
        out.update(second_process_section(Path(tmp), name, args.quick))
        out.update(restart_section(Path(tmp), name, args.load_s or (20.0 if args.quick else 45.0)))
    out["targets"] = {
        "redis_5x_faster_than_recompute": t["speedup_vs_recompute"] >= 5,
        "redis_within_2x_of_cold": t["ratio_to_cold"] <= 2,
        "second_process_90pct_of_first": out["redis.second_vs_first"] >= 0.9,
        "no_failed_requests_during_restart": out["redis.failed_requests_during_restart"] == 0}
    run_dir = make_run_dir(args.out, "bench_redis")
    write_json(run_dir / "result.json", out)
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
