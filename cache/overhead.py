"""What the engine's instrumentation costs: a decode loop with and without it, in one run.

``python -m cache overhead [--quick]`` runs a cache-only decode loop (``reserve`` one token,
``append_and_read`` in every layer; no model, so this is the worst case: a real step adds the
model's compute to both sides) on one engine opened on a temporary directory. Steps alternate
between the timed methods (latency rings, live-control polling every ``POLL_S``, snapshots
every ``PUBLISH_S``) and the engine's untimed bodies called directly (no timing, no polling;
one call frame fewer than ``append_and_read`` itself, so the figure errs high). It reports
the median time per step of each and the median ratio of adjacent steps.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from cache.attention import attend
from cache.config import CacheConfig
from cache.engine import KVCache


@dataclass
class OverheadConfig:
    """One measurement's size (defaults: a few seconds; ``quick``: well under one)."""

    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 64
    steps: int = 256
    """Decode steps per session, alternating instrumented and bare step by step."""
    rounds: int = 24
    """Sessions (each closed after its steps; which variant goes first alternates)."""

    @classmethod
    def quick(cls) -> "OverheadConfig":
        return cls(steps=128, rounds=8)


def _bare_append_and_read(kv: KVCache, sid: int, layer: int, k: torch.Tensor,
                          v: torch.Tensor) -> list:
    kv.steps.write(kv.session_table.get(sid), layer, k, v)
    return kv.read_runs(sid, layer)


def _bare_reserve(kv: KVCache, sid: int, tokens: list[int]) -> None:
    kv.steps.reserve(kv.session_table.get(sid), tokens)


def _step(kv: KVCache, sid: int, token: int, k: torch.Tensor, bare: bool,
          attention: bool) -> int:
    """One decode step (reserve, then every layer, attending over its runs when
    ``attention``); its duration in ns."""
    reserve = _bare_reserve if bare else KVCache.reserve
    append = _bare_append_and_read if bare else KVCache.append_and_read
    start = time.perf_counter_ns()
    reserve(kv, sid, [token])
    for layer in range(kv.config.num_layers):
        runs = append(kv, sid, layer, k, k)
        if attention:
            attend(k, runs)
    return time.perf_counter_ns() - start


def _session(kv: KVCache, steps: int, first_bare: bool, attention: bool
             ) -> dict[str, list[int]]:
    """One session of ``steps`` decode steps alternating instrumented and bare, so both see
    the same context lengths and the same moment of a shared machine."""
    c = kv.config
    k = torch.randn(c.num_heads, 1, c.head_dim)
    out: dict[str, list[int]] = {"instrumented": [], "bare": []}
    sid = kv.open_session()
    for i in range(steps):
        bare = (i % 2 == 0) == first_bare
        out["bare" if bare else "instrumented"].append(_step(kv, sid, i, k, bare, attention))
    kv.close_session(sid)
    return out


def measure_overhead(cfg: OverheadConfig) -> dict[str, dict[str, float]]:
    """For the cache-only loop and the loop with attention: median microseconds per step
    instrumented and bare, and ``overhead``, the median over adjacent step pairs of
    instrumented / bare - 1."""
    return {"cache_only": _measure(cfg, attention=False),
            "with_attention": _measure(cfg, attention=True)}


def _measure(cfg: OverheadConfig, attention: bool) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # intra-op threads spin under a loaded machine: noise, not cost
    try:
        return _measure_single_thread(cfg, attention)
    finally:
        torch.set_num_threads(threads)


def _measure_single_thread(cfg: OverheadConfig, attention: bool) -> dict[str, float]:
    times: dict[str, list[int]] = {"instrumented": [], "bare": []}
    geometry = CacheConfig(num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                           head_dim=cfg.head_dim, pool_bytes=32 << 20, warm_bytes=4 << 20)
    with tempfile.TemporaryDirectory() as d:
        kv = KVCache.open(d, geometry)
        try:
            _session(kv, cfg.steps, True, attention)  # warm-up
            for r in range(cfg.rounds):
                for name, ts in _session(kv, cfg.steps, r % 2 == 0, attention).items():
                    times[name].extend(ts)
        finally:
            kv.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = [i / b for i, b in zip(times["instrumented"], times["bare"])]
    return {"instrumented_us_per_step": med["instrumented"] / 1e3,
            "bare_us_per_step": med["bare"] / 1e3,
            "overhead": statistics.median(ratios) - 1.0,
            "overhead_of_medians": med["instrumented"] / med["bare"] - 1.0,
            "steps": cfg.steps * cfg.rounds, "layers": cfg.num_layers}
