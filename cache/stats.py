"""Figures of a KVCache: counters, block and byte accounting, utilisation, latency.

Counters and latency windows describe the statistics context, which starts at construction
and again at ``KVCache.reset_stats()``; byte, block and utilisation figures describe the
cache as it is now. A live engine's timer thread takes snapshots while the engine may be
operating (``cache/live.py``): containers are copied before they are walked. The figures are
read through ``StatsSource`` (what ``KVCache`` offers publicly), so this module never imports
the engine.

Latency windows (``OpLatencies``): the last ``RING_SIZE`` durations per kind of operation.

A ``collections.deque(maxlen=...)`` is the ring (appending is O(1) and drops the oldest), so
the percentiles describe recent behaviour and memory stays fixed; they are computed only when
someone asks (``KVCache.stats()``), never on the hot path. Timing one operation costs two
``perf_counter_ns`` calls and a deque append (``python -m cache overhead`` measures it on a
decode loop).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from cache.config import CacheConfig
    from cache.manager import BlockManager
    from cache.pool import BlockPool
    from cache.prefetch import Prefetcher
    from cache.tensor_store import TensorStore
    from cache.token_arena import TokenArena


OP_KINDS = ("lookup", "reserve", "write", "append_and_read", "batch_begin",
            "batch_append_and_read")
"""lookup = ``match_prefix``; the others are the engine methods of those names (a batch
step is one ``batch_begin`` plus one ``batch_append_and_read`` per layer)."""
RING_SIZE = 4096
"""Samples kept per kind: enough for a stable p99 (about 40 samples above it)."""


class OpLatencies:
    """Per-kind rings of durations (ns), one attribute per kind of ``OP_KINDS``: the engine
    appends to ``self.latency.<kind>`` directly (no method call or dict lookup on the hot
    path); no per-operation counter is kept, for the same reason."""

    __slots__ = ("size", *OP_KINDS)

    def __init__(self, size: int = RING_SIZE) -> None:
        self.size = size
        for kind in OP_KINDS:
            setattr(self, kind, deque(maxlen=size))

    @property
    def rings(self) -> dict[str, deque]:
        return {kind: getattr(self, kind) for kind in OP_KINDS}

    def record(self, kind: str, ns: int) -> None:
        getattr(self, kind).append(ns)

    def clear(self) -> None:
        for ring in self.rings.values():
            ring.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind: samples in the window (at most ``size``), p50 and p99 in microseconds
        (0.0 when nothing ran)."""
        out = {}
        for kind, ring in self.rings.items():
            p50 = p99 = 0.0
            if ring:
                p50, p99 = np.percentile(np.fromiter(ring, dtype=np.int64), [50, 99]) / 1e3
            out[kind] = {"samples": len(ring),
                         "p50_us": float(p50), "p99_us": float(p99)}
        return out


class StatsSource(Protocol):
    """What the figures are computed from (``KVCache`` is one)."""

    config: "CacheConfig"
    arena: "TokenArena"
    qpool: "BlockPool | None"
    blocks: "BlockManager"
    tensors: "TensorStore"
    latency: "OpLatencies"
    prefetcher: "Prefetcher | None"
    found_on_disk: int

    @property
    def full_precision_dtype(self) -> str: ...

    @property
    def context_age_s(self) -> float: ...

    @property
    def tail_buffer_bytes(self) -> int: ...

    def bytes_per_token(self, kv_dtype: str | None = None) -> float: ...

    def tunables(self) -> dict[str, Any]: ...

    def sessions(self) -> list[int]: ...


def _bytes(kv: "StatsSource") -> dict:
    """Bytes held per storage dtype, bytes whose token positions hold tokens, and the same
    for referenced blocks only; the read buffer is a full-precision copy of a quantized block
    (reads decode quantized blocks instead, so only a copy-on-write of one keeps one)."""
    m, B, fresh = kv.blocks, kv.config.block_size, kv.full_precision_dtype
    fp_block = kv.arena.block_bytes
    q_slot = kv.qpool.classes[kv.config.kv_dtype].slot_bytes if kv.qpool else 0
    q_tok = kv.bytes_per_token(kv.config.kv_dtype) if kv.qpool else 0.0
    held = {fresh: 0, **({kv.config.kv_dtype: 0} if kv.qpool else {})}
    tokens = live_tokens = live_held = buffer = 0.0
    for b in list(m.blocks.values()):  # one copy: a snapshot may run beside an operation
        here = there = 0.0
        if b.start is not None:
            fp = fp_block * b.capacity / B
            held[fresh] += fp
            here += fp
            there += fp_block / B * len(b.tokens)
            buffer += fp if b.qhandle is not None else 0
        if b.qhandle is not None:
            held[kv.config.kv_dtype] += q_slot
            here += q_slot
            there += q_tok * len(b.tokens)
        tokens += there
        if b.ref_count:
            live_tokens, live_held = live_tokens + there, live_held + here
    return {"held": held, "tokens": tokens, "live_tokens": live_tokens,
            "live_held": live_held, "buffer": buffer}


