"""Warm and cold tiers below the hot arena: where evicted prefix-cache blocks go instead of
vanishing, and where a prefix hit finds them again.

* **hot**: the TokenArena and the quantized BlockPool (``cache/manager.py``);
* **warm**: CPU bytes of each block in its own storage format (quantized in int8/int4 caches,
  so warm costs what the compact form costs), bounded by ``warm_bytes``, LRU inside;
* **cold**: a ``SegmentStore`` on disk (``cache/segments/``: checksummed, atomic, optionally
  AES-GCM), memory-mapped on read, when the cache was opened on a directory.

A block leaves hot only when the hot tier needs its room (demotion under pressure) and comes
back on a prefix hit (promotion). The cooldown (seed 004) keeps a block that just moved from
being moved again by pressure for ``cooldown_s``: a block promoted a moment ago is demoted only
when nothing else can go, and a warm block that just arrived is not pushed on to cold before
older ones. A read always restores (correctness first).
"""

from __future__ import annotations

import struct
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol


@dataclass
class TierEntry:
    """A block outside the hot tier: its bytes and what the index needs to trust them."""

    payload: bytes
    tokens: list[int]
    version: int
    parent: bytes
    format: str
    moved_at: float
    last_access: int = 0
    frequency: int = 0
    dirty: bool = True
    """Not in the cold store yet (a block restored from cold and not changed is clean)."""

    def to_record(self) -> tuple[bytes, dict]:
        """(payload, meta) for the cold store. Token ids and the parent hash go inside the
        payload (encrypted at rest); meta and the record key (the block's content hash) go
        into the manifest, sealed in an encrypted store (on disk a record names only its
        keyed id: ``cache/segments/record.py``), in the clear in a plain one."""
        head = struct.pack("<IB", len(self.tokens), len(self.parent))
        payload = head + array("i", self.tokens).tobytes() + self.parent + self.payload
        meta = {"kind": "kv", "version": self.version, "format": self.format,
                "last_access": self.last_access, "frequency": self.frequency}
        return payload, meta

    @classmethod
    def from_record(cls, payload: bytes, meta: dict, now: float) -> "TierEntry":
        n, plen = struct.unpack_from("<IB", payload)
        toks = array("i")
        toks.frombytes(payload[5 : 5 + 4 * n])
        a = 5 + 4 * n
        return cls(bytes(payload[a + plen :]), list(toks), int(meta["version"]),
                   bytes(payload[a : a + plen]), str(meta["format"]), now,
                   int(meta.get("last_access", 0)), int(meta.get("frequency", 0)), dirty=False)


class ColdStore(Protocol):
    """What the cold tier needs of ``cache.segments.SegmentStore``."""

    def put(self, key: bytes, payload: bytes, meta: dict) -> None: ...
    def commit(self) -> None: ...
    def get(self, key: bytes) -> bytes: ...
    def meta(self, key: bytes) -> dict: ...
    def delete(self, key: bytes) -> None: ...
    def drop_where(self, pred: Callable[[dict], bool]) -> int: ...
    def keys(self) -> list[bytes]: ...
    def keys_hottest_first(self) -> list[bytes]: ...
    def stats(self) -> dict: ...
    def compact(self) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...


@dataclass
class TierStats:
    warm_hits: int = 0
    cold_hits: int = 0
    misses: int = 0
    swaps_out_warm: int = 0
    swaps_out_cold: int = 0
    swaps_in: int = 0
    dropped: int = 0
    cold_corrupt: int = 0
    cold_write_failures: int = 0
    remote_hits: int = 0
    """Cold hits served by a shared store (the Redis tier), not counted in ``cold_hits``."""
    cold_unavailable: int = 0
    """Lookups the cold store could not answer (a Redis tier down or slow): misses."""


