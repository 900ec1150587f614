"""BlockManager: allocate, free, copy-on-write, prefix match and dedup over Block records.

One ``Block`` per physical block, one hash index (content address -> block), one eviction
policy keyed by content hash, one model-version counter. Storage is two places: the
full-precision TokenArena (``Block.start``/``capacity``) and, in quantized caches, the BlockPool of
quantized blocks (``Block.qhandle``). A referenced block always has one of them; an
unreferenced block exists only while it is a prefix-cache entry (hashed, in the index, in the
policy) and then keeps its quantized copy alone when it has one.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

import torch

from cache.block import Block
from cache.errors import CacheFullError
from cache.pool import BlockPool
from cache.prefix import ROOT, block_hash
from cache.policy import EvictionPolicy
from cache.quant import FULL_PRECISION, BlockFormat, relative_error
from cache.tiers import TierEntry, Tiers
from cache.token_arena import TokenArena

COUNTERS = ("prefix_lookups", "prefix_hit_blocks", "prefix_miss_blocks", "prefix_hit_tokens",
            "evictions", "cow_copies", "tail_moves", "dedup_blocks", "quantized_blocks",
            "kept_full_precision_blocks", "quant_skipped_full", "dequantized_blocks",
            "read_buffer_evictions", "transient_reads", "sparsity_dropped_blocks",
            "compactions", "compacted_blocks", "swept_blocks", "pressure_demotions", "alloc_failures", "eviction_collateral",
            "stale_hit_tokens", "invalidated_blocks")


class BlockManager:
    def __init__(self, arena: TokenArena, policy: EvictionPolicy,
                 qpool: BlockPool | None = None, qformat: BlockFormat | None = None):
        self.arena, self.policy, self.qpool, self.qformat = arena, policy, qpool, qformat
        self.blocks: dict[int, Block] = {}
        self.index: dict[bytes, Block] = {}  # faster than a cuckoo table: experiments/cuckoo_index.py
        self.version = 0
        self.clock = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.reclaim_fp: Callable[[set[int]], bool] = lambda keep: False
        """Set by the engine: drop some session's read buffer (never one in ``keep``); False
        when there is none to drop (reads decode quantized blocks; only a copy-on-write of
        a quantized block leaves a buffer)."""
        self.tiers: Tiers | None = None
        """Warm/cold tiers below hot (``cache/tiers.py``); None: evicted blocks are freed."""
        self.keep_versions = 0
        """Older model versions whose K/V stay servable (``CacheConfig.stale_versions``)."""
        self.invalidated: set[bytes] = set()
        """Hashes of blocks version moves made unservable, until ``take_invalidated``."""
        self.invalidated_versions: set[int] = set()
        self.generation = 0
        """Bumped when a referenced block loses its full-precision slot (read plans rebuild)."""
        self._next_id = 0

    # -- storage -----------------------------------------------------------------------
    def _fp_room(self, tokens: int, after: int | None, keep: set[int]) -> int:
        """Arena room for ``tokens`` (its start); evicts cached blocks, then read buffers
        (the least recently used session's first; any session's, since reads decode a
        quantized block without one), until it fits."""
        evicted = 0
        try:
            while True:
                s = self.arena.allocate(tokens, after)
                if s is not None:
                    return s
                if self._evict_cached(lambda b: b.start is not None):
                    evicted += 1
                elif not self.reclaim_fp(keep):
                    raise CacheFullError(
                        f"cache full: the full-precision arena ({self.arena.num_blocks} "
                        f"blocks) holds only blocks of open sessions; close sessions or grow "
                        f"pool_bytes")
        finally:
            self._note_collateral(evicted)

    def room_for_run(self, tokens: int) -> int | None:
        """Start of room for ``tokens`` laid end to end (a session's new blocks): a free gap
        (``TokenArena.free_run``), else made by evicting the cached blocks of the run whose
        most recently used one is the least recent (``TokenArena.oldest_run``) -- no more
        evictions than placing the blocks one by one would make, but chosen by place, not
        strictly by the policy's order. None where no such run exists (nothing evicted). One
        by one in a full arena, each new block goes wherever its victim was, and a decode
        step then reads the context in one-block runs (``KVCache.arena_step``)."""
        a = self.arena
        if (free := a.free_run(tokens)) is not None:
            return free
        one_by_one = -(-tokens // a.B) - a.placeable(a.B)  # the victims they would take
        order = [self.index[k] for k in self.policy.victims(len(self.index))]
        start = a.oldest_run(tokens, [(b.start, b.capacity, r) for r, b in enumerate(order)
                                      if b.start is not None], one_by_one * a.B)
        if start is None:
            return None
        end = start + a.capacity_for(tokens)
        targets = [b for b in order
                   if b.start is not None and b.start < end and b.start + b.capacity > start]
        if len(targets) > one_by_one:  # blocks straddling the run's ends
            return None
        for b in targets:  # in the policy's order
            self._evict(b)
        self._note_collateral(min(len(targets), 1))
        return start

    def _q_handle(self) -> int | None:
        """A quantized-pool handle, evicting one cached quantized block if needed; None when
        every quantized block is referenced."""
        evicted = 0
        while not self.qpool.has_room(self.qformat.kv_dtype):
            if not self._evict_cached(lambda b: b.qhandle is not None):
                self._note_collateral(evicted)
                return None
            evicted += 1
        self._note_collateral(evicted)
        return self.qpool.allocate(self.qformat.kv_dtype)

    def _note_collateral(self, evicted: int) -> None:
        """``eviction_collateral``: the most cached blocks evicted to make room for ONE
        allocation (one block's arena slot, or one quantized slot), the max over allocations
        since the counters were last zeroed. The engine caches full blocks only, so evicting
        one makes room for any single allocation: 1 is what an allocation in a full pool
        costs (so this engine meets "<= 1" by construction today; the counter is what shows
        it when that changes), and more means prefix-cache entries thrown away that the allocation did not need --
        victims whose freed space was not where the allocation fits (victims smaller than
        the allocation, scattered pages). That is why the target is "<= 1" and why it is a
        max per allocation, not a total (``evictions`` counts the total) nor a count per
        ``reserve`` (a reserve of n blocks in a full pool legitimately evicts n)."""
        if evicted > self.counters["eviction_collateral"]:
            self.counters["eviction_collateral"] = evicted

    def _evict_cached(self, frees: Callable[[Block], bool]) -> bool:
        """Free the policy's first cached block for which ``frees`` holds (victims asked in
        growing batches: heap policies pay O(n log n) per ``victims(n)``)."""
        for key in self._victims_lazily():
            b = self.index[key]
            if frees(b):
                self._evict(b)
                return True
        return False

    def _evict(self, b: Block) -> None:
        """Drop the cached block ``b`` (to the warm tier when there is one)."""
        if self.tiers is not None:
            self.tiers.put(b.hash, self.entry(b))
        self.free(b)
        self.counters["evictions"] += 1

    def _victims_lazily(self):
        n, seen = 1, 0
        while True:
            keys = self.policy.victims(n)
            yield from keys[seen:]
            if len(keys) < n:
                return
            seen, n = len(keys), n * 4

    # -- lifecycle ---------------------------------------------------------------------
    def new(self, tokens: int, after: int | None = None, keep: set[int] = frozenset()) -> Block:
        """A fresh full-precision block (refcount 1) with room for ``tokens`` (whole pages),
        placed at arena position ``after`` (the previous block's end) if free."""
        start = self._fp_room(tokens, after, keep)
        b = Block(self._next_id, self.version, start=start,
                  capacity=self.arena.capacity_for(tokens), format=self.fp_format,
                  last_access=self.clock)
        self._next_id += 1
        self.blocks[b.id] = b
        return b

    @property
    def fp_format(self) -> str:
        """The arena's storage format (a name of ``cache.quant.FULL_PRECISION``)."""
        return next(n for n, t in FULL_PRECISION.items() if t == self.arena.kv.dtype)

    def ref(self, b: Block) -> None:
        b.ref_count += 1
        if b.ref_count == 1 and b.hash is not None:
            self.policy.remove(b.hash)

    def unref(self, b: Block) -> None:
        if b.ref_count <= 0:
            raise ValueError(f"block {b.id}: refcount would become negative")
        b.ref_count -= 1
        if b.ref_count:
            return
        if b.hash is not None and self.index.get(b.hash) is b:
            if b.qhandle is not None and b.start is not None:  # idle: keep the compact form
                self._drop_slot(b)
            self.policy.insert(b.hash, b.parent_hash)  # still a prefix-cache entry
        else:
            self.free(b)

    def free(self, b: Block) -> None:
        if b.hash is not None and self.index.get(b.hash) is b:
            del self.index[b.hash]
            self.policy.remove(b.hash)
        if b.start is not None:
            self.arena.free(b.start, b.capacity)
        if b.qhandle is not None:
            self.qpool.free(b.qhandle)
        b.start = b.qhandle = None
        del self.blocks[b.id]

    def _drop_slot(self, b: Block) -> None:
        self.arena.free(b.start, b.capacity)
        b.start, b.capacity = None, 0
        if b.ref_count:
            self.generation += 1

    def reclaimable_fp_blocks(self) -> int:
        """Arena-resident blocks ``_fp_room`` can take back without losing a session's only
        copy of anything: cached blocks no session holds, and read buffers of quantized
        blocks (a quantized cached block outside the arena frees no arena page)."""
        return sum(1 for b in self.blocks.values()
                   if b.start is not None and (b.ref_count == 0 or b.qhandle is not None))

    def drop_read_buffer(self, b: Block) -> bool:
        """Drop the full-precision copy of a quantized block (its compact form stays)."""
        if b.start is None or b.qhandle is None:
            return False
        self._drop_slot(b)
        self.counters["read_buffer_evictions"] += 1
        return True

    def copy(self, b: Block, n: int, tokens: int, after: int | None, keep: set[int]) -> Block:
        """Copy-on-write (or a move to more room): a new block with room for ``tokens``
        holding the first ``n`` tokens of ``b``."""
        self.ensure_fp(b, None, keep)
        new = self.new(tokens, after, keep | {b.id})
        self.arena.block(new.start, n).copy_(self.arena.block(b.start, n))
        new.tokens, new.version = list(b.tokens[:n]), b.version
        return new

    def grow(self, b: Block, tokens: int) -> bool:
        """Room for ``tokens`` in ``b`` in place (the pages after it); False if taken."""
        if not self.arena.grow(b.start, b.capacity, tokens):
            return False
        b.capacity = max(b.capacity, self.arena.capacity_for(tokens))
        return True

    # -- tiers ---------------------------------------------------------------------------
    def demote(self, n: int) -> int:
        """Move up to ``n`` of the policy's first victims to the tiers (one ``victims``
        call: batch eviction); returns how many moved."""
        keys = self.policy.victims(n)
        for key in keys:
            b = self.index[key]
            self.tiers.put(key, self.entry(b))
            self.free(b)
        return len(keys)

    def entry(self, b: Block) -> TierEntry:
        """``b``'s bytes in its storage format (quantized if it has a compact form)."""
        L = self._layers
        if b.qhandle is not None:
            raw = self.qpool.slot_bytes_of(b.qhandle)[: self.qformat.layer_bytes * L]
            payload, fmt = raw.numpy().tobytes(), self.qformat.kv_dtype
        else:
            payload, fmt = self.arena.block(b.start).contiguous().view(torch.uint8).numpy().tobytes(), self.fp_format
        return TierEntry(payload, list(b.tokens), b.version, b.parent_hash or b"", fmt, 0.0,
                         b.last_access, b.frequency, dirty=b.dirty)

    def restore(self, h: bytes, e: TierEntry, after: int | None = None) -> Block | None:
        """A hot, cached (unreferenced) block from a tier entry; None when hot has no room or
        the entry is in a form this cache cannot hold (a shared tier may hold another node's
        quantized format, or a payload of the wrong size). Full-precision entries of another
        precision (a cache rebuilt with another ``kv_dtype``) are converted into the arena's."""
        if not self._holdable(e):
            return None
        b = Block(self._next_id, e.version, tokens=list(e.tokens), ref_count=0, hash=h,
                  parent_hash=e.parent, format=e.format, last_access=self.clock,
                  frequency=e.frequency, dirty=e.dirty)
        data = torch.frombuffer(bytearray(e.payload), dtype=torch.uint8)
        try:
            if self.qformat is not None and e.format == self.qformat.kv_dtype:
                b.qhandle = self._q_handle()
                if b.qhandle is None:
                    return None
                self.qpool.slot_bytes_of(b.qhandle)[: data.numel()].copy_(data)
            else:
                b.start, b.capacity = self._fp_room(self.arena.B, after, set()), self.arena.B
                dst = self.arena.block(b.start)
                dst.copy_(data.view(FULL_PRECISION[e.format]).view(dst.shape))
        except CacheFullError:
            return None
        self._next_id += 1
        self.blocks[b.id] = b
        self.index[h] = b
        self.policy.insert(h)
        return b

    def _holdable(self, e: TierEntry) -> bool:
        """``e`` is a block this cache can restore: its quantized format, or a full block of a
        full-precision one, its payload of that size."""
        if self.qformat is not None and e.format == self.qformat.kv_dtype:
            return len(e.payload) == self.qformat.layer_bytes * self._layers
        if e.format not in FULL_PRECISION:
            return False
        values = self.arena.block_bytes // self.arena.kv.element_size()
        return len(e.payload) == values * FULL_PRECISION[e.format].itemsize

    # -- prefix cache --------------------------------------------------------------------
    def lookup(self, parent: bytes, tokens: list[int], after: int | None = None) -> Block | None:
        """The cached block holding ``tokens`` after ``parent`` under the current version
        (promoted from warm or cold when it was demoted, placed at arena position ``after``
        if free, so a restored chain is one run)."""
        for version in range(self.version, max(-1, self.version - self.keep_versions - 1), -1):
            b = self._find(block_hash(parent, tokens, version), tokens, version, after)
            if b is not None:
                break
        else:
            return None
        if b.version != self.version:
            self.counters["stale_hit_tokens"] += len(tokens)
        self.policy.hit(b.hash)
        b.frequency += 1
        b.last_access = self.clock
        return b

    def prefetch_chain(self, parent: bytes, tokens: list[int]) -> None:
        """Before ``lookup`` walks the full blocks of ``tokens``: with a shared cold store,
        fetch every chained hash the walk may ask for (each servable version) in one batch."""
        if self.tiers is None or not self.tiers.shared:
            return
        B, keys = self.arena.B, []
        for version in range(self.version, max(-1, self.version - self.keep_versions - 1), -1):
            h = parent
            for i in range((len(tokens) - 1) // B):
                h = block_hash(h, tokens[i * B : (i + 1) * B], version)
                if h not in self.index:
                    keys.append(h)
        if keys:
            self.tiers.prefetch(keys)

    def publish(self, b: Block) -> None:
        """A block just hashed: written through to a shared cold store (when there is one)."""
        if self.tiers is not None and self.tiers.shared and b.hash is not None:
            self.tiers.publish(b.hash, self.entry(b))

    def peek(self, parent: bytes, tokens: list[int]) -> bytes | None:
        """The hash ``lookup`` would find ``tokens`` under in the hot or warm tier (current
        version only), without promoting, placing or counting anything; None if absent."""
        h = block_hash(parent, tokens, self.version)
        b = self.index.get(h)
        if b is not None:
            return h if b.tokens == tokens else None
        warm = self.tiers.warm if self.tiers is not None else None
        return h if warm is not None and h in warm else None

    def _find(self, h: bytes, tokens: list[int], version: int, after: int | None) -> Block | None:
        b = self.index.get(h)
        if b is None and self.tiers is not None and version >= 0:
            e = self.tiers.take(h)
            if e is not None and e.tokens == tokens and e.version == version:
                b = self.restore(h, e, after)
        return b if b is not None and b.tokens == tokens else None

    def register(self, b: Block, parent: bytes) -> Block:
        """Give a full block its content hash; returns the block to keep: ``b``, or an equal
        block another session computed (then ``b`` is released: one copy of each content)."""
        h = block_hash(parent, b.tokens, b.version)
        other = self.index.get(h)
        if other is None:
            b.hash, b.parent_hash = h, parent
            self.index[h] = b
            return b
        if other is b or b.ref_count != 1 or other.tokens != b.tokens:
            return b
        self.ref(other)
        self.unref(b)
        self.counters["dedup_blocks"] += 1
        return other

    # -- quantization --------------------------------------------------------------------
    def quantize(self, b: Block, threshold: float) -> None:
        """Encode a full block into the quantized pool; its full-precision slot then holds the
        decoded values -- a read buffer, so attention reads what the compact form stores
        without decoding it every step -- only while the arena has room: any allocation may
        drop it (``_fp_room``), and reads then decode the compact form (``ReadPlanner``), so
        an open session never needs a full-precision copy of its context. Past ``threshold``
        of accumulated error the block stays full precision."""
        kv = self.arena.block(b.start).float()
        raw = self.qformat.encode(kv[:, 0], kv[:, 1])
        k_hat, v_hat = self.qformat.decode(raw)
        err = relative_error(kv[:, 0], kv[:, 1], k_hat, v_hat)
        total = (b.error ** 2 + err ** 2) ** 0.5
        if total > threshold:
            b.kept_full_precision = True
            self.counters["kept_full_precision_blocks"] += 1
            return
        h = self._q_handle()
        if h is None:
            b.kept_full_precision = True  # everything is pinned: stays full precision
            self.counters["quant_skipped_full"] += 1
            return
        self.qpool.slot_bytes_of(h)[: raw.numel()].copy_(raw.reshape(-1))
        dst = self.arena.block(b.start)  # the read buffer holds exactly what was stored
        dst[:, 0].copy_(k_hat)
        dst[:, 1].copy_(v_hat)
        b.qhandle, b.error, b.format = h, total, self.qformat.kv_dtype
        self.counters["quantized_blocks"] += 1

    def ensure_fp(self, b: Block, after: int | None, keep: set[int]) -> bool:
        """Decode a quantized-only block into a full-precision slot (once: the slot stays
        while the block is referenced). True when it decoded."""
        if b.start is not None:
            return False
        B = self.arena.B
        start = self._fp_room(B, after, keep | {b.id})
        raw = self.qpool.slot_bytes_of(b.qhandle)[: self.qformat.layer_bytes * self._layers]
        k, v = self.qformat.decode(raw.view(self._layers, -1))
        dst = self.arena.block(start)
        dst[:, 0].copy_(k)
        dst[:, 1].copy_(v)
        b.start, b.capacity = start, B
        self.counters["dequantized_blocks"] += 1
        return True

    def decode_blocks(self, blocks: list[Block], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [heads, len(blocks) * B, dim] of one layer of quantized blocks, decoded in
        one call into a fresh scratch tensor (not kept)."""
        lb = self.qformat.layer_bytes
        raw = torch.stack([self.qpool.slot_bytes_of(b.qhandle)[layer * lb : (layer + 1) * lb]
                           for b in blocks])
        k, v = self.qformat.decode(raw)  # [n, H, B, D]
        n, H, B, D = k.shape
        return k.transpose(0, 1).reshape(H, n * B, D), v.transpose(0, 1).reshape(H, n * B, D)

    @property
    def _layers(self) -> int:
        return self.arena.kv.shape[0]

    # -- versions ------------------------------------------------------------------------
    def servable(self, version: int) -> bool:
        """K/V of ``version`` may be served: the current one, or one of the ``keep_versions``
        before it (``CacheConfig.stale_versions``)."""
        return self.version - self.keep_versions <= version <= self.version

    def reset_counters(self) -> None:
        """Zero the counters and the tiers' figures (a new statistics context)."""
        for name in self.counters:
            self.counters[name] = 0
        if self.tiers is not None:
            s = self.tiers.stats
            for f in fields(s):
                setattr(s, f.name, 0)

    def switch_policy(self, policy: EvictionPolicy) -> None:
        """Hand the cached blocks to ``policy`` in the old policy's eviction order (best
        victim first: inserted first, leaves first)."""
        old = self.policy
        for key in old.victims(len(old)):
            policy.insert(key, self.index[key].parent_hash)
        self.policy = policy

    def set_version(self, version: int) -> None:
        """Move to model ``version``: blocks of versions no longer servable leave the index
        (and the tiers, on disk too); unreferenced ones go. Their hashes are remembered until
        ``take_invalidated`` so a caller can tell what it recomputes because of the move."""
        self.version = version
        if self.tiers is not None:
            for key, v in self.tiers.drop_versions_where(lambda v: not self.servable(v)):
                self.invalidated.add(key)
                self.invalidated_versions.add(v)
        for b in [b for b in self.blocks.values() if not self.servable(b.version)]:
            if b.hash is not None and self.index.get(b.hash) is b:
                del self.index[b.hash]
                self.policy.remove(b.hash)
                self.invalidated.add(b.hash)
                self.invalidated_versions.add(b.version)
            b.hash = None
            if b.ref_count == 0:
                self.free(b)
        self.counters["invalidated_blocks"] = len(self.invalidated)

    def stale_prefix_tokens(self, tokens: list[int]) -> int:
        """Leading full-block tokens of ``tokens`` (walked as ``lookup`` walks them) whose
        K/V were cached under a version that a move since ``take_invalidated`` invalidated."""
        B, best = self.arena.B, 0
        for version in self.invalidated_versions:
            parent, n = ROOT, 0
            for i in range((len(tokens) - 1) // B):
                h = block_hash(parent, tokens[i * B : (i + 1) * B], version)
                if h not in self.invalidated:
                    break
                parent, n = h, n + B
            best = max(best, n)
        return best

    def take_invalidated(self) -> int:
        """Blocks invalidated by version moves since the last call (then forgotten)."""
        n = len(self.invalidated)
        self.invalidated, self.invalidated_versions = set(), set()
        return n
