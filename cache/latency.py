"""Latency windows of the engine's operations: the last ``RING_SIZE`` durations per kind.

A ``collections.deque(maxlen=...)`` is the ring (appending is O(1) and drops the oldest), so
the percentiles describe recent behaviour and memory stays fixed; they are computed only when
someone asks (``KVCache.stats()``), never on the hot path. Timing one operation costs two
``perf_counter_ns`` calls and a deque append (``python -m cache overhead`` measures it on a
decode loop).
"""

from __future__ import annotations

from collections import deque

import numpy as np

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
