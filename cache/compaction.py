"""Reclamation: lazy mark-and-sweep plus compaction of sessions' runs.

Mark: every block a session table or the prefix index references. Sweep: anything else the
manager still holds is freed (a leak would show up here; the counter should stay 0).
Compaction: a session whose own blocks (refcount 1, the tail of its table) are spread over
several runs is moved into one free gap, so its decode reads one view again (the copy-free
path of ``cache/attention.py``). The functions take the pieces they work on (the block
manager, the arena, the session tables), never the engine. Triggers (``cache/pressure.py``):
free arena memory below ``CacheConfig.low_watermark``, at most once per ``COMPACT_EVERY``
reserves; three allocation failures in a row; and every ``flush()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache.session_table import BlockTable
    from cache.manager import BlockManager
    from cache.token_arena import TokenArena

COMPACT_EVERY = 64
"""Reserves between two watermark-triggered compactions: compaction is lazy."""


def sweep(m: "BlockManager", tables: Iterable["BlockTable"]) -> int:
    """Free blocks nothing references (neither a table nor the index); returns how many."""
    marked = {b.id for t in tables for b in t.held()}
    marked |= {b.id for b in m.index.values()}
    leaked = [b for b in m.blocks.values() if b.id not in marked]
    for b in leaked:
        b.ref_count = 0
        m.free(b)
    return len(leaked)


def own_suffix(t: "BlockTable") -> list:
    """The session's private tail: the last blocks with refcount 1, in order."""
    out = []
    for b in reversed(t.blocks):
        if b is None or b.ref_count != 1 or b.start is None:
            break
        out.append(b)
    return out[::-1]


def _runs_of(blocks: list, B: int) -> int:
    return 1 + sum(1 for a, b in zip(blocks, blocks[1:]) if a.start + B != b.start)


def compact_session(m: "BlockManager", arena: "TokenArena", t: "BlockTable") -> int:
    """Move the session's private blocks into one gap if they span several runs; returns
    the number of blocks moved (0 when they already form one run or no gap fits)."""
    B = t.block_size
    blocks = own_suffix(t)
    if len(blocks) < 2 or _runs_of(blocks, B) == 1:
        return 0
    start = arena.allocate((len(blocks) - 1) * B + blocks[-1].capacity)
    if start is None:
        return 0
    for i, b in enumerate(blocks):  # every block but the last is full (capacity B)
        dst = start + i * B
        arena.block(dst, b.capacity).copy_(arena.block(b.start, b.capacity))
        arena.free(b.start, b.capacity)
        b.start = dst
    t.runs = None
    m.generation += 1
    if t.pending:
        t.write_at = t.positions(t.length, t.pending)
    return len(blocks)


def compact(m: "BlockManager", arena: "TokenArena", tables: Iterable["BlockTable"]
            ) -> dict[str, int]:
    """Sweep, then compact every session; counters go to ``stats()``."""
    tables = list(tables)
    c = m.counters
    swept = sweep(m, tables)
    moved = sum(compact_session(m, arena, t) for t in tables)
    c["compactions"] += 1
    c["compacted_blocks"] += moved
    c["swept_blocks"] += swept
    return {"moved": moved, "swept": swept}
