"""Prefetch mode ``sequential``: the blocks ``stride .. stride + degree - 1`` steps ahead along the
block chain (a block's successor is the block that followed it last time: a conversation's next
turn re-reads its history in order)."""

from __future__ import annotations

from collections.abc import Container

from cache.prefetch.base import PREFETCH_DEGREE, BoundedMap, Key, PrefetchError, Prefetcher, check_positive

__all__ = ["SequentialPrefetcher"]


class SequentialPrefetcher(Prefetcher):
    """Fixed stride ahead along the block chain: after an access of ``k``, the blocks
    ``stride .. stride + degree - 1`` successors later, where a block's successor is the block
    that followed it the last time it was used (block hashes have no address order; the chain
    is what a conversation re-reads)."""

    name = "sequential"

    def __init__(self, degree: int = PREFETCH_DEGREE, stride: int = 1, history: int = 1 << 20
                 ) -> None:
        super().__init__(degree)
        check_positive(stride=stride, history=history)
        if not isinstance(stride, int):
            raise PrefetchError(f"stride must be an int >= 1, got {stride!r}")
        self.stride = stride
        self.successor: dict[Key, Key] = BoundedMap(int(history))
        self.last: Key | None = None

    def observe(self, key: Key) -> None:
        if self.last is not None and self.last != key:
            self.successor[self.last] = key
        self.last = key

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        out: list[Key] = []
        k, seen = self.last, {self.last}
        for step in range(1, self.stride + self.degree):
            k = self.successor.get(k)
            if k is None or k in seen:  # chain ends or loops back
                break
            seen.add(k)
            if step >= self.stride and k not in resident:
                out.append(k)
        return out
