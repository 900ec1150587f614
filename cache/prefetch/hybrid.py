"""Prefetch mode ``hybrid``: runs ``sequential`` and ``heat`` side by side, scores each one's
predictions over a sliding window and follows the one that has been predicting better recently."""

from __future__ import annotations

import math
from collections.abc import Container

from cache.prefetch.base import PREFETCH_DEGREE, AccuracyWindow, Key, PrefetchError, Prefetcher
from cache.prefetch.heat import HeatPrefetcher
from cache.prefetch.sequential import SequentialPrefetcher

__all__ = ["HybridPrefetcher"]


class HybridPrefetcher(Prefetcher):
    """Sequential and heat side by side: both observe every access and predict, each one's
    predictions are scored by an :class:`AccuracyWindow`, and only the active one's are
    returned; the other takes over when its windowed accuracy is ``margin`` higher."""

    name = "hybrid"

    def __init__(self, degree: int = PREFETCH_DEGREE, window: int = 64, horizon: int | None = None,
                 margin: float = 0.05, seed: int = 0) -> None:
        super().__init__(degree)
        if not 0 <= margin < 1:
            raise PrefetchError(f"margin must be in [0, 1), got {margin!r}")
        horizon = horizon or 4 * degree
        self.modes: dict[str, Prefetcher] = {"sequential": SequentialPrefetcher(degree),
                                             "heat": HeatPrefetcher(degree, seed=seed)}
        self.scores = {n: AccuracyWindow(horizon, window) for n in self.modes}
        self.margin, self.active, self.switches = margin, "sequential", 0

    def observe(self, key: Key) -> None:
        for name, p in self.modes.items():
            p.observe(key)
            self.scores[name].observe(key)

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        preds = {}
        for name, p in self.modes.items():
            preds[name] = p.predict(resident)
            self.scores[name].record(preds[name])
        other = "heat" if self.active == "sequential" else "sequential"
        mine, theirs = self.scores[self.active].accuracy, self.scores[other].accuracy
        mine, theirs = (0.0 if math.isnan(a) else a for a in (mine, theirs))  # unknown: 0
        if theirs > mine + self.margin:
            self.active, self.switches = other, self.switches + 1
        return preds[self.active]

    def stats(self) -> dict:
        return super().stats() | {"active": self.active, "switches": self.switches}
