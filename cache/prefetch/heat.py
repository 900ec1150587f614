"""Prefetch mode ``heat``: a decayed access-count table; a prediction draws a random sample of the
recent accesses (no sort of the whole table) and fetches the hottest drawn blocks not in hot
(knowledge retrieval: a hot set of documents)."""

from __future__ import annotations

import math
import random
from collections.abc import Container

from cache.prefetch.base import PREFETCH_DEGREE, BoundedMap, Key, Prefetcher, check_positive

__all__ = ["HeatPrefetcher"]


class HeatPrefetcher(Prefetcher):
    """Heat-table random sampling: every access adds 1 to a key's heat, which halves every
    ``half_life`` accesses; a prediction samples ``sample`` of the last ``recent`` accesses at
    random (so a block is drawn in proportion to how often it was used lately, and no sort of
    the table is needed) and returns the hottest drawn blocks not in hot whose heat reaches
    ``min_heat``. Sampling the table's keys uniformly instead drew almost only one-off blocks
    (they outnumber the hot set), and ``min_heat`` > 1 leaves out blocks used once, which on
    the Mooncake conversation trace made every heat prefetch a waste."""

    name = "heat"

    def __init__(self, degree: int = PREFETCH_DEGREE, sample: int = 16, half_life: float = 2048,
                 min_heat: float = 1.5, recent: int = 4096, history: int = 1 << 20,
                 seed: int = 0) -> None:
        super().__init__(degree)
        check_positive(sample=sample, half_life=half_life, history=history, min_heat=min_heat,
                        recent=recent)
        self.sample, self.half_life, self.min_heat = int(sample), float(half_life), float(min_heat)
        self.rng = random.Random(seed)
        self.step = 0
        self.heat: dict[Key, tuple[float, int]] = BoundedMap(int(history))
        """key -> (heat at step, step)."""
        self._recent: list[Key] = []
        self._size = int(recent)
        self.last: Key | None = None

    def heat_of(self, key: Key) -> float:
        h, at = self.heat.get(key, (0.0, self.step))
        return h * math.exp2((at - self.step) / self.half_life)

    def observe(self, key: Key) -> None:
        self.heat[key] = (self.heat_of(key) + 1.0, self.step)
        if len(self._recent) < self._size:
            self._recent.append(key)
        else:  # a ring: the slot of the access ``recent`` ago
            self._recent[self.step % self._size] = key
        self.step += 1
        self.last = key

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        if not self._recent:
            return []
        picks = {self.rng.choice(self._recent) for _ in range(self.sample)}
        heat = {k: self.heat_of(k) for k in picks if k != self.last and k not in resident}
        ranked = sorted((k for k in heat if heat[k] >= self.min_heat), key=heat.get, reverse=True)
        return ranked[: self.degree]
