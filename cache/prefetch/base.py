"""The one interface every prefetch mode implements (``Prefetcher``: ``observe`` an access,
``predict`` at most ``degree`` blocks to fetch, a ``ledger`` of what fetching them achieved),
and what the modes share: the ledger, a windowed accuracy score, a bounded map, the errors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Container, Hashable, Iterable
from dataclasses import dataclass, field

from cache.errors import CacheError

__all__ = ["AccuracyWindow", "BoundedMap", "Key", "PREFETCH_DEGREE", "PrefetchError", "PrefetchLedger",
           "Prefetcher", "check_positive"]

Key = Hashable
PREFETCH_DEGREE = 2
"""Blocks each prediction fetches at most (the issue's ``prefetch_degree``)."""


class PrefetchError(CacheError, ValueError):
    """A prefetcher argument out of range, an unknown mode, or a cache with nothing below hot."""


def check_positive(**values: float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise PrefetchError(f"{name} must be a positive number, got {v!r}")


@dataclass
class PrefetchLedger:
    """Issued, used and wasted prefetches (and their bytes). A prefetched block is *used* when
    it is accessed while still in hot, *wasted* when it leaves hot (or the replay ends) first."""

    issued: int = 0
    used: int = 0
    wasted: int = 0
    issued_bytes: int = 0
    used_bytes: int = 0
    wasted_bytes: int = 0
    pending: dict[Key, int] = field(default_factory=dict)
    """Prefetched blocks not used yet -> their bytes."""

    def issue(self, key: Key, nbytes: int) -> None:
        if key in self.pending:
            return
        self.pending[key] = int(nbytes)
        self.issued += 1
        self.issued_bytes += int(nbytes)

    def access(self, key: Key) -> bool:
        """An access of ``key``; True when it was an unused prefetch (now used)."""
        nbytes = self.pending.pop(key, None)
        if nbytes is None:
            return False
        self.used += 1
        self.used_bytes += nbytes
        return True

    def evicted(self, key: Key) -> None:
        """``key`` left hot; a pending prefetch of it was wasted."""
        nbytes = self.pending.pop(key, None)
        if nbytes is not None:
            self.wasted += 1
            self.wasted_bytes += nbytes

    def close(self) -> None:
        """End of a replay: what is still pending was never used (counted as wasted)."""
        for key in list(self.pending):
            self.evicted(key)

    @property
    def accuracy(self) -> float:
        """used / issued (nan before anything was issued)."""
        return self.used / self.issued if self.issued else float("nan")

    @property
    def wasted_fraction(self) -> float:
        """Wasted bytes / prefetched bytes (nan before anything was issued)."""
        return self.wasted_bytes / self.issued_bytes if self.issued_bytes else float("nan")


class AccuracyWindow:
    """Of the last ``window`` predictions, the share that was accessed within ``horizon``
    accesses of being made: how a predictor judges itself (or hybrid judges its modes)."""

    def __init__(self, horizon: int, window: int) -> None:
        check_positive(horizon=horizon, window=window)
        self.horizon, self.step = int(horizon), 0
        self.results: deque[bool] = deque(maxlen=int(window))
        self._open: dict[Key, int] = {}
        self._deadlines: deque[tuple[int, Key]] = deque()

    def record(self, keys: Iterable[Key]) -> None:
        for k in keys:
            if k not in self._open:
                self._open[k] = self.step + self.horizon
                self._deadlines.append((self.step + self.horizon, k))

    def observe(self, key: Key) -> None:
        self.step += 1
        if self._open.pop(key, None) is not None:
            self.results.append(True)
        while self._deadlines and self._deadlines[0][0] < self.step:
            deadline, k = self._deadlines.popleft()
            if self._open.get(k) == deadline:
                del self._open[k]
                self.results.append(False)

    def reset(self) -> None:
        self.results.clear()
        self._open.clear()
        self._deadlines.clear()

    @property
    def accuracy(self) -> float:
        """nan while nothing was resolved yet."""
        return sum(self.results) / len(self.results) if self.results else float("nan")


class Prefetcher(ABC):
    """Observe accesses, predict at most ``degree`` blocks to fetch; ``ledger`` counts the
    outcome of what a caller actually fetched."""

    name = "base"

    def __init__(self, degree: int = PREFETCH_DEGREE) -> None:
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise PrefetchError(f"prefetch_degree must be an int >= 1, got {degree!r}")
        self.degree = degree
        self.ledger = PrefetchLedger()

    @abstractmethod
    def observe(self, key: Key) -> None:
        """An access of block ``key``."""

    @abstractmethod
    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        """At most ``degree`` blocks to fetch next, none in ``resident`` (what hot holds)."""

    def stats(self) -> dict:
        led = self.ledger
        return {"mode": self.name, "degree": self.degree, "issued": led.issued, "used": led.used,
                "wasted": led.wasted, "issued_bytes": led.issued_bytes,
                "wasted_bytes": led.wasted_bytes, "accuracy": led.accuracy,
                "wasted_fraction": led.wasted_fraction}


class BoundedMap(dict):
    """A dict that forgets its oldest-inserted keys beyond ``limit`` (bounded predictor state)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            del self[next(iter(self))]
