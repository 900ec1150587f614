"""Prefetch mode ``none``: never prefetches (the baseline)."""

from __future__ import annotations

from collections.abc import Container

from cache.prefetch.base import Key, Prefetcher

__all__ = ["NoPrefetch"]


class NoPrefetch(Prefetcher):
    """The baseline: never fetches ahead."""

    name = "none"

    def observe(self, key: Key) -> None:
        pass

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        return []
