"""KVCache: the engine's façade -- sessions over paged, prefix-shared, quantized blocks.

Flow of one decoding step (what ``node.model`` does)::

    kv.reserve(sid, new_tokens)                          # slots; copies a shared tail first
    for layer: runs = kv.append_and_read(sid, layer, k, v)   # O(1) write, views to attend
    # after the last layer the tokens are complete: full blocks get a content hash (prefix
    # sharing, dedup) and blocks that left the full-precision window are quantized.

Blocks are ``cache.block.Block`` records kept by ``cache.manager.BlockManager``; this module
keeps sessions (``BlockTable``) and turns them into writes, read plans and figures.

Runtime knobs: ``set_tunable``/``tunables`` (``cache/tunables.py``); figures: ``stats()``, with
``reset_stats()`` to start a clean measurement; a ``KVCache.open(dir)`` engine is read and
changed from another process with ``python -m cache stats|set --dir DIR`` (``cache/control.py``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import fields
from time import perf_counter_ns
from typing import Any, Callable, Iterable

import torch

from cache.attention import Run
from cache.batch import BatchStep, TailBuffer, shared_prefix_blocks, tail_positions
from cache.block import Block
from cache.block_table import BlockTable, end_of
from cache.compaction import COMPACT_EVERY, compact
from cache.config import CacheConfig
from cache.control import POLL_S
from cache.errors import (
    CacheFullError, ClosedSessionError, ConfigError, LayerIndexError, ReservationError,
    ShapeMismatchError, StaleSessionError, TensorDTypeError, UnknownSessionError,
)
from cache.latency import OpLatencies
from cache.live import LivePlane
from cache.manager import BlockManager
from cache.policy import POLICIES, EvictionPolicy, make_policy
from cache.pool import BlockPool
from cache.prefetch import Prefetcher, make_prefetcher, prefetch_after_lookup
from cache.prefix import namespace_root
from cache.quant import BlockFormat
from cache.sparsity import SparsityPolicy
from cache.tensor_store import TensorStore
from cache.tiers import ColdStore, Tiers
from cache.token_arena import TokenArena
from cache.tunables import TUNABLES, validate_tunable

QUANTIZED = ("int8", "int4")
_log = logging.getLogger("fedkv.cache")
TAIL_ROOM = 16
"""Decode steps a batch's tail buffer has room for before it is gathered again."""


def fresh_dtype(config: CacheConfig) -> tuple[str, torch.dtype]:
    """Name and dtype of full-precision storage: fp16 for an fp16 cache, else fp32."""
    return ("fp16", torch.float16) if config.kv_dtype == "fp16" else ("fp32", torch.float32)


def _storage(c: CacheConfig) -> tuple[TokenArena, BlockPool | None, BlockFormat | None]:
    """Split ``pool_bytes``: all full precision, or ``read_buffer_fraction`` of it in a
    quantized cache (fresh window blocks and active sessions' decoded buffers)."""
    _, dtype = fresh_dtype(c)
    block = 2 * c.num_layers * c.num_heads * c.block_size * c.head_dim * dtype.itemsize
    share = c.read_buffer_fraction if c.kv_dtype in QUANTIZED else 1.0
    blocks = int(c.pool_bytes * share) // block
    if blocks < 1:
        raise ConfigError(f"pool_bytes {c.pool_bytes} x {share} holds no {block}-byte block")
    arena = TokenArena(blocks, c.num_layers, c.num_heads, c.block_size, c.head_dim, dtype,
                       c.tail_granule)
    if c.kv_dtype not in QUANTIZED:
        return arena, None, None
    fmt = BlockFormat(c.kv_dtype, c.quant_scheme, c.num_heads, c.block_size, c.head_dim,
                      c.scale_format)
    pool = BlockPool(c.pool_bytes - blocks * block, None, c.managed_block_bytes, c.page_bytes)
    pool.add_class(c.kv_dtype, fmt.layer_bytes * c.num_layers)
    return arena, pool, fmt


