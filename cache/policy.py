"""Which unreferenced cached block to reclaim first.

The engine tells a policy when a block becomes evictable (no session references it, but its
content is still cached for prefix hits), when it is touched again, and asks it for victims.
Later policies (LFU, the article's hybrid, adaptive) implement the same five methods.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol


class EvictionPolicy(Protocol):
    def add(self, block: int) -> None:
        """``block`` became evictable (refcount fell to 0 while it stays cached)."""

    def remove(self, block: int) -> None:
        """``block`` is referenced again (prefix hit) or was freed; no longer a candidate."""

    def victim(self) -> int | None:
        """The next block to reclaim, or None when nothing is evictable."""

    def candidates(self) -> Iterator[int]:
        """Evictable blocks, best victim first: the engine evicts the first ones that free
        room of the kind an allocation needs, not blindly the next victim."""

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently released first. The engine releases a session's blocks tail first, so
    among blocks released together the chain tails go before the shared roots (vLLM's order)."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def remove(self, block: int) -> None:
        self._order.pop(block, None)

    def victim(self) -> int | None:
        return next(iter(self._order), None)

    def candidates(self) -> Iterator[int]:
        return iter(self._order)  # the engine picks its victims before freeing any

    def __len__(self) -> int:
        return len(self._order)
