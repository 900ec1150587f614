"""BlockPool: the byte arena of quantized (int8/int4) blocks, cut into managed blocks (slabs).

Full-precision blocks live in ``cache.token_arena.TokenArena`` (head-major, read as views);
this pool holds the compact form of idle and cached blocks. Managed blocks are slabs: each
serves one size class and is cut into equal slots. A slot is its block's byte size rounded up
to a *page*, which is a 64 B granule (a cache line, ``CacheConfig.page_bytes``), not the
article's 4 KB. Allocation and release are O(1): a size class keeps the slabs that still have a
free slot; a slab that empties returns to the pool-wide free list. Blocks are handles (ints).

Which layers of the article's pool (superblock -> managed block -> page) are kept, measured on
this 2-core machine (issue 9, "Allocator"; arena bytes per token of a full block, i.e. slab
bytes / slots per slab / block_size, as ``cache.sizing.arena_bytes_per_token`` reports it):

* **Pages: 4 KB -> 64 B.** 4 KB pages gave an int8 block of the federation's model
  (``node.tasks.tasks.LM_MODEL``, 16-token blocks: 4,480 B) an 8,192 B slot, the size of fp16's.
  int8 / int4 vs fp16 arena bytes per token (fp16: 512 B on LM_MODEL, 4,096 B on the bench
  model):

  ========================================  =============  =============  =============
  config                                    LM_MODEL B=16  bench B=16     bench B=32
  ========================================  =============  =============  =============
  before: 4 KB pages, fp16 scales           1.000 / 0.500  0.571 / 0.314  0.533 / 0.286
  64 B pages, fp16 scales                   0.552 / 0.314  0.552 / 0.302  --
  4 KB pages, log8 scales                   1.000 / 0.500  0.571 / 0.314  --
  now: 64 B pages, log8 scales              0.533 / 0.291  0.533 / 0.281  0.516 / 0.271
  ========================================  =============  =============  =============

  (LM_MODEL at B=32: 0.762 / 0.500 before, 0.533 / 0.281 now.) Small pages alone do not reach
  int4 <= 0.30x: fp16 KIVI scales and zero points are 0.059x of fp16 on LM_MODEL, hence
  ``log8`` scales (``cache/quant.py``). A 16 B granule would give the same figures (the slab tail, not the
  granule, decides: 131,072 // 4,304 = 131,072 // 4,352 = 30 int8 slots). Alignment costs
  nothing measurable: one ``index_select`` of 64 int8 blocks' rows took 5.7 us with 64 B-aligned
  slots vs 6.2 us with 4 KB-aligned ones (decoding them: 138 us either way); allocate+free
  0.44 vs 0.45 us. Filling a 4 MB LM_MODEL pool with 256-token sessions (fp32 window of 32
  tokens each) now holds 11,040 int8 tokens instead of 7,168 and 16,128 int4 instead of 11,776
  (fp16: 8,192 either way).
* **Managed blocks (slabs): kept.** When this was measured they let five size classes (full
  precision, quantized, three tail sizes) share one arena with O(1) allocate/free (0.44 us per
  pair). Since full-precision blocks moved to the head-major TokenArena (so decode reads views
  instead of gathering), one class remains per cache and slabs are simply its allocation unit.
  The price is the slab tail: 30 x 4,352 of 131,072 B for int8 on
  LM_MODEL (99.6 % filled), 55 x 2,368 for int4 (99.4 %). Slab size vs int8 / int4 ratio on
  LM_MODEL: 16 KB 0.667 / 0.333, 32 KB 0.571 / 0.308, 128 KB (default) 0.533 / 0.291, 512 KB
  0.533 / 0.290 -- 128 KB is where the tail stops mattering.
* **Superblocks: dropped.** Nothing was allocated or tracked per superblock; their only effect
  was to round ``pool_bytes`` down to whole superblocks (a 3 MB pool got a 2 MB arena: 33 %
  lost; now the loss is under one managed block). Utilisation, fragmentation and free speed are
  unchanged without them. ``superblock_bytes`` is still accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cache.errors import ConfigError


def slot_bytes_for(nbytes: int, page_bytes: int) -> int:
    """A slot for an ``nbytes`` block: rounded up to whole pages (granules)."""
    return -(-nbytes // page_bytes) * page_bytes


class PoolExhausted(Exception):
    """Internal: no free slot in the class and no free slab (the engine checks has_room
    first and reclaims before it allocates)."""


@dataclass
class SizeClass:
    name: str
    slot_bytes: int
    slots_per_slab: int
    partial: dict[int, None] = field(default_factory=dict)  # slabs with a free slot (ordered set)


@dataclass
class _Slab:
    cls: str | None = None
    free: list[int] = field(default_factory=list)
    live: int = 0


class BlockPool:
    def __init__(
        self,
        pool_bytes: int,
        superblock_bytes: int | None = None,
        managed_block_bytes: int = 128 << 10,
        page_bytes: int = 64,
        pad_bytes: int = 0,
    ):
        """``superblock_bytes`` is accepted for compatibility and not used (see the module
        docstring); ``pad_bytes`` are extra arena bytes past the last slab."""
        if page_bytes <= 0 or managed_block_bytes % page_bytes:
            raise ConfigError("managed_block_bytes must be a multiple of page_bytes")
        self.num_slabs = pool_bytes // managed_block_bytes
        if self.num_slabs < 1:
            raise ConfigError(
                f"pool_bytes {pool_bytes} < one managed block {managed_block_bytes}")
        self.slab_bytes = managed_block_bytes
        self.page_bytes = page_bytes
        self.arena = torch.zeros(self.num_slabs * self.slab_bytes + pad_bytes, dtype=torch.uint8)
        self._slabs = [_Slab() for _ in range(self.num_slabs)]
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))  # pop() takes slab 0 first
        self.classes: dict[str, SizeClass] = {}
        # block handle -> (class, slab, index)
        self._loc: dict[int, tuple[str, int, int]] = {}
        self._free_handles: list[int] = []
        self._next_handle = 0

    # -- classes -------------------------------------------------------------------------
    def add_class(self, name: str, nbytes: int) -> SizeClass:
        """Register a size class whose blocks need ``nbytes``; slots round up to whole pages
        (64 B granules by default)."""
        slot = slot_bytes_for(nbytes, self.page_bytes)
        if slot > self.slab_bytes:
            raise ConfigError(
                f"a {name} block needs {nbytes} bytes, more than a managed block "
                f"({self.slab_bytes}); raise managed_block_bytes"
            )
        sc = SizeClass(name, slot, self.slab_bytes // slot)
        self.classes[name] = sc
        return sc

    def arena_bytes_per_block(self, name: str) -> float:
        """What one block of class ``name`` really costs in the arena: a managed block's
        bytes over the slots it holds (the slab's unusable tail counted)."""
        return self.slab_bytes / self.classes[name].slots_per_slab

    # -- allocation ----------------------------------------------------------------------
    def _take_slot(self, name: str) -> tuple[int, int]:
        sc = self.classes[name]
        if not sc.partial:
            if not self._free_slabs:
                raise PoolExhausted(name)
            s = self._free_slabs.pop()
            slab = self._slabs[s]
            slab.cls, slab.free, slab.live = name, list(range(sc.slots_per_slab - 1, -1, -1)), 0
            sc.partial[s] = None
        s = next(iter(sc.partial))
        slab = self._slabs[s]
        idx = slab.free.pop()
        slab.live += 1
        if not slab.free:
            del sc.partial[s]
        return s, idx

    def _give_slot(self, name: str, s: int, idx: int) -> None:
        sc, slab = self.classes[name], self._slabs[s]
        slab.free.append(idx)
        slab.live -= 1
        if slab.live == 0:
            sc.partial.pop(s, None)
            slab.cls, slab.free = None, []
            self._free_slabs.append(s)
        else:
            sc.partial[s] = None

    def allocate(self, name: str) -> int:
        """A slot of class ``name`` (a handle). Raises PoolExhausted when full. Reference
        counts are the ``Block`` record's, not the pool's."""
        s, idx = self._take_slot(name)
        h = self._free_handles.pop() if self._free_handles else self._new_handle()
        self._loc[h] = (name, s, idx)
        return h

    def _new_handle(self) -> int:
        self._next_handle += 1
        return self._next_handle - 1

    def free(self, h: int) -> None:
        if h not in self._loc:
            raise ValueError(f"block {h} is not allocated")
        self._give_slot(*self._loc.pop(h))
        self._free_handles.append(h)

    def location(self, h: int) -> tuple[str, int, int]:
        return self._loc[h]

    def slot_bytes_of(self, h: int) -> torch.Tensor:
        """The raw bytes of block ``h`` (a view into the arena)."""
        name, s, idx = self._loc[h]
        sc = self.classes[name]
        a = s * self.slab_bytes + idx * sc.slot_bytes
        return self.arena[a : a + sc.slot_bytes]

    # -- figures -------------------------------------------------------------------------
    @property
    def blocks(self) -> list[int]:
        return list(self._loc)

    def has_room(self, name: str) -> bool:
        """True when a block of class ``name`` can be allocated without reclaiming anything."""
        return bool(self.classes[name].partial) or bool(self._free_slabs)

    def slabs_in_use(self) -> int:
        return self.num_slabs - len(self._free_slabs)
