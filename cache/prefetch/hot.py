"""Applying predictions to a live cache's blocks: observe the blocks a lookup touched, then
restore the predicted ones from warm/cold into hot as unreferenced cached blocks, so the next
``match_prefix`` of them is a hot hit. A prefetched block takes hot room like any other (the
restore evicts the policy's victim): prefetching competes with demand blocks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from cache.prefetch.base import PrefetchError, Prefetcher, PrefetchLedger

if TYPE_CHECKING:
    from cache.manager import BlockManager

__all__ = ["prefetch_after_lookup", "prefetch_into_hot", "settle"]


def settle(blocks: "BlockManager", ledger: PrefetchLedger) -> None:
    """Count as wasted every pending prefetch that has left hot unused."""
    for key in [k for k in ledger.pending if k not in blocks.index]:
        ledger.evicted(key)


def prefetch_into_hot(blocks: "BlockManager", keys: Iterable[bytes],
                      ledger: PrefetchLedger | None = None) -> list[bytes]:
    """Restore each block of ``keys`` held in warm or cold into hot, as an unreferenced cached
    block (most recently used in the policy): its next ``match_prefix`` is a hot hit. Blocks
    already hot, held nowhere, or of another model version are skipped; when hot has no room
    the entry goes back to its tier and the rest are not fetched. Returns the keys fetched."""
    m = blocks
    if m.tiers is None:
        raise PrefetchError("this cache has no warm tier or cold store: nothing to prefetch from")
    fetched = []
    for h in keys:
        if h in m.index:
            continue
        e = m.tiers.take(h)
        if e is None:
            continue
        if e.version != m.version:  # as lookup: K/V of another version are never served
            continue
        if m.restore(h, e) is None:
            m.tiers.put(h, e)  # no room: nothing lost
            break
        fetched.append(h)
        if ledger is not None:
            ledger.issue(h, len(e.payload))
    return fetched


def prefetch_after_lookup(blocks: "BlockManager", prefetcher: Prefetcher,
                          keys: Iterable[bytes]) -> list[bytes]:
    """The engine hook: observe the block hashes a lookup touched (in order), then fetch what
    the prefetcher predicts into hot. Returns the keys fetched."""
    led = prefetcher.ledger
    for h in keys:
        led.access(h)
        prefetcher.observe(h)
    settle(blocks, led)
    return prefetch_into_hot(blocks, prefetcher.predict(blocks.index), led)
