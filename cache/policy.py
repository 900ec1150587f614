"""Which unreferenced cached block to reclaim first: policies keyed by content hash.

A block is evictable when no session references it but its content stays cached for prefix
hits. The engine tells the policy when a block becomes evictable (``insert``), when it stops
being one (``remove``: referenced again or freed) and about every hit, also on referenced
blocks (``hit``), and asks for ``victims(n)``. Keys are content hashes, which outlive the
block that held them, so a policy may keep history (ARC's ghost lists, LFU counts) across
evictions. The engine never offers a referenced block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: bytes) -> None:
        """The block with content ``key`` became evictable."""

    def remove(self, key: bytes) -> None:
        """``key`` is referenced again or its block was freed: not a candidate any more."""

    def hit(self, key: bytes) -> None:
        """A prefix hit on ``key`` (evictable or not)."""

    def victims(self, n: int) -> list[bytes]:
        """Up to ``n`` evictable keys, best victim first (the engine then frees them)."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first. The engine releases a session's blocks tail first, so among
    blocks released together the chain tails go before the shared roots (vLLM's order)."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def hit(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def victims(self, n: int) -> list[bytes]:
        out = []
        for key in self._order:
            if len(out) == n:
                break
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
