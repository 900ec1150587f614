"""KVCache: the engine's façade -- sessions over paged, prefix-shared, quantized blocks.

Flow of one decoding step (what ``node.models.byte_model`` does)::

    kv.reserve(sid, new_tokens)                          # slots; copies a shared tail first
    for layer: runs = kv.append_and_read(sid, layer, k, v)   # O(1) write, views to attend
    # after the last layer the tokens are complete: full blocks get a content hash (prefix
    # sharing, dedup) and blocks that left the full-precision window are quantized.

The parts, none of which imports this module: ``BlockManager`` (``manager.py``: block records,
the prefix index, eviction, tiers), ``SessionTable`` (``session_table.py``), ``Pressure``
(``pressure.py``: when to demote, compact, quantize), ``SessionSteps`` and ``ReadPlanner``
(``steps.py``: one session's reserve, write, read, commit),
``Batcher`` (``batch.py``), ``LivePlane`` (``live.py``: live control off the decode path),
persistence (``persist.py``) and figures (``stats.py``, ``storage.py``).

Runtime knobs: ``set_tunable``/``tunables`` (``cache/tunables.py``); figures: ``stats()``, with
``reset_stats()`` to start a clean measurement; a ``KVCache.open(dir)`` engine is read and
changed from another process with ``python -m cache stats|set --dir DIR`` (``cache/control.py``).
"""

from __future__ import annotations

import logging
import os
import time
from time import perf_counter_ns
from typing import Any, Callable, Iterable

import torch

from cache.attention import ArenaStep, Run, Spans
from cache.batch import Batcher, BatchStep, StepStore
from cache.config import CacheConfig
from cache.control import POLL_S
from cache.errors import ConfigError
from cache.live import LivePlane, go_live, leave_live
from cache.manager import BlockManager
from cache.policy import POLICIES, EvictionPolicy, make_policy
from cache.prefetch import Prefetcher
from cache.prefix import namespace_root
from cache.pressure import Pressure
from cache.session_table import BlockTable, SessionTable, check_layer
from cache.sparsity import SparsityPolicy
from cache.stats import OpLatencies, cache_stats
from cache.steps import ReadPlanner, SessionSteps
from cache.storage import BlockCosts, make_storage
from cache.tensor_store import TensorStore
from cache.tiers import ColdStore, Tiers
from cache.tunables import TUNABLES, validate_tunable

_log = logging.getLogger("fedkv.cache")


