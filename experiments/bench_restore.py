"""Restore vs recompute (issue 10 item 8): bring a 1,024-token prefix back from the warm tier
(CPU bytes) or the cold tier (an encrypted segment store on disk, memory-mapped) instead of
recomputing its prefill. Used by ``experiments.bench_kv`` (section ``restore_vs_recompute``).

Each contender prefills the same prompt through ``TinyTransformer.prefill`` (which reuses any
cached prefix and computes the rest); restore runs find the prefix's full blocks in warm or
cold, recompute runs find nothing. Runs are interleaved and repeated; medians are reported.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from typing import Callable

from cache import CacheConfig, KVCache
from node.models.byte_model import TinyTransformer

KEY = bytes(32)
"""A fixed AES key: the benchmark measures the cost of encryption, not key handling."""


def _config(model: TinyTransformer, block: int, tokens: int) -> CacheConfig:
    per_token = 2 * model.cfg.n_layers * model.cfg.d_model * 4
    need = 4 * tokens * per_token + (4 << 20)
    return model.cfg.cache_config(block_size=block, pool_bytes=need, warm_bytes=need)


def _timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def recompute_once(model: TinyTransformer, prompt: list[int], cfg: CacheConfig) -> float:
    kv = KVCache(cfg)
    return _timed(lambda: model.prefill(prompt, kv, kv.open_session()))


def warm_once(model: TinyTransformer, prompt: list[int], cfg: CacheConfig) -> float:
    kv = KVCache(cfg)
    s = kv.open_session()
    model.prefill(prompt, kv, s)
    kv.close_session(s)
    kv.offload("warm")
    return _timed(lambda: model.prefill(prompt, kv, kv.open_session()))


def cold_once(model: TinyTransformer, prompt: list[int], cfg: CacheConfig) -> tuple[float, float]:
    """(restore seconds, open seconds): a process-like restart between write and read."""
    with tempfile.TemporaryDirectory(prefix="fedkv-restore-") as d:
        kv = KVCache.open(d, cfg, key=KEY)
        s = kv.open_session()
        model.prefill(prompt, kv, s)
        kv.close_session(s)
        kv.offload("cold")
        kv.close()
        t0 = time.perf_counter()
        kv2 = KVCache.open(d, _no_prewarm(cfg), key=KEY)
        opened = time.perf_counter() - t0
        restore = _timed(lambda: model.prefill(prompt, kv2, kv2.open_session()))
        kv2.close()
    return restore, opened


def _no_prewarm(cfg: CacheConfig) -> CacheConfig:
    """Cold means read from the segment files, not copied to warm at open."""
    import dataclasses
    return dataclasses.replace(cfg, warmup_ratio=0.0)


def disk_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=5)
        dev, fstype = out.stdout.strip().splitlines()[-1].split()[:2]
        return f"{fstype} on {dev} ({path})"
    except Exception:  # noqa: BLE001 -- a description only
        return f"unknown ({path})"


def restore_section(model: TinyTransformer, prompt: list[int], block: int, repeats: int) -> dict:
    cfg = _config(model, block, len(prompt))
    samples: dict[str, list[float]] = {"recompute": [], "warm": [], "cold": [], "cold_open": []}
    for _ in range(repeats):  # interleaved: each repeat runs all three
        samples["recompute"].append(recompute_once(model, prompt, cfg))
        samples["warm"].append(warm_once(model, prompt, cfg))
        restore, opened = cold_once(model, prompt, cfg)
        samples["cold"].append(restore)
        samples["cold_open"].append(opened)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "warm_speedup": med["recompute"] / med["warm"],
        "cold_speedup": med["recompute"] / med["cold"],
        "cold_speedup_incl_open": med["recompute"] / (med["cold"] + med["cold_open"]),
        "seconds_median": med,
        "samples": samples,
        "prefix_tokens": len(prompt),
        "block_size": block,
        "repeats": repeats,
        "disk": disk_of(tempfile.gettempdir()),
        "note": "restore = prefill through a cache whose prefix blocks sit in warm (CPU bytes) "
                "or cold (AES-GCM segment files, memory-mapped, opened in a fresh KVCache with "
                "no prewarm; open time reported apart); the last partial block is computed "
                "in every contender",
    }