class KVCache:
    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None, *,
                 store: ColdStore | None = None, clock: Callable[[], float] | None = None):
        """``store``: a cold tier (``cache.segments.SegmentStore``; ``KVCache.open`` makes
        one); ``clock``: seconds, for the tiers' cooldown (injectable in tests)."""
        self.config = config
        self.fresh, _ = fresh_dtype(config)
        arena, qpool, qformat = _storage(config)
        self.arena, self.qpool = arena, qpool
        policy = policy or make_policy(config.eviction_policy, arena.num_blocks)
        self.blocks = BlockManager(arena, policy, qpool, qformat)
        self.blocks.reclaim_fp = self._reclaim_read_buffer
        if config.warm_bytes or store is not None:
            self.blocks.tiers = Tiers(config.warm_bytes, config.cooldown_s,
                                      clock or time.monotonic, store, on_warning=_log.warning)
        self.store = store
        self._reserves_since_compact = 0
        self._alloc_failures_in_row = 0
        self._tails: TailBuffer | None = None
        self.found_on_disk = 0
        """K/V blocks the cold store held when this cache was opened (warm start)."""
        self.tensors = TensorStore()
        self._sessions: dict[int, BlockTable] = {}
        self._next_sid = 0
        self.prefetcher: Prefetcher | None = None
        """Made on the first lookup when ``prefetch_mode`` is not ``none`` (``_prefetch``)."""
        self.latency = OpLatencies()
        """Recent durations of lookups and operations (``stats()['latency']``)."""
        self.live: LivePlane | None = None
        """Set by ``KVCache.open``: snapshots and change requests in the directory."""
        self._boundary_ns = 0  # perf_counter_ns after which the next op looks at ``live``
        self._context_started = time.monotonic()

    @property
    def version(self) -> int:
        """The model version K/V are computed under (the engine's one version counter)."""
        return self.blocks.version

    @property
    def policy(self) -> EvictionPolicy:
        return self.blocks.policy

    # == sessions ===========================================================================
    def open_session(self, sparsity: SparsityPolicy | None = None, *,
                     namespace: bytes | str = b"") -> int:
        """A new, empty session. With a ``sparsity`` policy (``cache.sparsity``) each decode
        step attends only to the positions the policy keeps, and a block whose positions it
        dropped in every layer is freed (such sessions cannot be forked or batched). Prefix
        blocks are shared only with sessions of the same ``namespace`` (``cache.prefix``;
        default: the one shared namespace)."""
        sid = self._next_sid
        self._next_sid += 1
        self._sessions[sid] = BlockTable(sid, self.config.block_size, self.version,
                                         sparsity=sparsity, root=namespace_root(namespace))
        return sid

    def _table(self, sid: int, *, allow_stale: bool = False) -> BlockTable:
        t = self._sessions.get(sid)
        if t is None:
            if isinstance(sid, int) and 0 <= sid < self._next_sid:  # ids are never reused
                raise ClosedSessionError(f"session {sid} is closed")
            raise UnknownSessionError(f"session {sid!r} was never opened in this cache")
        if t.stale and not allow_stale:
            raise StaleSessionError(
                f"session {sid} holds K/V of model version {t.version} but the model is at "
                f"version {self.version}; call reset_session({sid}) and prefill again")
        return t

    def sessions(self) -> list[int]:
        """Ids of the open sessions."""
        return list(self._sessions)

    def is_stale(self, sid: int) -> bool:
        """True when the session's K/V predate the current model version."""
        return self._table(sid, allow_stale=True).stale

    def length(self, sid: int) -> int:
        return self._table(sid).length

    def tokens(self, sid: int) -> list[int]:
        t = self._table(sid, allow_stale=True)
        return list(t.tokens[: t.length])

    def close_session(self, sid: int) -> None:
        """Release the session's blocks (full ones stay as unreferenced prefix-cache entries)
        and drop its table; using ``sid`` afterwards raises ClosedSessionError."""
        self._release(self._table(sid, allow_stale=True))
        del self._sessions[sid]

    def reset_session(self, sid: int) -> list[int]:
        """Drop a session's K/V (e.g. after a model update); returns its token history."""
        t = self._table(sid, allow_stale=True)
        toks = t.tokens[: t.length]
        self._release(t)
        t.tokens, t.length, t.version, t.stale = [], 0, self.version, False
        return toks

    def fork(self, sid: int) -> int:
        """A new session sharing all of ``sid``'s blocks (parallel sampling); the first write
        into a shared partial block copies it."""
        t = self._table(sid)
        if t.pending:
            raise ReservationError(f"session {sid} has {t.pending} reserved tokens not written")
        if t.sparsity is not None:
            raise ReservationError(f"session {sid} drops K/V (sparsity) and cannot be forked")
        child = self.open_session()
        c = self._sessions[child]
        c.root = t.root
        c.blocks, c.tokens, c.length = list(t.blocks), list(t.tokens), t.length
        c.quant_checked = t.quant_checked
        for b in c.blocks:
            self.blocks.ref(b)
        return child

    def _release(self, t: BlockTable) -> None:
        t.releases += 1  # its tokens may come back with other K/V: no tail buffer continues
        for b in reversed(t.held()):  # tails first: LRU reclaims tails before shared roots
            self.blocks.unref(b)
        t.blocks, t.pending, t.written, t.runs, t.planned = [], 0, set(), None, 0
        t.quant_checked = 0
        t.tokens = t.tokens[: t.length]

    def _reclaim_read_buffer(self, keep: set[int]) -> bool:
        """Drop the decoded read buffer of the least recently used session (its quantized
        blocks stay); blocks in ``keep`` are never touched."""
        for t in sorted(self._sessions.values(), key=lambda t: t.last_access):
            dropped = [self.blocks.drop_read_buffer(b) for b in t.held() if b.id not in keep]
            if any(dropped):
                return True
        return False

    # == prefix sharing ====================================================================
    def match_prefix(self, sid: int, tokens: Iterable[int]) -> int:
        """Attach the longest cached prefix of ``tokens`` (whole blocks) to an empty session.

        At most ``len(tokens) - 1`` tokens are reused so the caller still computes the logits
        of the last prompt token. Returns the number of tokens reused.
        """
        start = perf_counter_ns()  # timing inlined in each timed op: see _op_boundary
        try:
            return self._match_prefix(sid, tokens)
        finally:
            end = perf_counter_ns()
            self.latency.lookup.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def _match_prefix(self, sid: int, tokens: Iterable[int]) -> int:
        t = self._table(sid)
        toks = [int(x) for x in tokens]
        if t.length or t.pending:
            raise ReservationError(f"match_prefix needs an empty session; {sid} has tokens")
        B, m = self.config.block_size, self.blocks
        m.counters["prefix_lookups"] += 1
        parent = t.root
        for i in range((len(toks) - 1) // B):
            b = m.lookup(parent, toks[i * B : (i + 1) * B],
                         end_of(t.blocks[-1], self.config.block_size) if t.blocks else None)
            if b is None:
                m.counters["prefix_miss_blocks"] += 1
                break
            m.ref(b)
            t.blocks.append(b)
            parent = b.hash
            m.counters["prefix_hit_blocks"] += 1
        t.length = len(t.blocks) * B
        t.tokens = toks[: t.length]
        t.quant_checked = len(t.blocks) if self.qpool is not None else 0
        m.counters["prefix_hit_tokens"] += t.length
        self._prefetch(t.blocks)
        return t.length

    def _prefetch(self, touched: list[Block]) -> None:
        """After a lookup: the prefetcher sees the blocks it touched and moves what it
        predicts from warm/cold into hot (``cache/prefetch.py``). Built on first use and again
        when ``prefetch_mode``/``prefetch_degree`` change (a new one learns from scratch)."""
        c = self.config
        if c.prefetch_mode == "none" or not c.prefetch_degree or self.blocks.tiers is None:
            return
        p = self.prefetcher
        if p is None or p.name != c.prefetch_mode or p.degree != c.prefetch_degree:
            p = self.prefetcher = make_prefetcher(c.prefetch_mode, c.prefetch_degree)
        prefetch_after_lookup(self.blocks, p, [b.hash for b in touched])

    # == writing ===========================================================================
    def reserve(self, sid: int, tokens: Iterable[int]) -> None:
        """Make room for new tokens; allocation is all-or-nothing."""
        start = perf_counter_ns()
        try:
            self._reserve(sid, tokens)
        finally:
            end = perf_counter_ns()
            self.latency.reserve.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def _reserve(self, sid: int, tokens: Iterable[int]) -> None:
        t = self._table(sid)
        toks = [int(x) for x in tokens]
        if not toks:
            raise ShapeMismatchError("reserve needs at least one token")
        if t.pending:
            raise ReservationError(
                f"session {sid}: {t.pending} reserved tokens are not written in every layer yet "
                f"(done: {sorted(t.written)})")
        self._touch(t)
        if t.sparsity is not None and t.length:
            self._drop_sparse_blocks(t)
        self._relieve_pressure()
        self._try_plan(t)  # blocks resident at full precision before anything is allocated
        tail, new = self._allocate_or_compact(t, t.length + len(toks))
        if tail is not None:
            old = t.blocks[-1]
            t.blocks[-1] = tail
            shared = old.ref_count > 1
            self.blocks.unref(old)
            self.blocks.counters["cow_copies" if shared else "tail_moves"] += 1
            t.runs = None
        t.blocks.extend(new)
        t.tokens = t.tokens[: t.length] + toks
        t.pending, t.written = len(toks), set()
        self._try_plan(t)
        t.write_at = t.positions(t.length, len(toks))

    def _relieve_pressure(self) -> None:
        """Below the low watermark of free arena memory: demote a batch of ``evict_batch``
        cached blocks to warm (when there is a warm tier: they stay hits) and compact lazily.
        A single allocation still evicts at most the one block it needs."""
        free = self.arena.free_pages / self.arena.num_pages
        self._reserves_since_compact += 1
        if free >= self.config.low_watermark:
            return
        if self.blocks.tiers is not None and self.config.warm_bytes:
            self.blocks.counters["pressure_demotions"] += self.blocks.demote(
                self.config.evict_batch)
        if self._reserves_since_compact >= COMPACT_EVERY:
            self.compact()

    def _allocate_or_compact(self, t: BlockTable, total: int):
        """Allocate; the third failure in a row compacts and retries once."""
        try:
            out = self._allocate(t, total)
        except CacheFullError:
            self._alloc_failures_in_row += 1
            if self._alloc_failures_in_row < 3:
                raise
            self._alloc_failures_in_row = 0
            self.compact()
            out = self._allocate(t, total)
        self._alloc_failures_in_row = 0
        return out

    def compact(self) -> dict[str, int]:
        """Mark-and-sweep, then move scattered sessions into contiguous runs."""
        self._reserves_since_compact = 0
        return compact(self.blocks, self.arena, self._sessions.values())

    def _allocate(self, t: BlockTable, total: int) -> tuple[Block | None, list[Block]]:
        """Room for ``total`` tokens: the partly filled last block grows in place, or is
        copied (shared: copy-on-write; no room after it: a move) -- that copy, or None --
        and the new blocks, each placed right after its predecessor when that space is free."""
        B, m = self.config.block_size, self.blocks
        keep = t.block_ids()
        tail, new = None, []
        last = end_of(t.blocks[-1], self.config.block_size) if t.blocks else None
        try:
            if t.length % B:
                old, want = t.blocks[-1], min(B, total - (len(t.blocks) - 1) * B)
                if old.ref_count > 1 or not m.grow(old, want):
                    prev = t.blocks[-2] if len(t.blocks) > 1 else None
                    tail = m.copy(old, t.length % B, want, end_of(prev, self.config.block_size), keep)
                    last = end_of(tail, self.config.block_size)
            for i in range(t.blocks_needed(total) - len(t.blocks)):
                n = min(B, total - (len(t.blocks) + i) * B)
                new.append(m.new(n, last, keep | {b.id for b in new}))
                last = end_of(new[-1], self.config.block_size)
        except CacheFullError:
            m.counters["alloc_failures"] += 1  # refused to the caller, nothing changed
            for b in new + ([tail] if tail else []):
                m.unref(b)
            raise
        return tail, new

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise LayerIndexError(
                f"layer {layer!r} out of range: the cache has {self.config.num_layers} layers")

    def _check_kv(self, t: BlockTable, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_layer(layer)
        c = self.config
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TensorDTypeError(
                    f"{name} must be a floating-point torch.Tensor, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")
            want = (c.num_heads, t.pending, c.head_dim)
            if tuple(x.shape) != want:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(x.shape)}, expected {want} "
                    f"(heads, reserved tokens, head_dim) for session {t.sid}")
        if not t.pending:
            raise ReservationError(f"session {t.sid}: nothing reserved; call reserve() first")
        if layer in t.written:
            raise ReservationError(f"session {t.sid}: layer {layer} already written")

    def write(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of the reserved tokens for one layer; k, v: [heads, pending, head_dim]."""
        start = perf_counter_ns()
        try:
            self._write(sid, layer, k, v)
        finally:
            end = perf_counter_ns()
            self.latency.write.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def _write(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = self._table(sid)
        self._check_kv(t, layer, k, v)
        dst = self.arena.kv[layer]
        if isinstance(t.write_at, slice):
            dst[0, :, t.write_at] = k
            dst[1, :, t.write_at] = v
        else:
            dst[0].index_copy_(1, t.write_at, k.to(dst.dtype))
            dst[1].index_copy_(1, t.write_at, v.to(dst.dtype))
        t.written.add(layer)
        if len(t.written) == self.config.num_layers:
            self._commit(t)

    def append_and_read(self, sid: int, layer: int, k: torch.Tensor,
                        v: torch.Tensor) -> list[Run]:
        """Write the reserved tokens' K/V in ``layer`` and return the layer's whole context
        as views to attend over (:func:`cache.attention.attend`)."""
        start = perf_counter_ns()
        try:
            self._write(sid, layer, k, v)
            return self.read_runs(sid, layer)
        finally:
            end = perf_counter_ns()
            self.latency.append_and_read.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def _commit(self, t: BlockTable) -> None:
        """All layers written: tokens become complete; hash full blocks; quantize old ones."""
        B, m = self.config.block_size, self.blocks
        start, t.length = t.length, t.length + t.pending
        t.pending, t.written, t.write_at = 0, set(), None
        for bi in range(start // B, t.blocks_needed(t.length)):
            b = t.blocks[bi]
            b.tokens, b.last_access, b.dirty = t.tokens[bi * B : min((bi + 1) * B, t.length)], m.clock, True
            if len(b.tokens) == B and b.hash is None:
                self._register(t, bi)
        if self.qpool is not None:
            self._quantize_old(t)

    def _drop_sparse_blocks(self, t: BlockTable) -> None:
        """Free every full block whose positions the policy dropped in all layers (at the
        next reserve: the last layer's attention runs after the step's commit)."""
        B, n = self.config.block_size, t.length
        alive = torch.zeros(t.blocks_needed(n), dtype=torch.bool)
        for layer in range(self.config.num_layers):
            keep = t.sparsity.keep(layer, n)
            pad = torch.zeros(alive.numel() * B, dtype=torch.bool)
            pad[:n] = keep
            alive |= pad.view(-1, B).any(dim=1)
        for i in range(min(n // B, len(t.blocks) - 1)):  # never the block being written
            b = t.blocks[i]
            if b is not None and not alive[i]:
                t.blocks[i] = None
                self.blocks.unref(b)
                self.blocks.counters["sparsity_dropped_blocks"] += 1
                t.runs = None

    def _register(self, t: BlockTable, bi: int) -> None:
        prev = t.blocks[bi - 1] if bi else None
        parent = t.root if bi == 0 else (prev.hash if prev is not None else None)
        if parent is None:  # an earlier block is unhashed (forked chain) or dropped
            return
        kept = self.blocks.register(t.blocks[bi], parent)
        if kept is not t.blocks[bi]:
            t.blocks[bi] = kept
            t.runs = None
        if self.prefetcher is not None and kept.hash is not None:
            self.prefetcher.observe(kept.hash)  # a new block: learn the chain into it

    def _quantize_old(self, t: BlockTable) -> None:
        """Quantize the blocks this step pushed out of the full-precision window (at the
        commit, i.e. inside the last layer's write).

        What a query attends in a quantized cache (decided in issue 22): a block is attended
        in the form the cache holds when the layer reads it. So (1) in the step that pushes a
        block out of the window, the last layer attends its quantized values while earlier
        layers attended full precision (single-session path; a batch step's tails are read
        before the commit), and every later step attends them quantized in every layer; and
        (2) a prefix-cache hit attaches blocks as cached -- quantized when another session
        pushed them out of its window -- while a cold prefill of the same prompt attends its
        own prefix at full precision in the layers before the last. A prompt's logits, and
        rarely a greedy token, therefore depend on whether another session quantized its
        prefix (int4 ``generate_batch`` vs one-at-a-time ``generate``). This is inherent to
        keeping only the compact form of cached blocks (that is the memory a quantized cache
        saves); making every layer attend one representation would mean quantizing before
        the prefill's attention, a change of results we do not make here. The bound is
        pinned by tests/node/test_batched_decode.py: a hit moves the logits by at most 3x
        what quantization moves a cold prefill's logits from full precision."""
        limit = (t.length - self.config.fp_window) // self.config.block_size
        for b in t.blocks[t.quant_checked : max(limit, t.quant_checked)]:
            if b is not None and not (b.quantized or b.kept_full_precision) and b.start is not None:
                self.blocks.quantize(b, self.config.requant_error_threshold)
        t.quant_checked = max(t.quant_checked, limit)

    # == reading ===========================================================================
    def _touch(self, t: BlockTable) -> None:
        self.blocks.clock += 1
        t.last_access = self.blocks.clock

    def _plan(self, t: BlockTable, keep: set[int] | None = None) -> list[list[int]]:
        """The session's runs of consecutive blocks ([start, blocks]); grown by appended
        blocks, rebuilt (and
        quantized-only blocks decoded, once) only after a block changed place. Making room
        never drops the read buffer of a block in ``keep`` (default: the session's own)."""
        if t.runs is None or t.plan_generation != self.blocks.generation:
            keep, after = t.block_ids() if keep is None else keep, None
            for b in t.held():
                self.blocks.ensure_fp(b, after, keep)
                after = end_of(b, self.config.block_size)
            t.runs, t.planned = [], 0
        for b in t.blocks[t.planned :]:
            if b is None:
                continue
            B = self.config.block_size
            if t.runs and t.runs[-1][0] + t.runs[-1][1] * B == b.start:
                t.runs[-1][1] += 1
            else:
                t.runs.append([b.start, 1])
        t.planned, t.plan_generation = len(t.blocks), self.blocks.generation
        return t.runs

    def _try_plan(self, t: BlockTable, keep: set[int] | None = None) -> bool:
        try:
            self._plan(t, keep)
            return True
        except CacheFullError:  # no room for a read buffer: reads decode per step instead
            t.runs = None
            return False

    def _transient_run(self, t: BlockTable, layer: int, n: int) -> list[Run]:
        """The context decoded for this read only (no read buffer fits): one temporary run."""
        self.blocks.counters["transient_reads"] += 1
        ks, vs = [], []
        for b in t.blocks[: t.blocks_needed(n)]:
            if b is None:
                continue
            if b.start is not None:
                k, v = self.arena.run(layer, b.start, self.config.block_size)
            else:
                k, v = self.blocks.decode_layer(b, layer)
            ks.append(k.float())
            vs.append(v.float())
        return [(torch.cat(ks, 1)[:, : self._resident(t, n)], torch.cat(vs, 1)[:, : self._resident(t, n)])]

    def _resident(self, t: BlockTable, n: int) -> int:
        """Of the first ``n`` positions, how many are held (dropped blocks left out)."""
        if t.sparsity is None:  # the decode hot path: nothing is ever dropped
            return n
        B = self.config.block_size
        return n - B * sum(b is None for b in t.blocks[: n // B])

    def sparsity(self, sid: int) -> SparsityPolicy | None:
        return self._table(sid).sparsity

    def resident_positions(self, sid: int, layer: int) -> torch.Tensor:
        """Logical positions (0 = the session's first token) of the tokens ``read_runs``
        returns, in order: what the sparsity policy's masks are indexed by."""
        t = self._table(sid)
        B, n = self.config.block_size, t.layer_length(layer)
        starts = [i * B for i, b in enumerate(t.blocks[: t.blocks_needed(n)]) if b is not None]
        pos = (torch.tensor(starts).view(-1, 1) + torch.arange(B)).flatten()
        return pos[pos < n]

    def read_runs(self, sid: int, layer: int) -> list[Run]:
        """K and V of every readable token in ``layer`` as views into the arena, one pair
        per run of consecutive blocks: each [heads, n_i, head_dim], full precision. When
        the read buffer has no room for a cold session's quantized blocks, they are decoded
        for this read only (``stats()['transient_reads']``)."""
        t = self._table(sid)
        self._check_layer(layer)
        n, B = t.layer_length(layer), self.config.block_size
        if not self._try_plan(t):
            return self._transient_run(t, layer, n)
        n = self._resident(t, n)
        out = []
        for start, nb in t.runs:
            if n <= 0:
                break
            take = min(n, nb * B)
            out.append(self.arena.run(layer, start, take))
            n -= take
        return out

    def read(self, sid: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every readable token in ``layer``: each [heads, n, head_dim],
        float32 (one copy when the context spans several runs)."""
        runs = self.read_runs(sid, layer)
        if len(runs) == 1:
            return runs[0][0].float(), runs[0][1].float()
        if not runs:
            c = self.config
            empty = torch.empty(c.num_heads, 0, c.head_dim)
            return empty, empty.clone()
        return (torch.cat([k for k, _ in runs], 1).float(),
                torch.cat([v for _, v in runs], 1).float())

    # == batched decode =====================================================================
    def begin_batch(self, sids: list[int], tokens: list[int]) -> BatchStep:
        """Reserve one new token per session and plan the step's single write and gather per
        layer; a prefix of blocks all sessions share is attended once for all of them.

        All-or-nothing: a refused batch (``CacheFullError`` on a later member, a sparse or
        unknown member, ...) leaves no member with a reservation and takes back the blocks
        it allocated (cached blocks evicted to make room stay evicted; a partly filled last
        block copied for a member stays its copy, same tokens)."""
        start = perf_counter_ns()
        try:
            return self._begin_batch(sids, tokens)
        finally:
            end = perf_counter_ns()
            self.latency.batch_begin.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def _begin_batch(self, sids: list[int], tokens: list[int]) -> BatchStep:
        if len(sids) != len(tokens) or len(set(sids)) != len(sids) or not sids:
            raise ShapeMismatchError(
                f"begin_batch needs one token per distinct session, got {len(sids)} sessions "
                f"and {len(tokens)} tokens")
        tables = [self._table(s) for s in sids]  # unknown, closed, stale: before reserving
        if any(t.sparsity is not None for t in tables):
            raise ReservationError("sessions with a sparsity policy cannot be batched")
        for t in tables:
            if t.pending:
                raise ReservationError(
                    f"session {t.sid}: {t.pending} reserved tokens are not written yet")
        done: list[tuple[BlockTable, int]] = []
        try:
            for t, tok in zip(tables, tokens):
                held = len(t.blocks)
                self.reserve(t.sid, [tok])
                done.append((t, held))
            return self._plan_batch(sids, tables)
        except BaseException:
            for t, held in reversed(done):
                self._unreserve(t, held)
            raise

    def _unreserve(self, t: BlockTable, held: int) -> None:
        """Undo ``reserve`` for a session that held ``held`` blocks before it: the new blocks
        are released, the reserved tokens forgotten."""
        for b in reversed(t.blocks[held:]):
            self.blocks.unref(b)
        del t.blocks[held:]
        t.tokens = t.tokens[: t.length]
        t.pending, t.written, t.write_at, t.runs = 0, set(), None, None

    def _plan_batch(self, sids: list[int], tables: list[BlockTable]) -> BatchStep:
        """The step's write positions, shared prefix runs and tails. Every member's blocks are
        made resident with all members' blocks kept (reserving one member may have dropped
        another's read buffer; re-planning must not drop a member's again). When they do not
        all fit in the full-precision arena, the tails are decoded per layer instead
        (``transient``: no shared prefix, ``stats()['transient_reads']``), as ``read_runs``
        does for one session."""
        B = self.config.block_size
        keep = set().union(*(t.block_ids() for t in tables))
        resident = all([self._try_plan(t, keep) for t in tables])
        shared = shared_prefix_blocks(tables) if resident else 0
        prefix, left = [], shared
        for start, nb in (self._plan(tables[0], keep) if shared else []):
            if left <= 0:
                break
            prefix.append((start, min(nb, left) * B))
            left -= nb
        lengths = [t.length + 1 - shared * B for t in tables]
        write = torch.tensor([t.blocks[t.length // B].start + t.length % B for t in tables])
        key = (tuple(sids), shared, self.blocks.generation, self.blocks.counters["quantized_blocks"],
               tuple(t.blocks[shared].id if len(t.blocks) > shared else -1 for t in tables),
               tuple(t.releases for t in tables))
        buf = self._tails if self.config.batch_tail_buffer else None
        if buf is not None and buf.continues(key, lengths):
            step = BatchStep(list(sids), write, prefix, torch.empty(0), buf.valid, tails=buf,
                             fresh=False)
        else:
            if resident:
                pos, valid = tail_positions(
                    [[b.start for b in t.blocks[shared:]] for t in tables], lengths, B)
            else:
                pos = None
                valid = torch.arange(max(lengths)) < torch.tensor(lengths).view(-1, 1)
            c = self.config
            buf = TailBuffer.empty(key, c.num_layers, c.num_heads, len(sids),
                                   max(lengths) + TAIL_ROOM, c.head_dim, self.arena.kv.dtype)
            self._tails = buf if c.batch_tail_buffer else None  # kept only when reused
            step = BatchStep(list(sids), write, prefix, pos, valid, tails=buf)
        step.tails.lengths = lengths
        step.tails.key = key
        return step

    def append_and_read_batch(self, step: BatchStep, layer: int, k: torch.Tensor,
                              v: torch.Tensor):
        """k, v: [heads, B, head_dim], the new token of each session. Writes them with one
        indexed store and returns (prefix runs, tail K [H, B, T, D], tail V, tail mask) for
        :func:`cache.attention.attend_shared`."""
        start = perf_counter_ns()
        try:
            return self._append_and_read_batch(step, layer, k, v)
        finally:
            end = perf_counter_ns()
            self.latency.batch_append_and_read.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def _append_and_read_batch(self, step: BatchStep, layer: int, k: torch.Tensor,
                               v: torch.Tensor):
        self._check_layer(layer)
        c = self.config
        want = (c.num_heads, len(step.sids), c.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ShapeMismatchError(f"k, v must be {want}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if step.written != layer:
            raise ReservationError(f"batch step: layer {layer} written out of order")
        kv = self.arena.kv[layer]
        kv[0].index_copy_(1, step.write_pos, k.to(kv.dtype))
        kv[1].index_copy_(1, step.write_pos, v.to(kv.dtype))
        prefix = [self.arena.run(layer, start, n) for start, n in step.prefix]
        tk, tv, valid = self._tails_of(step, layer, k, v)
        step.written += 1
        if step.written == c.num_layers:
            for sid in step.sids:
                t = self._table(sid)
                t.written = set(range(c.num_layers))
                self._commit(t)
        return prefix, tk, tv, valid

    def _tails_of(self, step: BatchStep, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Tail K, V [H, B, T, D] and mask [B, T]: gathered (one index_select for K and V
        together, 9x faster than on the [H, N, D] views) into the step's buffer, or the new
        token appended to the buffer the previous step left."""
        buf, c = step.tails, self.config
        T = max(buf.lengths)
        if step.fresh and step.tail_pos is None:  # read buffers do not all fit: decode
            for row, sid in enumerate(step.sids):
                t = self._table(sid)
                (tk, tv), = self._transient_run(t, layer, t.length + 1)
                buf.kv[layer, 0, :, row, : tk.shape[1]] = tk
                buf.kv[layer, 1, :, row, : tv.shape[1]] = tv
            buf.valid[:, : step.tail_valid.shape[1]] = step.tail_valid
        elif step.fresh:
            H, Bn, Tp = c.num_heads, *step.tail_pos.shape
            got = self.arena.kv[layer].index_select(2, step.tail_pos.flatten())
            buf.kv[layer, :, :, :, :Tp] = got.view(2, H, Bn, Tp, c.head_dim)
            buf.valid[:, :Tp] = step.tail_valid
        else:
            rows = torch.arange(len(step.sids))
            at = torch.tensor(buf.lengths) - 1
            buf.kv[layer, 0, :, rows, at] = k.to(buf.kv.dtype)  # [H, B, D]
            buf.kv[layer, 1, :, rows, at] = v.to(buf.kv.dtype)
            buf.valid[rows, at] = True
        return buf.kv[layer, 0, :, :, :T], buf.kv[layer, 1, :, :, :T], buf.valid[:, :T]

    # == model versions and tensors ========================================================
    def bump_version(self) -> int:
        """A new model version: every cached K/V block becomes unreachable for new lookups,
        unreferenced ones are freed, and open sessions turn stale (reset_session to reuse)."""
        return self.set_version(self.version + 1)

    def set_version(self, version: int) -> int:
        """Move to model ``version`` (a restored node's version, say); K/V of any other
        version are never served again."""
        if version != self.version:
            self.blocks.set_version(int(version))
            for t in self._sessions.values():
                if not t.stale and not self.blocks.servable(t.version):
                    self._release(t)
                    t.stale = True
        return self.version

    def keep_stale_versions(self, k: int) -> None:
        """Serve K/V of up to ``k`` model versions before the current one (0: only the
        current): open sessions and cached blocks survive ``k`` write-backs, at the quality
        cost of attending over K/V the new weights did not compute."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"stale versions kept must be an int >= 0, got {k!r}")
        self.blocks.keep_versions = k

    def stale_prefix_tokens(self, tokens: Iterable[int]) -> int:
        """Prefix tokens of ``tokens`` that were cached under a model version a write-back
        has since invalidated (``take_invalidated`` resets): what serving recomputes because
        of the write-back, not because it never saw them."""
        return self.blocks.stale_prefix_tokens([int(x) for x in tokens])

    def take_invalidated(self) -> int:
        """Blocks (every tier) invalidated by version moves since the last call."""
        return self.blocks.take_invalidated()

    def put_tensor(self, name: str, tensor: torch.Tensor, version: int | None = None) -> int:
        return self.tensors.put(name, tensor, version)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors.get(name)

    def tensor_version(self, name: str) -> int:
        return self.tensors.version(name)

    # == persistence =======================================================================
    @classmethod
    def open(cls, directory: str | os.PathLike, config: CacheConfig, *, key: bytes | None = None,
             policy: EvictionPolicy | None = None, clock: Callable[[], float] | None = None,
             max_bytes: int | None = None) -> "KVCache":
        """A cache whose cold tier is ``directory`` (AES-256-GCM at rest with ``key``): warm
        start from what an earlier process flushed there (tensors, model version, K/V blocks,
        the hottest into warm at once); a corrupt or older-format directory is rebuilt empty,
        with a warning. ``directory`` is made 0700 (its files 0600); one that group/other can reach is
        refused (``UnsafePermissionsError``), and a lock another process holds for longer
        than ``config.lock_timeout_s`` raises ``StoreLockedError``."""
        from cache.persist import open_cache
        kv = open_cache(cls, directory, config, key=key, max_bytes=max_bytes, policy=policy,
                        clock=clock)
        kv._go_live(directory)
        return kv

    def flush(self) -> None:
        """Write every dirty block worth keeping, the tensors and the model version to the
        cold store and commit (atomic: a crash keeps the previous commit); publishes a
        stats snapshot for ``python -m cache stats``."""
        from cache.persist import flush
        flush(self)
        self._publish()

    def close(self) -> None:
        """Flush, then release the directory (its lock) for the next process; the cache
        stays usable in memory and ``attach`` re-opens the directory."""
        from cache.persist import close
        close(self)
        self._leave_live()

    def offload(self, tier: str = "warm") -> int:
        """Demote every unreferenced prefix-cache block out of hot memory, to ``warm`` or
        (with a cold store) ``cold``: what an idle node does; returns the blocks moved."""
        t = self.blocks.tiers
        if t is None or tier not in ("warm", "cold") or (tier == "cold" and t.cold is None):
            raise ValueError(f"cannot offload to {tier!r}: this cache has "
                             f"{'no tiers' if t is None else 'no cold store'}")
        moved = self.blocks.demote(len(self.blocks.policy))
        if tier == "cold":
            t.spill_warm()
        return moved

    def release(self) -> None:
        """Let go of the directory without flushing (what is on disk stays the last flush):
        for a process that must not write a half-updated state."""
        if self.store is not None:
            self.store.close()
            self.store = None
            self.blocks.tiers.cold = None
        self._leave_live()

    def attach(self, directory: str | os.PathLike, *, key: bytes | None = None,
               max_bytes: int | None = None) -> None:
        """Use ``directory`` as the cold tier again (after ``close``), without reloading."""
        from cache.persist import open_store
        if self.store is None:
            self.store = open_store(directory, key, max_bytes, self.config.lock_timeout_s)
            self.blocks.tiers.cold = self.store
            self._go_live(directory)

    # == tunables, statistics context, live control ==========================================
    def tunables(self) -> dict[str, Any]:
        """The runtime-settable values (``cache.tunables.TUNABLES``) as the engine uses them."""
        return {name: getattr(self.config, name) for name in TUNABLES}

    def set_tunable(self, key: str, value: Any) -> Any:
        """Change one tunable now (validated: ConfigError names key, value and what is
        allowed); returns the old value. A new ``eviction_policy`` takes over the cached
        blocks in the old policy's eviction order."""
        value = validate_tunable(key, value)
        old = getattr(self.config, key)
        if key == "eviction_policy" and type(self.policy) is not POLICIES[value]:
            self._switch_policy(value)
        setattr(self.config, key, value)
        if key == "cooldown_s" and self.blocks.tiers is not None:
            self.blocks.tiers.cooldown_s = value
        return old

    def _switch_policy(self, name: str) -> None:
        old, new = self.policy, make_policy(name, self.arena.num_blocks)
        for key in old.victims(len(old)):  # best victim first: inserted first, leaves first
            new.insert(key, self.blocks.index[key].parent_hash)
        self.blocks.policy = new

    def reset_stats(self) -> None:
        """Start a clean measurement: zero the counters (``stats()``'s, the tiers') and the
        latency windows. Sessions, blocks, tiers and tunables are kept."""
        c = self.blocks.counters
        for name in c:
            c[name] = 0
        if self.blocks.tiers is not None:
            s = self.blocks.tiers.stats
            for f in fields(s):
                setattr(s, f.name, 0)
        self.latency.clear()
        self._tails = None  # its key counts quantized blocks, which just restarted from 0
        self._context_started = time.monotonic()

    @property
    def context_age_s(self) -> float:
        """Seconds since the statistics context started (construction or reset_stats)."""
        return time.monotonic() - self._context_started

    def _op_boundary(self, now_ns: int) -> None:
        """After a timed operation, at most every ``POLL_S``: apply the change requests the
        live plane's timer thread has read (in memory; the plane does the file work and
        publishes the snapshots: ``cache/live.py``).

        Each timed operation (``cache.latency.OP_KINDS``) inlines its own timing (two
        ``perf_counter_ns``, a ring append, this deadline check) instead of a decorator:
        a wrapper's extra frame doubled the cost per call on this machine, and decode runs
        ``num_layers + 1`` of them a step (``python -m cache overhead``)."""
        self._boundary_ns = now_ns + int(POLL_S * 1e9)
        if self.live is not None and self.live.inbox:
            try:
                self.live.apply_pending()
            except Exception:  # noqa: BLE001 -- a live node never fails an operation for this
                _log.exception("cache live control failed; the engine goes on")

    def _apply_remote(self, key: str, value: Any) -> tuple[Any, Any]:
        old = self.set_tunable(key, value)
        _log.info("cache tunable %s changed from another process: %r -> %r", key, old,
                  getattr(self.config, key))
        return old, getattr(self.config, key)

    def _publish(self, *, attached: bool = True) -> None:
        """Write a snapshot now (on request: open, flush, close), when live."""
        if self.live is not None:
            self.live.publish(attached=attached)

    def go_live(self, directory: str | os.PathLike) -> None:
        """Publish stats and take tunable changes through ``directory/live`` (what
        ``KVCache.open`` does) for a cache without a store, e.g. a serving agent's."""
        self._go_live(directory)

    def idle(self) -> None:
        """A live engine with no operations to do: still take change requests."""
        now = perf_counter_ns()
        if now >= self._boundary_ns:
            self._op_boundary(now)

    def _go_live(self, directory: str | os.PathLike) -> None:
        ref = weakref.ref(self)  # the plane's thread must not keep a dropped engine alive
        if self.live is not None:
            self.live.stop()
        try:
            self.live = LivePlane(directory, lambda: ref().stats(),
                                  lambda key, value: ref()._apply_remote(key, value))
        except OSError as e:
            _log.warning("cache live control unavailable in %s (%s)", directory, e)
            return
        self._publish()

    def _leave_live(self) -> None:
        if self.live is not None:
            self.live.stop()
        self._publish(attached=False)
        self.live = None

    # == figures ===========================================================================
    def bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Stored bytes per token of a full block in ``kv_dtype``, scales included."""
        c = self.config
        fmt = BlockFormat(kv_dtype or c.kv_dtype, c.quant_scheme, c.num_heads, c.block_size,
                          c.head_dim, c.scale_format)
        return fmt.layer_bytes * c.num_layers / c.block_size

    @property
    def tail_buffer_bytes(self) -> int:
        """Bytes of the batch tail buffer kept for the next step (0: none)."""
        tails = self._tails  # read once: a live snapshot may run beside a batch step
        return tails.kv.numel() * tails.kv.element_size() if tails is not None else 0

    def stats(self) -> dict:
        from cache.stats import cache_stats
        return cache_stats(self)

    @property
    def full_precision_dtype(self) -> str:
        """Storage dtype of full-precision blocks: ``fp16`` for an fp16 cache, else ``fp32``."""
        return self.fresh

    def storage_dtypes(self) -> tuple[str, ...]:
        """The dtypes full blocks of this cache can be stored in."""
        return tuple(dict.fromkeys((self.fresh, self.config.kv_dtype)))

    def slot_bytes(self, kv_dtype: str | None = None) -> int:
        """Bytes of the slot that holds one full block in ``kv_dtype`` (page-rounded for
        quantized blocks); ``kv_dtype`` must be one of :meth:`storage_dtypes`."""
        d = self._storage_dtype(kv_dtype)
        if d == self.fresh:
            return self.arena.block_bytes
        return self.qpool.classes[d].slot_bytes

    def arena_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Arena bytes one token of a full ``kv_dtype`` block really costs: for quantized
        blocks a managed block's bytes over the blocks it holds (slot rounding and the slab's
        unusable tail counted), over ``block_size``."""
        d = self._storage_dtype(kv_dtype)
        if d == self.fresh:
            return self.arena.block_bytes / self.config.block_size
        return self.qpool.arena_bytes_per_block(d) / self.config.block_size

    def _storage_dtype(self, kv_dtype: str | None) -> str:
        d = kv_dtype or self.config.kv_dtype
        if d not in self.storage_dtypes():
            raise ValueError(f"this cache stores full blocks as {self.storage_dtypes()}, not "
                             f"{d!r}; build a KVCache with kv_dtype={d!r}")
        return d