@dataclass
class Tiers:
    warm_bytes: int
    cooldown_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    cold: ColdStore | None = None
    warm: OrderedDict[bytes, TierEntry] = field(default_factory=OrderedDict)
    warm_used: int = 0
    stats: TierStats = field(default_factory=TierStats)
    on_warning: Callable[[str], None] = lambda msg: None
    bad: set[bytes] = field(default_factory=set)
    """Cold records found corrupt: dropped, never read again (the block is recomputed)."""

    def put(self, key: bytes, entry: TierEntry) -> None:
        """Demote a block from hot: into warm, pushing the oldest warm blocks down first."""
        entry.moved_at = self.clock()
        self._make_warm_room(len(entry.payload))
        if len(entry.payload) > self.warm_bytes:
            self._to_cold(key, entry)
            return
        self.warm[key] = entry
        self.warm_used += len(entry.payload)
        self.stats.swaps_out_warm += 1

    def _make_warm_room(self, need: int) -> None:
        now = self.clock()
        while self.warm and self.warm_used + need > self.warm_bytes:
            key = self._warm_victim(now)
            entry = self.warm.pop(key)
            self.warm_used -= len(entry.payload)
            self._to_cold(key, entry)

    def _warm_victim(self, now: float) -> bytes:
        """The oldest warm block past its cooldown, else the oldest."""
        for key, e in self.warm.items():
            if now - e.moved_at >= self.cooldown_s:
                return key
        return next(iter(self.warm))

    def _to_cold(self, key: bytes, entry: TierEntry) -> None:
        if self.cold is None:
            self.stats.dropped += 1
            return
        if not entry.dirty and key in self.cold:  # the cold copy is already this block
            return
        try:
            self.cold.put(key, *entry.to_record())
            self.stats.swaps_out_cold += 1
        except OSError as e:  # a full disk: memory-only from here on, nothing committed lost
            self.stats.cold_write_failures += 1
            self.stats.dropped += 1
            self.on_warning(f"cold tier write failed ({type(e).__name__}: {e}); the block is "
                            f"dropped from the cache and will be recomputed if needed")

    def take(self, key: bytes) -> TierEntry | None:
        """Promote: remove and return the block held for ``key`` in warm or cold."""
        entry = self.warm.pop(key, None)
        if entry is not None:
            self.warm_used -= len(entry.payload)
            self.stats.warm_hits += 1
            self.stats.swaps_in += 1
            return entry
        if self.cold is not None and key not in self.bad and key in self.cold:
            try:
                entry = TierEntry.from_record(self.cold.get(key), self.cold.meta(key), self.clock())
            except OSError:  # a shared store unreachable now: a miss, the key not marked bad
                self.stats.cold_unavailable += 1
                self.stats.misses += 1
                return None
            except Exception as e:  # noqa: BLE001 -- a corrupt record is dropped, recomputed
                self._drop_corrupt(key, e)
                self.stats.misses += 1
                return None
            if getattr(self.cold, "last_remote", False):
                self.stats.remote_hits += 1
            else:
                self.stats.cold_hits += 1  # the cold copy stays: the block comes back clean
            self.stats.swaps_in += 1
            return entry
        self.stats.misses += 1
        return None

    @property
    def shared(self) -> bool:
        """The cold store is shared with other processes (the Redis tier): blocks are written
        through when computed and prefix walks read it in one batch."""
        return bool(getattr(self.cold, "shared", False))

    def prefetch(self, keys: list[bytes]) -> None:
        """Before a prefix walk: fetch the blocks of ``keys`` not in warm from a shared
        store in one batched read (the walk's ``take`` calls then read that batch)."""
        if self.shared:
            self.cold.prefetch([k for k in keys if k not in self.warm and k not in self.bad])

    def publish(self, key: bytes, entry: TierEntry) -> None:
        """Write a block just computed through to a shared store (queued there, off the
        request path), so another process finds it before this one ever evicts it."""
        if self.shared:
            self.cold.publish(key, *entry.to_record())

    def _drop_corrupt(self, key: bytes, err: Exception) -> None:
        self.stats.cold_corrupt += 1
        self.bad.add(key)
        self.on_warning(f"cold block dropped, will be recomputed: {type(err).__name__}: {err}")
        try:
            self.cold.delete(key)
        except KeyError:  # already dropped
            pass

    def drop_versions_where(self, stale: Callable[[int], bool]) -> list[tuple[bytes, int]]:
        """Drop warm and cold blocks whose model version is ``stale``; (key, version) of each."""
        gone = []
        for key in [k for k, e in self.warm.items() if stale(e.version)]:
            e = self.warm.pop(key)
            self.warm_used -= len(e.payload)
            gone.append((key, e.version))
        if self.cold is not None:  # one pass: staged records included, each meta read once
            for key in self.cold.keys():
                meta = self.cold.meta(key)
                if meta.get("kind") == "kv" and stale(int(meta["version"])):
                    self.cold.delete(key)
                    gone.append((key, int(meta["version"])))
        return gone

    def flush(self, entries: dict[bytes, TierEntry], strict: bool = False) -> None:
        """Write ``entries`` (hot blocks worth keeping) and every dirty warm block to cold and
        commit: what a restart will find. ``strict``: a failed commit raises (else a warning)."""
        if self.cold is None:
            return
        for key, e in list(entries.items()) + list(self.warm.items()):
            self._to_cold(key, e)
            e.dirty = False
        try:
            self.cold.commit()
        except OSError as e:
            self.stats.cold_write_failures += 1
            if strict:
                raise
            self.on_warning(f"cold tier commit failed ({type(e).__name__}: {e}); blocks since "
                            f"the last commit stay in memory only")

    def spill_warm(self) -> int:
        """Move every warm block to cold (when there is a cold store); returns how many."""
        if self.cold is None:
            return 0
        n = len(self.warm)
        while self.warm:
            key, entry = self.warm.popitem(last=False)
            self.warm_used -= len(entry.payload)
            self._to_cold(key, entry)
        return n

    def prewarm(self, budget: int) -> int:
        """Warm restart: copy the hottest cold blocks into warm, up to ``budget`` bytes
        (the rest are restored lazily on a hit); returns how many."""
        if self.cold is None:
            return 0
        n = 0
        for key in self.cold.keys_hottest_first():
            meta = self.cold.meta(key)
            if meta.get("kind") != "kv" or key in self.warm or key in self.bad:
                continue
            try:
                e = TierEntry.from_record(self.cold.get(key), meta, self.clock() - self.cooldown_s)
            except Exception as err:  # noqa: BLE001 -- corrupt: dropped, recomputed later
                self._drop_corrupt(key, err)
                continue
            if self.warm_used + len(e.payload) > budget:
                break
            self.warm[key] = e
            self.warm_used += len(e.payload)
            n += 1
        return n

    def bytes_by_tier(self) -> dict[str, int]:
        out = {"warm": self.warm_used}
        if self.cold is not None:
            out["cold"] = int(getattr(self.cold, "stats", lambda: {})().get("bytes_on_disk", 0))
        return out
