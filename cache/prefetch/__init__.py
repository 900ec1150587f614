"""Prefetch: predict which cached blocks are about to be used and move them from warm/cold to
hot before the access that needs them (the article's ``prefetch_engine.c``).

One small module per mode, all behind one interface (``base.Prefetcher``)::

    p = make_prefetcher("hybrid", degree=2)
    p.observe(key)                      # an access of block ``key`` (a hit or a computed block)
    keys = p.predict(resident=hot)      # at most ``degree`` blocks to fetch, none of them in hot
    p.ledger                            # issued / used / wasted prefetches and bytes

* ``none`` (``none.py``): never prefetches (the baseline);
* ``sequential`` (``sequential.py``): the next blocks along the block chain;
* ``heat`` (``heat.py``): the hottest of a random sample of recent accesses;
* ``hybrid`` (``hybrid.py``): sequential and heat scored side by side, the better one followed;
* ``lstm`` (``lstm.py``): a small torch LSTM over the last 8 accesses' address deltas.

On a live cache's block manager (``hot.py``): :func:`prefetch_after_lookup` observes the blocks
a lookup touched and restores the predicted ones into hot as unreferenced cached blocks, so the
next ``match_prefix`` of them is a hot hit.
"""

from __future__ import annotations

from collections.abc import Callable

from cache.prefetch.base import (
    PREFETCH_DEGREE, AccuracyWindow, Key, PrefetchError, Prefetcher, PrefetchLedger,
)
from cache.prefetch.heat import HeatPrefetcher
from cache.prefetch.hot import prefetch_after_lookup, prefetch_into_hot, settle
from cache.prefetch.hybrid import HybridPrefetcher
from cache.prefetch.lstm import AccessOrder, LstmConfig, LstmPrefetcher
from cache.prefetch.none import NoPrefetch
from cache.prefetch.sequential import SequentialPrefetcher

__all__ = [
    "AccessOrder", "AccuracyWindow", "HeatPrefetcher", "HybridPrefetcher", "Key", "LstmConfig",
    "LstmPrefetcher", "MODES", "NoPrefetch", "PREFETCH_DEGREE", "PREFETCH_MODES", "PrefetchError",
    "PrefetchLedger", "Prefetcher", "SequentialPrefetcher", "make_prefetcher",
    "prefetch_after_lookup", "prefetch_into_hot", "settle",
]

MODES: dict[str, Callable[[int, int], Prefetcher]] = {
    "none": lambda degree, seed: NoPrefetch(degree),
    "sequential": lambda degree, seed: SequentialPrefetcher(degree),
    "heat": lambda degree, seed: HeatPrefetcher(degree, seed=seed),
    "hybrid": lambda degree, seed: HybridPrefetcher(degree, seed=seed),
    "lstm": lambda degree, seed: LstmPrefetcher(degree, LstmConfig(seed=seed)),
}
"""Mode name -> a factory ``(degree, seed) -> Prefetcher``."""
PREFETCH_MODES = tuple(MODES)


def make_prefetcher(mode: str, degree: int = PREFETCH_DEGREE, seed: int = 0) -> Prefetcher:
    """A prefetcher by mode name (``PREFETCH_MODES``)."""
    factory = MODES.get(mode) if isinstance(mode, str) else None
    if factory is None:
        raise PrefetchError(f"prefetch mode must be one of {PREFETCH_MODES}, got {mode!r}")
    return factory(degree, seed)