class KVCache:
    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None, *,
                 store: ColdStore | None = None, clock: Callable[[], float] | None = None):
        """``store``: a cold tier (``cache.segments.SegmentStore``; ``KVCache.open`` makes
        one); ``clock``: seconds, for the tiers' cooldown (injectable in tests)."""
        self.config = config
        arena, qpool, qformat = make_storage(config)
        self.arena, self.qpool = arena, qpool
        self.costs = BlockCosts(config, arena, qpool)
        self.fresh = self.costs.fresh
        policy = policy or make_policy(config.eviction_policy, arena.num_blocks)
        self.blocks = BlockManager(arena, policy, qpool, qformat)
        self.session_table = SessionTable(config.block_size, self.blocks)
        self.blocks.reclaim_fp = self.session_table.reclaim_read_buffer
        if config.warm_bytes or store is not None:
            self.blocks.tiers = Tiers(config.warm_bytes, config.cooldown_s,
                                      clock or time.monotonic, store, on_warning=_log.warning)
        self.store = store
        self.pressure = Pressure(config, arena, self.blocks, self.session_table)
        self.reads = ReadPlanner(config.block_size, arena, self.blocks)
        self.steps = SessionSteps(config, arena, self.blocks, self.session_table, self.reads,
                                  self.pressure)
        self.batcher = Batcher(config, arena, self.blocks, self.session_table, self.reads,
                               self.reserve, self.steps.commit)
        self.found_on_disk = 0
        """K/V blocks the cold store held when this cache was opened (warm start)."""
        self.tensors = TensorStore()
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

    @property
    def prefetcher(self) -> Prefetcher | None:
        """Made on the first lookup when ``prefetch_mode`` is not ``none`` (``steps.py``)."""
        return self.steps.prefetcher

    # == sessions (cache/session_table.py) ==================================================
    def open_session(self, sparsity: SparsityPolicy | None = None, *,
                     namespace: bytes | str = b"") -> int:
        """A new, empty session. With a ``sparsity`` policy (``cache.sparsity``) each decode
        step attends only to the positions the policy keeps, and a block whose positions it
        dropped in every layer is freed (such sessions cannot be forked or batched). Prefix
        blocks are shared only with sessions of the same ``namespace`` (``cache.prefix``;
        default: the one shared namespace)."""
        return self.session_table.open(sparsity, namespace_root(namespace))

    def sessions(self) -> list[int]:
        """Ids of the open sessions."""
        return self.session_table.ids()

    def is_stale(self, sid: int) -> bool:
        """True when the session's K/V predate the current model version."""
        return self.session_table.get(sid, allow_stale=True).stale

    def length(self, sid: int) -> int:
        return self.session_table.get(sid).length

    def tokens(self, sid: int) -> list[int]:
        t = self.session_table.get(sid, allow_stale=True)
        return list(t.tokens[: t.length])

    def close_session(self, sid: int) -> None:
        """Release the session's blocks (full ones stay as unreferenced prefix-cache entries)
        and drop its table; using ``sid`` afterwards raises ClosedSessionError."""
        self.session_table.close(sid)

    def reset_session(self, sid: int) -> list[int]:
        """Drop a session's K/V (e.g. after a model update); returns its token history."""
        return self.session_table.reset(sid)

    def fork(self, sid: int) -> int:
        """A new session sharing all of ``sid``'s blocks (parallel sampling); the first write
        into a shared partial block copies it."""
        return self.session_table.fork(sid)

    # == prefix sharing ====================================================================
    def match_prefix(self, sid: int, tokens: Iterable[int]) -> int:
        """Attach the longest cached prefix of ``tokens`` (whole blocks) to an empty session.

        At most ``len(tokens) - 1`` tokens are reused so the caller still computes the logits
        of the last prompt token. Returns the number of tokens reused.
        """
        start = perf_counter_ns()  # timing inlined in each timed op: see _op_boundary
        try:
            return self.steps.attach_prefix(self.session_table.get(sid), [int(x) for x in tokens])
        finally:
            end = perf_counter_ns()
            self.latency.lookup.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def cached_prefix_tokens(self, tokens: Iterable[int], namespace: bytes | str = b"") -> int:
        """Tokens of ``tokens`` ``match_prefix`` would reuse from the hot or warm tier for a
        session of ``namespace``, found without attaching, promoting or counting anything (a
        scheduler's admission probe; cold blocks are not probed: that would read the disk)."""
        toks, B = [int(x) for x in tokens], self.config.block_size
        parent, n = namespace_root(namespace), 0
        for i in range((len(toks) - 1) // B):
            parent = self.blocks.peek(parent, toks[i * B : (i + 1) * B])
            if parent is None:
                break
            n += B
        return n

    @property
    def full_precision_blocks(self) -> int:
        """Blocks the full-precision arena holds: the whole pool in an fp32/fp16 cache, the
        fresh windows' share in int8/int4 (a prompt is prefilled there before it is quantized)."""
        return self.arena.num_blocks

    def free_blocks(self) -> int:
        """Full-precision blocks an allocation can take now without preempting anyone: the
        arena's free pages plus the arena pages it may reclaim (cached blocks no session
        holds, read buffers of quantized blocks; ``BlockManager.reclaimable_fp_blocks``)."""
        a = self.arena
        return a.free_pages * a.page // self.config.block_size + self.blocks.reclaimable_fp_blocks()

    # == writing ===========================================================================
    def reserve(self, sid: int, tokens: Iterable[int]) -> None:
        """Make room for new tokens; allocation is all-or-nothing."""
        start = perf_counter_ns()
        try:
            self.steps.reserve(self.session_table.get(sid), [int(x) for x in tokens])
        finally:
            end = perf_counter_ns()
            self.latency.reserve.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def compact(self) -> dict[str, int]:
        """Mark-and-sweep, then move scattered sessions into contiguous runs."""
        return self.pressure.compact()

    def write(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of the reserved tokens for one layer; k, v: [heads, pending, head_dim]."""
        start = perf_counter_ns()
        try:
            self.steps.write(self.session_table.get(sid), layer, k, v)
        finally:
            end = perf_counter_ns()
            self.latency.write.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def append_and_read(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                        store: StepStore | None = None, gather: bool = True) -> list[Run]:
        """Write the reserved tokens' K/V in ``layer`` (through a model's fused ``store`` when
        given, as ``append_and_read_batch`` takes one) and return the layer's whole context
        as views to attend over (:func:`cache.attention.attend`); ``gather``: as
        :meth:`read_runs`."""
        return self._append_then(sid, layer, k, v, store,
                                 lambda t: self.reads.runs(t, layer, gather))

    def append_and_read_spans(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                              store: StepStore | None = None) -> Spans | None:
        """:meth:`append_and_read` for a kernel that reads the arena in place: the context as
        :class:`cache.attention.Spans`, or None when part of it must be decoded first (a
        quantized block; a sparsity policy) -- the K/V are written either way, and
        :meth:`read_runs` then gives the runs."""
        return self._append_then(sid, layer, k, v, store, lambda t: self.reads.spans(t, layer))

    def _append_then(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                     store: StepStore | None, read: Callable[[BlockTable], Any]) -> Any:
        """Write, then ``read`` the session's table: one operation for the latency stats."""
        start = perf_counter_ns()
        try:
            t = self.session_table.get(sid)
            self.steps.write(t, layer, k, v, store)
            return read(t)
        finally:
            end = perf_counter_ns()
            self.latency.append_and_read.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def arena_step(self, sid: int) -> ArenaStep | None:
        """For a kernel that runs every layer of the session's reserved one-token step itself,
        writing the token's K/V into the arena and attending in place: the arena, the row and
        the context's runs (:class:`cache.attention.ArenaStep`). None where the cache must
        take part -- more or fewer than one token reserved, a layer already written, a
        sparsity policy, a block to decode (quantized), an arena not in fp32 -- and the
        per-layer writes serve. Then :meth:`commit_arena_step`."""
        return self.steps.arena_step(self.session_table.get(sid))

    def commit_arena_step(self, sid: int) -> None:
        """The kernel wrote the reserved token's K/V in every layer: commit the token, as the
        last layer's :meth:`write` does (timed as one write)."""
        start = perf_counter_ns()
        try:
            self.steps.commit_arena_step(self.session_table.get(sid))
        finally:
            end = perf_counter_ns()
            self.latency.write.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    # == reading (cache/steps.py) ============================================================
    def sparsity(self, sid: int) -> SparsityPolicy | None:
        return self.session_table.get(sid).sparsity

    def resident_positions(self, sid: int, layer: int) -> torch.Tensor:
        """Logical positions (0 = the session's first token) of the tokens ``read_runs``
        returns, in order: what the sparsity policy's masks are indexed by."""
        return self.reads.resident_positions(self.session_table.get(sid), layer)

    def read_runs(self, sid: int, layer: int, gather: bool = True) -> list[Run]:
        """K and V of every readable token in ``layer``, one pair per run of consecutive
        blocks: each [heads, n_i, head_dim], full precision -- views into the arena, and a
        session's quantized blocks decoded for this read only (a scratch tensor per run,
        ``stats()['transient_reads']``): no full-precision copy of them is kept. Many short
        arena runs come as one gathered copy unless ``gather`` is False (a kernel that reads
        a list of runs in place, ``node.models.kernels``, needs no copy)."""
        t = self.session_table.get(sid)
        check_layer(layer, self.config.num_layers)
        return self.reads.runs(t, layer, gather)

    def read(self, sid: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every readable token in ``layer``: each [heads, n, head_dim],
        float32, always the caller's own copy: a view would alias arena pages that another
        session's block takes once this one moves, showing the caller that session's K/V."""
        runs = self.read_runs(sid, layer)
        if len(runs) == 1:
            k, v = runs[0]
            return k.to(torch.float32, copy=True), v.to(torch.float32, copy=True)
        if not runs:
            c = self.config
            empty = torch.empty(c.num_heads, 0, c.head_dim)
            return empty, empty.clone()
        return (torch.cat([k for k, _ in runs], 1).float(),
                torch.cat([v for _, v in runs], 1).float())

    # == batched decode (cache/batch.py) =====================================================
    def begin_batch(self, sids: list[int], tokens: list[int]) -> BatchStep:
        """Reserve one new token per session and plan the step's single write and gather per
        layer; a prefix of blocks all sessions share is attended once for all of them.

        All-or-nothing: a refused batch (``CacheFullError`` on a later member, a sparse or
        unknown member, ...) leaves no member with a reservation and takes back the blocks
        it allocated (cached blocks evicted to make room stay evicted; a partly filled last
        block copied for a member stays its copy, same tokens)."""
        start = perf_counter_ns()
        try:
            return self.batcher.begin(sids, tokens)
        finally:
            end = perf_counter_ns()
            self.latency.batch_begin.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

    def append_and_read_batch(self, step: BatchStep, layer: int, k: torch.Tensor,
                              v: torch.Tensor, store: StepStore | None = None):
        """k, v: [heads, B, head_dim], the new token of each session. Writes them with one
        indexed store (or the model's fused ``store``, ``cache.batch.StepStore``) and returns
        (prefix runs, tail K [H, S, T, D], tail V, tail mask [S, T]) for
        :func:`cache.attention.attend_shared`: S tail slots, row i's in slot ``step.rows[i]``
        (slot i when ``step.rows`` is None; ``cache.batch.TailBuffer``)."""
        start = perf_counter_ns()
        try:
            return self.batcher.append_and_read(step, layer, k, v, store)
        finally:
            end = perf_counter_ns()
            self.latency.batch_append_and_read.append(end - start)
            if end >= self._boundary_ns:
                self._op_boundary(end)

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
            self.session_table.mark_stale()
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

    # == persistence (cache/persist.py) ========================================================
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

    def flush(self, strict: bool = False) -> None:
        """Write every dirty block worth keeping, the tensors and the model version to the
        cold store and commit (atomic: a crash keeps the previous commit); publishes a
        stats snapshot for ``python -m cache stats``. ``strict``: an ``OSError`` writing or
        committing them raises (else logged: memory only)."""
        from cache.persist import flush
        flush(self, strict)
        if self.live is not None:
            self.live.publish()

    def close(self, strict: bool = False) -> None:
        """Flush (``strict`` as there), then release the directory (its lock) for the next
        process; the cache stays usable in memory and ``attach`` re-opens the directory."""
        from cache.persist import close
        close(self, strict)
        self._leave_live()

    def offload(self, tier: str = "warm") -> int:
        """Demote every unreferenced prefix-cache block out of hot memory, to ``warm`` or
        (with a cold store) ``cold``: what an idle node does; returns the blocks moved."""
        return self.pressure.offload(tier)

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

    # == tunables, statistics context, live control (cache/live.py) ==========================
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
            self.blocks.switch_policy(make_policy(value, self.arena.num_blocks))
        setattr(self.config, key, value)
        if key == "cooldown_s" and self.blocks.tiers is not None:
            self.blocks.tiers.cooldown_s = value
        return old

    def reset_stats(self) -> None:
        """Start a clean measurement: zero the counters (``stats()``'s, the tiers') and the
        latency windows. Sessions, blocks, tiers and tunables are kept."""
        self.blocks.reset_counters()
        self.latency.clear()
        self.batcher.tails = None  # its key counts quantized blocks, which just restarted from 0
        self._context_started = time.monotonic()

    @property
    def context_age_s(self) -> float:
        """Seconds since the statistics context started (construction or reset_stats)."""
        return time.monotonic() - self._context_started

    def _op_boundary(self, now_ns: int) -> None:
        """After a timed operation, at most every ``POLL_S``: apply the change requests the
        live plane's timer thread has read (in memory; the plane does the file work and
        publishes the snapshots: ``cache/live.py``).

        Each timed operation (``cache.stats.OP_KINDS``) inlines its own timing (two
        ``perf_counter_ns``, a ring append, this deadline check) instead of a decorator:
        a wrapper's extra frame doubled the cost per call on this machine, and decode runs
        ``num_layers + 1`` of them a step (``python -m cache overhead``)."""
        self._boundary_ns = now_ns + int(POLL_S * 1e9)
        if self.live is not None and self.live.inbox:
            try:
                self.live.apply_pending()
            except Exception:  # noqa: BLE001 -- a live node never fails an operation for this
                _log.exception("cache live control failed; the engine goes on")

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
        self.live = go_live(self, directory, self.live)

    def _leave_live(self) -> None:
        leave_live(self.live)
        self.live = None

    # == figures (cache/stats.py, cache/storage.py) ==========================================
    def stats(self) -> dict:
        return cache_stats(self)

    @property
    def tail_buffer_bytes(self) -> int:
        """Bytes the batch tail buffer kept for the next step holds, with the spare room of
        the memory it lies in (0: none)."""
        tails = self.batcher.tails  # read once: a live snapshot may run beside a batch step
        return tails.kv.untyped_storage().nbytes() if tails is not None else 0

    @property
    def full_precision_dtype(self) -> str:
        """Storage dtype of full-precision blocks: ``fp16`` for an fp16 cache, else ``fp32``."""
        return self.fresh

    def storage_dtypes(self) -> tuple[str, ...]:
        """The dtypes full blocks of this cache can be stored in."""
        return self.costs.dtypes()

    def bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Stored bytes per token of a full block in ``kv_dtype``, scales included."""
        return self.costs.bytes_per_token(kv_dtype)

    def slot_bytes(self, kv_dtype: str | None = None) -> int:
        """Bytes of the slot that holds one full block in ``kv_dtype`` (``BlockCosts``)."""
        return self.costs.slot_bytes(kv_dtype)

    def arena_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Arena bytes one token of a full ``kv_dtype`` block really costs (``BlockCosts``)."""
        return self.costs.arena_bytes_per_token(kv_dtype)
