"""Per-phase wall-clock accounting for one handler or one server round.

Why a class of its own: the results JSON must account for every second of a round (issue 13),
so the node handlers and the server loop time each phase the same way and report what the
phases leave unexplained (``other``) instead of silently dropping it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Sums the wall time spent in named phases since it was made; ``total`` covers all of it."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block under ``name`` (repeated phases add up), also when it raises."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    @property
    def total(self) -> float:
        """Seconds since the timer was made."""
        return time.perf_counter() - self._start

    def other(self, total: float | None = None) -> float:
        """Seconds of ``total`` (default: now) outside every named phase (never negative)."""
        total = self.total if total is None else total
        return max(0.0, total - sum(self.seconds.values()))
