"""KVCache: paged K/V blocks with prefix sharing, copy-on-write, quantization and reclamation.

Flow of one decoding step (what ``node.model`` does)::

    kv.reserve(sid, new_tokens)        # slots for t tokens; copies a shared tail block first
    for layer: kv.write(sid, layer, k, v); keys, values = kv.read(sid, layer)
    # after the last layer the tokens are complete: full blocks get a content hash (prefix
    # sharing) and blocks that left the full-precision window are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from cache.block_table import BlockTable
from cache.config import CacheConfig
from cache.errors import (
    CacheFullError,
    ClosedSessionError,
    LayerIndexError,
    ReservationError,
    ShapeMismatchError,
    StaleSessionError,
    TensorDTypeError,
    UnknownSessionError,
)
from cache.policy import EvictionPolicy, LRUPolicy
from cache.pool import BlockPool
from cache.prefix import ROOT, block_hash
from cache.layout import BlockLayout, pad_bytes
from cache.quant import BlockFormat, relative_error
from cache.tensor_store import TensorStore


@dataclass
class BlockMeta:
    tokens: list[int]
    version: int
    hash: bytes | None = None  # set once the block is full and complete in every layer
    quantized: bool = False
    keep_fp: bool = False  # quantization error passed the threshold: stays full precision
    error: float = 0.0


class KVCache:
    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None):
        self.config = c = config
        self.pool = BlockPool(
            c.pool_bytes, c.superblock_bytes, c.managed_block_bytes, c.page_bytes,
            pad_bytes=pad_bytes(c),
        )
        self.layout = BlockLayout(c, self.pool)
        self.fresh = self.layout.fresh
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self.tensors = TensorStore()
        self.version = 0
        self._meta: dict[int, BlockMeta] = {}
        self._index: dict[bytes, int] = {}
        self._sessions: dict[int, BlockTable] = {}
        self._next_sid = 0
        self._epoch = 0  # bumped whenever a block changes location; invalidates gather plans
        self._counters = dict.fromkeys(
            ("prefix_lookups", "prefix_hit_blocks", "prefix_miss_blocks", "prefix_hit_tokens",
             "evictions", "cow_copies", "dedup_blocks", "quantized_blocks",
             "rematerialised_blocks", "quant_skipped_full", "tail_moves", "alloc_failures",
             "eviction_collateral"), 0)
        # eviction_collateral: the most cached blocks evicted to make room for one block

    # == sessions ===========================================================================
    def open_session(self) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self._sessions[sid] = BlockTable(sid, self.config.block_size, self.version)
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
                f"version {self.version}; call reset_session({sid}) and prefill again"
            )
        return t

    def is_stale(self, sid: int) -> bool:
        """True when the session's K/V predate the current model version."""
        return self._table(sid, allow_stale=True).stale

    def length(self, sid: int) -> int:
        return self._table(sid).length

    def tokens(self, sid: int) -> list[int]:
        return list(self._table(sid, allow_stale=True).tokens[: self._sessions[sid].length])

    def close_session(self, sid: int) -> None:
        """Release the session's blocks (full ones stay as unreferenced prefix-cache entries)
        and drop its table, so closed sessions cost nothing in later loops over sessions;
        using ``sid`` afterwards raises ClosedSessionError."""
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
        child = self.open_session()
        c = self._sessions[child]
        c.blocks, c.tokens, c.length = list(t.blocks), list(t.tokens), t.length
        for b in c.blocks:
            self.pool.incref(b)
        return child

    def _release(self, t: BlockTable) -> None:
        for b in reversed(t.blocks):  # tails first, so LRU reclaims tails before shared roots
            self._decref(b)
        t.blocks, t.pending, t.written, t.gather_plan = [], 0, set(), None
        t.quant_checked = 0
        t.tokens = t.tokens[: t.length]

    def _decref(self, b: int) -> None:
        if self.pool.decref(b) == 0:
            m = self._meta[b]
            if m.hash is not None and self._index.get(m.hash) == b:
                self.policy.add(b)  # still a prefix-cache entry: reclaimable, not freed
            else:
                self._free(b)

    def _free(self, b: int) -> None:
        m = self._meta.pop(b)
        if m.hash is not None and self._index.get(m.hash) == b:
            del self._index[m.hash]
        self.policy.remove(b)
        self.pool.free(b)
        self._epoch += 1

    # == allocation ========================================================================
    def _allocate(self, classes: Sequence[str]) -> int:
        """A new block in the first of ``classes`` with room (see :meth:`_make_room`)."""
        return self.pool.allocate(self._make_room(classes))

    def _make_room(self, classes: Sequence[str]) -> str:
        """The first of ``classes`` with a free slot. Every class is tried before anything is
        evicted, and then only the fewest cached blocks that free such a slot go, so a small
        allocation never flushes unrelated prefix-cache entries. CacheFullError when nothing
        reclaimable helps."""
        room = self._room_in(classes)
        if room is not None:
            return room
        victims = self._victims_for(classes)
        for b in victims:
            self._free(b)
        self._counters["evictions"] += len(victims)
        self._counters["eviction_collateral"] = max(
            self._counters["eviction_collateral"], len(victims))
        room = self._room_in(classes)
        if room is None:
            raise CacheFullError(
                f"cache full: all {len(self._meta)} blocks are referenced by "
                f"{len(self._sessions)} open sessions "
                f"(pool {self.config.pool_bytes} bytes); close sessions or grow pool_bytes"
            )
        return room

    def _room_in(self, classes: Sequence[str]) -> str | None:
        return next((c for c in classes if self.pool.has_room(c)), None)

    def _victims_for(self, classes: Sequence[str]) -> list[int]:
        """The fewest evictable blocks whose eviction frees a slot in one of ``classes``: the
        policy's first block of such a class, or alone in its slab; else every block of the
        fully evictable slab that holds the fewest; [] when no slab can be freed."""
        by_slab: dict[int, list[int]] = {}
        for b in self.policy.candidates():
            cls, slab, _ = self.pool.location(b)
            if cls in classes or self.pool.slab_live(slab) == 1:
                return [b]
            by_slab.setdefault(slab, []).append(b)
        whole = [bs for s, bs in by_slab.items() if len(bs) == self.pool.slab_live(s)]
        return min(whole, key=len, default=[])

    # == prefix sharing ====================================================================
    def match_prefix(self, sid: int, tokens: Iterable[int]) -> int:
        """Attach the longest cached prefix of ``tokens`` (whole blocks) to an empty session.

        At most ``len(tokens) - 1`` tokens are reused so the caller still computes the logits
        of the last prompt token. Returns the number of tokens reused.
        """
        t = self._table(sid)
        toks = [int(x) for x in tokens]
        if t.length or t.pending:
            raise ReservationError(f"match_prefix needs an empty session; {sid} has tokens")
        B = self.config.block_size
        self._counters["prefix_lookups"] += 1
        parent = ROOT
        for i in range((len(toks) - 1) // B):
            chunk = toks[i * B : (i + 1) * B]
            h = block_hash(parent, chunk, self.version)
            b = self._index.get(h)
            if b is None or self._meta[b].tokens != chunk:
                self._counters["prefix_miss_blocks"] += 1
                break
            if self.pool.incref(b) == 1:
                self.policy.remove(b)
            t.blocks.append(b)
            parent = h
            self._counters["prefix_hit_blocks"] += 1
        t.length = len(t.blocks) * B
        t.tokens = toks[: t.length]
        self._counters["prefix_hit_tokens"] += t.length
        return t.length

    # == writing ===========================================================================
    def reserve(self, sid: int, tokens: Iterable[int]) -> None:
        """Make room for new tokens; allocation is all-or-nothing."""
        t = self._table(sid)
        toks = [int(x) for x in tokens]
        if not toks:
            raise ShapeMismatchError("reserve needs at least one token")
        if t.pending:
            raise ReservationError(
                f"session {sid}: {t.pending} reserved tokens are not written in every layer yet "
                f"(done: {sorted(t.written)})"
            )
        B = self.config.block_size
        total = t.length + len(toks)
        new_blocks: list[int] = []
        tail: tuple[int, int] | None = None  # (old last block, its replacement)
        try:
            if t.length % B:
                old = t.blocks[-1]
                n = min(B, total - (len(t.blocks) - 1) * B)
                too_small = self.layout.capacity[self.pool.location(old)[0]] < n
                if self.pool.refcount(old) > 1 or too_small:
                    # copy-on-write and/or a bigger slot
                    tail = (old, self._allocate(self.layout.classes_for(n)))
            need = t.blocks_needed(total) - len(t.blocks)
            for i in range(need):
                n = min(B, total - (len(t.blocks) + i) * B)
                new_blocks.append(self._allocate(self.layout.classes_for(n)))
        except CacheFullError:
            self._counters["alloc_failures"] += 1  # refused to the caller, nothing changed
            for b in new_blocks + ([tail[1]] if tail else []):
                self.pool.decref(b)
                self.pool.free(b)
            raise
        if tail:
            old, new = tail
            n = t.length % B
            self.layout.view_of(new)[..., :n, :] = self.layout.view_of(old)[..., :n, :]
            om = self._meta[old]
            self._meta[new] = BlockMeta(list(om.tokens), om.version)
            t.blocks[-1] = new
            t.gather_plan = None
            shared = self.pool.refcount(old) > 1
            self._decref(old)
            self._counters["cow_copies" if shared else "tail_moves"] += 1
        for b in new_blocks:
            self._meta[b] = BlockMeta([], self.version)
        t.blocks.extend(new_blocks)
        t.tokens = t.tokens[: t.length] + toks
        t.pending = len(toks)
        t.written = set()

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise LayerIndexError(
                f"layer {layer!r} out of range: the cache has {self.config.num_layers} layers"
            )

    def write(self, sid: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of the reserved tokens for one layer; k, v: [heads, pending, head_dim]."""
        t = self._table(sid)
        self._check_layer(layer)
        c = self.config
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TensorDTypeError(
                    f"{name} must be a floating-point torch.Tensor, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}"
                )
            want = (c.num_heads, t.pending, c.head_dim)
            if tuple(x.shape) != want:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(x.shape)}, expected {want} "
                    f"(heads, reserved tokens, head_dim) for session {sid}"
                )
        if not t.pending:
            raise ReservationError(f"session {sid}: nothing reserved; call reserve() first")
        if layer in t.written:
            raise ReservationError(f"session {sid}: layer {layer} already written for this step")
        pos, done = t.length, 0
        kk, vv = k.detach().to(self.layout.dtype), v.detach().to(self.layout.dtype)
        while done < t.pending:
            bi, off = t.slot(pos)
            n = min(c.block_size - off, t.pending - done)
            view = self.layout.view_of(t.blocks[bi])
            view[layer, 0, :, off : off + n] = kk[:, done : done + n]
            view[layer, 1, :, off : off + n] = vv[:, done : done + n]
            pos, done = pos + n, done + n
        t.written.add(layer)
        if len(t.written) == c.num_layers:
            self._commit(t)

    def _commit(self, t: BlockTable) -> None:
        """All layers written: tokens become complete; hash full blocks; quantize old ones."""
        B = self.config.block_size
        start, t.length = t.length, t.length + t.pending
        t.pending, t.written = 0, set()
        for bi in range(start // B, t.blocks_needed(t.length)):
            m = self._meta[t.blocks[bi]]
            m.tokens = t.tokens[bi * B : min((bi + 1) * B, t.length)]
            if len(m.tokens) == B and m.hash is None:
                self._register(t, bi)
        if self.config.kv_dtype in ("int8", "int4"):
            limit = (t.length - self.config.fp_window) // B
            for bi in range(t.quant_checked, limit):  # only blocks that just left the window
                b = t.blocks[bi]
                m = self._meta[b]
                if not (m.quantized or m.keep_fp):
                    self._quantize(t, b, m)
            t.quant_checked = max(t.quant_checked, limit)

    def _register(self, t: BlockTable, bi: int) -> None:
        b = t.blocks[bi]
        m = self._meta[b]
        parent = self._meta[t.blocks[bi - 1]].hash if bi else ROOT
        if parent is None:  # an earlier block of a forked chain is still unhashed
            return
        m.hash = block_hash(parent, m.tokens, m.version)
        other = self._index.get(m.hash)
        if other is None:
            self._index[m.hash] = b
        elif other != b and self.pool.refcount(b) == 1 and self._meta[other].tokens == m.tokens:
            # the same block was computed by another session: keep one copy
            if self.pool.incref(other) == 1:
                self.policy.remove(other)
            t.blocks[bi] = other
            t.gather_plan = None
            m.hash = None
            self._decref(b)
            self._counters["dedup_blocks"] += 1

    def _quantize(self, t: BlockTable, b: int, m: BlockMeta) -> None:
        c = self.config
        kv = self.layout.view_of(b).float()  # [L, 2, H, B, D], a full fresh block
        fmt = self.layout.formats[c.kv_dtype]
        raw = fmt.encode(kv[:, 0], kv[:, 1])
        k_hat, v_hat = fmt.decode(raw)
        err = relative_error(kv[:, 0], kv[:, 1], k_hat, v_hat)
        m.error = err
        if err > c.requant_error_threshold:
            m.keep_fp = True
            self._counters["rematerialised_blocks"] += 1
            return
        try:
            self.pool.move(b, self._make_room([c.kv_dtype]))
        except CacheFullError:
            m.keep_fp = True  # everything is pinned: stays full precision, not retried
            self._counters["quant_skipped_full"] += 1
            return
        self.pool.slot_bytes_of(b)[: raw.numel()].copy_(raw.reshape(-1))
        m.quantized = True
        self._epoch += 1
        self._counters["quantized_blocks"] += 1

    # == reading ===========================================================================
    def read(self, sid: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every readable token in ``layer``: each [heads, n, head_dim],
        float32 (quantized blocks are dequantized here, before attention's softmax)."""
        t = self._table(sid)
        self._check_layer(layer)
        n = t.layer_length(layer)
        nb = t.blocks_needed(n)
        key = (self._epoch, nb, len(t.blocks))
        if t.gather_key != key or t.gather_plan is None:
            t.gather_key, t.gather_plan = key, self.layout.plan(t.blocks[:nb])
        return self.layout.gather(t.gather_plan, layer, nb, n)

    # == model versions and tensors ========================================================
    def bump_version(self) -> int:
        """A new model version: every cached K/V block becomes unreachable for new lookups,
        unreferenced ones are freed, and open sessions turn stale (reset_session to reuse)."""
        self.version += 1
        for t in self._sessions.values():
            if t.version < self.version:
                self._release(t)
                t.stale = True
        for b in [b for b, m in self._meta.items() if m.version < self.version]:
            m = self._meta[b]
            if m.hash is not None and self._index.get(m.hash) == b:
                del self._index[m.hash]
            m.hash = None
            if self.pool.refcount(b) == 0:
                self._free(b)
        return self.version

    def put_tensor(self, name: str, tensor: torch.Tensor, version: int | None = None) -> int:
        return self.tensors.put(name, tensor, version)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors.get(name)

    def tensor_version(self, name: str) -> int:
        return self.tensors.version(name)

    # == figures ===========================================================================
    def bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Stored bytes per token of a full block in ``kv_dtype``, scales included."""
        fmt = self.layout.formats.get(kv_dtype or self.config.kv_dtype) or BlockFormat(
            kv_dtype, self.config.quant_scheme, self.config.num_heads,
            self.config.block_size, self.config.head_dim,
        )
        return fmt.layer_bytes * self.config.num_layers / self.config.block_size

    def stats(self) -> dict:
        c = self.config
        refs = [self.pool.refcount(b) for b in self._meta]
        by_class: dict[str, int] = {}
        token_bytes = live_token_bytes = live_slot_bytes = 0.0
        for b, m in self._meta.items():
            cls = self.pool.location(b)[0]
            slot = self.pool.classes[cls].slot_bytes
            by_class[cls] = by_class.get(cls, 0) + slot
            per_token = (self.layout.formats[cls].layer_bytes * c.num_layers
                         / self.layout.capacity[cls])
            token_bytes += per_token * len(m.tokens)
            if self.pool.refcount(b):
                live_token_bytes += per_token * len(m.tokens)
                live_slot_bytes += slot
        live = self.pool.live_slot_bytes()
        lookups = self._counters["prefix_hit_blocks"] + self._counters["prefix_miss_blocks"]
        free_fresh = self.pool.free_slots(self.fresh)
        errors = [m.error for m in self._meta.values() if m.quantized]
        return {
            **self._counters,
            "prefix_hit_rate": self._counters["prefix_hit_blocks"] / lookups if lookups else 0.0,
            "model_version": self.version,
            "sessions_open": len(self._sessions),
            "blocks_used": len(self._meta),
            "blocks_referenced": sum(r > 0 for r in refs),
            "blocks_shared": sum(r > 1 for r in refs),
            "blocks_cached_unreferenced": len(self.policy),
            "blocks_free_fresh": free_fresh,
            "bytes_by_dtype": by_class,
            "bytes_allocated": live,
            "bytes_holding_tokens": token_bytes,
            "kv_utilisation": token_bytes / live if live else 0.0,
            "kv_utilisation_live": live_token_bytes / live_slot_bytes if live_slot_bytes else 0.0,
            "mean_quant_error": sum(errors) / len(errors) if errors else 0.0,
            "tensor_bytes": self.tensors.nbytes(),
            **{f"pool_{k}": v for k, v in self.pool.utilisation().items()},
        }

    # == read-only figures for tools (bench_kv reads the engine only through these) ========
    @property
    def full_precision_dtype(self) -> str:
        """Storage dtype of full-precision blocks: ``fp16`` for an fp16 cache, else ``fp32``."""
        return self.fresh

    def storage_dtypes(self) -> tuple[str, ...]:
        """The dtypes full blocks of this cache can be stored in."""
        return tuple(dict.fromkeys((self.fresh, self.config.kv_dtype)))

    def slot_bytes(self, kv_dtype: str | None = None) -> int:
        """Bytes of the pool slot that holds one full block in ``kv_dtype`` (page-rounded);
        ``kv_dtype`` must be one of :meth:`storage_dtypes`."""
        return self.pool.classes[self._storage_class(kv_dtype)].slot_bytes

    def arena_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Arena bytes one token of a full ``kv_dtype`` block really costs: a managed block's
        bytes over the full blocks it holds, over ``block_size`` (slot rounding and the
        managed block's unusable tail counted); ``kv_dtype`` as in :meth:`slot_bytes`."""
        sc = self.pool.classes[self._storage_class(kv_dtype)]
        return self.pool.slab_bytes / sc.slots_per_slab / self.config.block_size

    def _storage_class(self, kv_dtype: str | None) -> str:
        d = kv_dtype or self.config.kv_dtype
        if d not in self.storage_dtypes():
            raise ValueError(f"this cache stores full blocks as {self.storage_dtypes()}, not "
                             f"{d!r}; build a KVCache with kv_dtype={d!r}")
        return d
