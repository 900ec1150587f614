"""The session table: session id -> ``BlockTable`` (one session's logical -> physical block
map, its token history and read plan), and what happens to a session's blocks.

Ids are never reused, so a closed id is told apart from one never opened. A session turns
stale when the model moves past the version its K/V were computed under; its blocks are then
released and only ``reset`` makes it usable again. Releasing a table hands its blocks back to
the block manager, tails first (the LRU reclaims tails before shared roots).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from cache.block import Block
from cache.errors import (ClosedSessionError, LayerIndexError, ReservationError, StaleSessionError,
                          UnknownSessionError)
from cache.sparsity import SparsityPolicy

if TYPE_CHECKING:
    from cache.manager import BlockManager


@dataclass
class BlockTable:
    """Logical block i of the session is ``blocks[i]``.

    ``length`` tokens are complete (written in every layer); ``pending`` more are reserved and
    being written layer by layer (``written`` holds the layers done for them). ``runs`` is the
    read plan: ``[first slot, blocks]`` per run of consecutive arena slots, grown as blocks are
    appended and rebuilt only when a block of this table changes place.
    """

    sid: int
    block_size: int
    version: int
    blocks: list[Block | None] = field(default_factory=list)
    """``None`` marks a block the session's sparsity policy dropped (its memory is freed)."""
    tokens: list[int] = field(default_factory=list)
    length: int = 0
    pending: int = 0
    written: set[int] = field(default_factory=set)
    stale: bool = False
    last_access: int = 0
    quant_checked: int = 0  # blocks[:quant_checked] were quantized or kept full precision
    runs: list[list[int]] | None = None
    planned: int = 0  # blocks covered by runs
    plan_generation: int = -1
    gather: tuple[int, torch.Tensor | None] | None = None
    """(n, positions): the arena positions a scattered context's first ``n`` tokens are gathered
    from, None when they are not scattered; worked out by the first layer of a step, used by
    the rest, cleared whenever ``runs`` changes (``cache.steps.ReadPlanner``)."""
    write_at: slice | torch.Tensor | None = None  # arena token positions of the pending tokens
    sparsity: SparsityPolicy | None = None
    root: bytes = b""
    """Parent hash of block 0: ``cache.prefix.ROOT`` or the session's namespace root."""
    releases: int = 0
    """Times the session's blocks were released (reset, version move): part of a batch tail
    buffer's key, so a session refilled to the same length is gathered again, never served
    the K/V it held before (``cache.batch.TailBuffer``)."""

    def held(self) -> list[Block]:
        """The blocks the session still holds (dropped ones left out)."""
        return [b for b in self.blocks if b is not None]

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def layer_length(self, layer: int) -> int:
        """Tokens readable in ``layer``: complete ones, plus pending ones written there."""
        return self.length + (self.pending if layer in self.written else 0)

    def block_ids(self) -> set[int]:
        return {b.id for b in self.blocks if b is not None}

    def positions(self, start: int, n: int) -> slice | torch.Tensor:
        """Arena token positions of tokens [start, start + n): a slice when contiguous."""
        B = self.block_size
        pos = [self.blocks[p // B].start + p % B for p in range(start, start + n)]
        if all(b - a == 1 for a, b in zip(pos, pos[1:])):
            return slice(pos[0], pos[0] + n)
        return torch.tensor(pos)


def end_of(b: Block | None, block_size: int) -> int | None:
    """Where the block after ``b`` goes to continue its run (None: anywhere)."""
    return None if b is None or b.start is None else b.start + block_size


def check_layer(layer: int, num_layers: int) -> None:
    """LayerIndexError unless ``layer`` is an int in ``[0, num_layers)``."""
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise LayerIndexError(f"layer {layer!r} out of range: the cache has {num_layers} layers")


class SessionTable:
    def __init__(self, block_size: int, blocks: "BlockManager") -> None:
        self.block_size, self.blocks = block_size, blocks
        self.tables: dict[int, BlockTable] = {}
        """Open sessions by id. Read it directly only on a hot path that then falls back to
        ``get`` for anything but a live session (``KVCache._table``); change it only here."""
        self._next_sid = 0

    def __iter__(self) -> Iterator[BlockTable]:
        return iter(list(self.tables.values()))

    def __len__(self) -> int:
        return len(self.tables)

    def ids(self) -> list[int]:
        return list(self.tables)

    def open(self, sparsity: SparsityPolicy | None = None, root: bytes = b"") -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.tables[sid] = BlockTable(sid, self.block_size, self.blocks.version,
                                       sparsity=sparsity, root=root)
        return sid

    def get(self, sid: int, *, allow_stale: bool = False) -> BlockTable:
        t = self.tables.get(sid)
        if t is None:
            if isinstance(sid, int) and 0 <= sid < self._next_sid:  # ids are never reused
                raise ClosedSessionError(f"session {sid} is closed")
            raise UnknownSessionError(f"session {sid!r} was never opened in this cache")
        if t.stale and not allow_stale:
            raise StaleSessionError(
                f"session {sid} holds K/V of model version {t.version} but the model is at "
                f"version {self.blocks.version}; call reset_session({sid}) and prefill again")
        return t

    def close(self, sid: int) -> None:
        self.release(self.get(sid, allow_stale=True))
        del self.tables[sid]

    def reset(self, sid: int) -> list[int]:
        t = self.get(sid, allow_stale=True)
        toks = t.tokens[: t.length]
        self.release(t)
        t.tokens, t.length, t.version, t.stale = [], 0, self.blocks.version, False
        return toks

    def fork(self, sid: int) -> int:
        t = self.get(sid)
        if t.pending:
            raise ReservationError(f"session {sid} has {t.pending} reserved tokens not written")
        if t.sparsity is not None:
            raise ReservationError(f"session {sid} drops K/V (sparsity) and cannot be forked")
        child = self.open(root=t.root)
        c = self.tables[child]
        c.blocks, c.tokens, c.length = list(t.blocks), list(t.tokens), t.length
        c.quant_checked = t.quant_checked
        for b in c.blocks:
            self.blocks.ref(b)
        return child

    def release(self, t: BlockTable) -> None:
        t.releases += 1  # its tokens may come back with other K/V: no tail buffer continues
        for b in reversed(t.held()):  # tails first: LRU reclaims tails before shared roots
            self.blocks.unref(b)
        t.blocks, t.pending, t.written, t.runs, t.planned = [], 0, set(), None, 0
        t.quant_checked = 0
        t.tokens = t.tokens[: t.length]

    def unreserve(self, t: BlockTable, held: int) -> None:
        """Undo a reserve for a session that held ``held`` blocks before it: the new blocks
        are released, the reserved tokens forgotten."""
        for b in reversed(t.blocks[held:]):
            self.blocks.unref(b)
        del t.blocks[held:]
        t.tokens = t.tokens[: t.length]
        t.pending, t.written, t.write_at, t.runs = 0, set(), None, None

    def touch(self, t: BlockTable) -> None:
        self.blocks.clock += 1
        t.last_access = self.blocks.clock

    def mark_stale(self) -> None:
        """After a model version move: sessions whose K/V are no longer servable release
        their blocks and turn stale."""
        for t in self.tables.values():
            if not t.stale and not self.blocks.servable(t.version):
                self.release(t)
                t.stale = True

    def reclaim_read_buffer(self, keep: set[int]) -> bool:
        """Drop the decoded read buffer of the least recently used session (its quantized
        blocks stay); blocks in ``keep`` are never touched."""
        for t in sorted(self.tables.values(), key=lambda t: t.last_access):
            dropped = [self.blocks.drop_read_buffer(b) for b in t.held() if b.id not in keep]
            if any(dropped):
                return True
        return False