def _tier_stats(kv: "StatsSource", hot_bytes: float) -> dict:
    """Hits per tier (hot = prefix hits served without a promotion), swaps, bytes per tier."""
    t = kv.blocks.tiers
    if t is None:
        return {"tier_hits": {"hot": kv.blocks.counters["prefix_hit_blocks"]},
                "tier_bytes": {"hot": hot_bytes}}
    s = t.stats
    hot = kv.blocks.counters["prefix_hit_blocks"] - s.warm_hits - s.cold_hits - s.remote_hits
    hits = {"hot": hot, "warm": s.warm_hits, "cold": s.cold_hits}
    remote = getattr(t.cold, "remote_stats", None)
    if remote is not None:  # a shared (Redis) tier: its hits apart, its faults in "remote"
        hits["redis"] = s.remote_hits
    return {
        "tier_hits": hits,
        **({"remote": {**remote(), "unavailable": s.cold_unavailable}} if remote else {}),
        "tier_misses": s.misses,
        "swaps_in": s.swaps_in,
        "swaps_out": {"warm": s.swaps_out_warm, "cold": s.swaps_out_cold},
        "tier_dropped": s.dropped,
        "cold_corrupt_blocks": s.cold_corrupt,
        "cold_write_failures": s.cold_write_failures,
        "tier_bytes": {"hot": hot_bytes, **t.bytes_by_tier()},
        "found_on_disk": kv.found_on_disk,
    }


def _rates_and_use(kv: "StatsSource", tiers: dict, lookups: int, hot_tokens: float) -> dict:
    """Hit rate per tier (that tier's hits over block lookups: they sum to the prefix hit
    rate), swaps (tier moves in plus out), and how full each tier is: the hot arena's pages
    in use, the share of hot bytes holding tokens (``kv_utilisation``), warm bytes used."""
    t = kv.blocks.tiers
    hits = {"hot": 0, "warm": 0, "cold": 0, **tiers["tier_hits"]}
    swaps_in = tiers.get("swaps_in", 0)
    swaps_out = sum(tiers.get("swaps_out", {}).values())
    return {
        "hit_rate_by_tier": {k: v / lookups if lookups else 0.0 for k, v in hits.items()},
        "swaps": {"in": swaps_in, "out": swaps_out, "total": swaps_in + swaps_out},
        "utilisation": {
            "hot_arena": 1.0 - kv.arena.free_pages / kv.arena.num_pages,
            "hot_tokens": hot_tokens,
            "warm": t.warm_used / t.warm_bytes if t is not None and t.warm_bytes else 0.0,
        },
    }


def cache_stats(kv: "StatsSource") -> dict:
    m = kv.blocks
    c = m.counters
    by = _bytes(kv)
    live = sum(by["held"].values())
    lookups = c["prefix_hit_blocks"] + c["prefix_miss_blocks"]
    blocks = list(m.blocks.values())
    errors = [b.error for b in blocks if b.quantized]
    refs = [b.ref_count for b in blocks]
    tiers = _tier_stats(kv, live)
    return {
        **c,
        "prefix_hit_rate": c["prefix_hit_blocks"] / lookups if lookups else 0.0,
        "model_version": m.version,
        "sessions_open": len(kv.sessions()),
        "blocks_used": len(blocks),
        "blocks_referenced": sum(r > 0 for r in refs),
        "blocks_shared": sum(r > 1 for r in refs),
        "blocks_cached_unreferenced": len(m.policy),
        "blocks_free_fresh": kv.arena.free_pages * kv.arena.page // kv.config.block_size,
        "bytes_by_dtype": by["held"],
        "bytes_allocated": live,
        "bytes_holding_tokens": by["tokens"],
        "read_buffer_bytes": by["buffer"],
        "batch_tail_buffer_bytes": kv.tail_buffer_bytes,
        "bytes_stored": live - by["buffer"],  # the compact form: what idle sessions cost
        "kv_utilisation": by["tokens"] / live if live else 0.0,
        "kv_utilisation_live": by["live_tokens"] / by["live_held"] if by["live_held"] else 0.0,
        "mean_quant_error": sum(errors) / len(errors) if errors else 0.0,
        "tensor_bytes": kv.tensors.nbytes(),
        **tiers,
        "pool_arena_bytes": float(kv.config.pool_bytes),
        "pool_slot_fill": 1.0 - kv.arena.free_pages / kv.arena.num_pages,
        **_rates_and_use(kv, tiers, lookups, by["tokens"] / live if live else 0.0),
        "latency": kv.latency.summary(),
        "context_age_s": kv.context_age_s,
        "tunables": kv.tunables(),
        "prefetch": kv.prefetcher.stats() if kv.prefetcher is not None else None,
    }
