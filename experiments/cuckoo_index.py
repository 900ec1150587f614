"""The block index studied: content hash (16-byte blake2b digest, ``cache/prefix.py``) -> Block record.

An experiment, not product code: the cache's block index (``cache/manager.py``,
``BlockManager.index``) is a plain ``dict``, the faster one measured below. This module keeps
the two implementations compared, with one mapping interface and ``make_index`` picking the
default, for ``experiments/bench_index.py``:

* ``DictIndex`` — a plain ``dict`` (a subclass that adds nothing, so ``get``/``[]`` stay the C
  hash table's: CPython hashes a ``bytes`` key once and caches it in the object).
* ``CuckooIndex`` — the article's cuckoo hash: a fixed-capacity table of ``2**k`` buckets x 4
  slots, two bucket functions (the digest's two little-endian 64-bit words, masked: a blake2b
  digest is already uniform, so no further mixing), and a lookup that compares the 4 slots of
  both candidate buckets at once with numpy. Inserts use cuckoo displacement (a random walk of
  at most ``MAX_KICKS`` kicks); a failed walk doubles the table and rehashes when the table is
  at least half full, otherwise the homeless entry goes to a small overflow dict (the "stash"),
  so adversarial keys (equal low bits in both words) stay correct with bounded memory.

Why the dict is the default: in CPython a lookup in the cuckoo table is a handful of numpy
calls (``take`` of two bucket rows, a vectorised compare, ``tobytes().find``), each a few
hundred ns of interpreter/ufunc dispatch, while ``dict.get`` is one C call. The vectorised
4-slot compare only pays off in C/SIMD or on a GPU, where the article's numbers come from.
Measured with ``python -m experiments.bench_index --json`` on this machine (2 CPU cores shared
with other work, CPython 3.11.7, numpy 2.4.6; a 65,536-slot table holding 32,768 / 58,982
blake2b keys, the dict the same keys; 5,000 batches of 100 random hit lookups each timed with
``time.perf_counter_ns`` and divided, dict and cuckoo interleaved, loop overhead of ~26-43 ns
included; ns per lookup)::

    index    p50 @ 50 %   p50 @ 90 %   p99 @ 50 %   p99 @ 90 %
    dict          189.0        357.4        362.1        605.7
    cuckoo       2254.9       2428.2       3005.8       3121.7

The cuckoo table is 7-12x slower at p50 and 5-8x at p99 (misses: dict 123 / 150 ns, cuckoo
2060 / 2121 ns p50). Repeated runs move the dict's hit p50 between ~185 and ~370 ns (it is
memory-bound at this size: random keys miss the CPU caches) and the cuckoo's by ~5 %; the
ordering never changed. Hence ``DEFAULT_KIND = "dict"``.

Key layout: the table keeps the keys in one ``(buckets, 4)`` numpy array of dtype ``S16``
(16-byte strings) rather than as ``uint64`` words: one compare per slot instead of two and an
``&`` (a one-off microbenchmark per lookup: ``S16`` ~1.9 us, a ``(buckets, 4, 2)`` ``uint64``
array ~4.5 us, two ``uint64`` arrays ~5.3 us). An ``S16`` compare ignores
trailing NUL bytes, which is harmless because every key is exactly 16 bytes; empty slots hold
``b""`` and a match is accepted only in an occupied slot (so the all-zero key works too).
The two words are still what the bucket functions read. Values live in a parallel Python list
(one slot per entry), keys also as ``bytes`` objects for iteration.

Semantics are a dict's (``MutableMapping``), with two differences: iteration order is slot
order, not insertion order, and iterating works on a snapshot (mutating while iterating does
not raise). ``CuckooIndex`` validates keys: a non-``bytes`` key raises ``TypeError`` and a
``bytes`` key of another length ``ValueError``, in every operation including ``get`` and
``in`` (a digest of the wrong size is a bug, not a miss).
"""

from __future__ import annotations

import random
from collections.abc import ItemsView, Iterator, KeysView, MutableMapping, ValuesView
from typing import Any, Generic, Literal, TypeVar, overload

import numpy as np

__all__ = ["CuckooIndex", "DEFAULT_KIND", "DictIndex", "KEY_BYTES", "SLOTS", "make_index"]

V = TypeVar("V")
D = TypeVar("D")

KEY_BYTES = 16
"""Key size: ``cache.prefix.block_hash`` digests (blake2b, ``digest_size=16``)."""
SLOTS = 4
"""Slots per bucket, compared at once."""
MAX_KICKS = 500
"""Displacements tried before an insert gives up (then grow, or stash below half load)."""
MIN_GROW_LOAD = 0.5
"""A failed insert doubles the table only at this load or above; below, it uses the stash."""
DEFAULT_KIND: Literal["dict", "cuckoo"] = "dict"
"""What ``make_index("auto")`` returns: the faster one measured (see the module docstring)."""

_EMPTY = b""


def _check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"index keys are {KEY_BYTES}-byte bytes digests, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"index keys are {KEY_BYTES}-byte digests, got {len(key)} bytes")


class DictIndex(dict[bytes, V], Generic[V]):
    """A plain ``dict`` from content hash to value; adds nothing, so lookups stay C-speed."""

    __slots__ = ()


class CuckooIndex(MutableMapping[bytes, V], Generic[V]):
    """Cuckoo hash table of ``buckets`` x 4 slots for 16-byte keys (see the module docstring).

    ``capacity`` is rounded up to a power-of-two number of 4-slot buckets. The table doubles
    when an insert finds no place at ``MIN_GROW_LOAD`` or above (or no free slot at all).
    """

    def __init__(self, capacity: int = 1024, *, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        buckets = 1
        while buckets * SLOTS < capacity:
            buckets *= 2
        self._rng = random.Random(seed)
        self._stash: dict[bytes, V] = {}
        self._size = 0
        self._alloc(buckets)

    def _alloc(self, buckets: int) -> None:
        self._buckets = buckets
        self._mask = buckets - 1
        self._keys = np.zeros((buckets, SLOTS), dtype=f"S{KEY_BYTES}")
        self._kobj: list[bytes | None] = [None] * (buckets * SLOTS)
        self._vals: list[Any] = [None] * (buckets * SLOTS)
        self._fill = [0] * buckets
        self._in_table = 0

    # -- geometry ------------------------------------------------------------------------
    @property
    def buckets(self) -> int:
        """Number of buckets (a power of two)."""
        return self._buckets

    @property
    def capacity(self) -> int:
        """Slots in the table: ``buckets * 4``."""
        return self._buckets * SLOTS

    @property
    def load_factor(self) -> float:
        """Entries over slots (``len(self) / capacity``; stash entries count)."""
        return self._size / (self._buckets * SLOTS)

    @property
    def stash_size(self) -> int:
        """Entries kept in the overflow dict (0 for uniform keys)."""
        return len(self._stash)

    def bucket_pair(self, key: bytes) -> tuple[int, int]:
        """The two candidate buckets of ``key``: its low and high 64-bit words, masked."""
        _check_key(key)
        return (int.from_bytes(key[:8], "little") & self._mask,
                int.from_bytes(key[8:], "little") & self._mask)

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(bucket, slot)`` of ``key`` in the table; None when absent or in the stash."""
        _check_key(key)
        i = self._find(key)
        return None if i < 0 else (i // SLOTS, i % SLOTS)

    # -- lookup --------------------------------------------------------------------------
    def _find(self, key: bytes) -> int:
        """Flat slot index of ``key`` in the table, -1 if not there (key already checked)."""
        mask = self._mask
        b1 = int.from_bytes(key[:8], "little") & mask
        b2 = int.from_bytes(key[8:], "little") & mask
        hits = (self._keys.take((b1, b2), 0) == key).tobytes()
        i = hits.find(1)
        while i >= 0:
            b = b1 if i < SLOTS else b2
            s = i & (SLOTS - 1)
            if s < self._fill[b]:
                return b * SLOTS + s
            i = hits.find(1, i + 1)  # an empty slot (b"") matched an all-zero key
        return -1

    @overload
    def get(self, key: bytes, /) -> V | None: ...
    @overload
    def get(self, key: bytes, default: V | D, /) -> V | D: ...
    def get(self, key: bytes, default: Any = None, /) -> Any:
        """``self[key]`` if present, else ``default``."""
        _check_key(key)
        i = self._find(key)
        if i >= 0:
            return self._vals[i]
        if self._stash:
            return self._stash.get(key, default)
        return default

    def __getitem__(self, key: bytes) -> V:
        _check_key(key)
        i = self._find(key)
        if i >= 0:
            return self._vals[i]  # type: ignore[no-any-return]
        if key in self._stash:
            return self._stash[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        _check_key(key)
        assert isinstance(key, bytes)
        return self._find(key) >= 0 or key in self._stash

    def __len__(self) -> int:
        return self._size

    # -- insert --------------------------------------------------------------------------
    def __setitem__(self, key: bytes, value: V) -> None:
        _check_key(key)
        i = self._find(key)
        if i >= 0:
            self._vals[i] = value
            return
        if key in self._stash:
            self._stash[key] = value
            return
        self._size += 1
        if self._in_table >= self._buckets * SLOTS:
            self._grow()
        homeless = self._place(key, value)
        if homeless is not None:
            if self.load_factor >= MIN_GROW_LOAD:
                self._grow(homeless)
            else:
                self._stash[homeless[0]] = homeless[1]

    def _put(self, b: int, key: bytes, value: Any) -> None:
        s = self._fill[b]
        self._keys[b, s] = key
        j = b * SLOTS + s
        self._kobj[j] = key
        self._vals[j] = value
        self._fill[b] = s + 1
        self._in_table += 1

    def _place(self, key: bytes, value: Any) -> tuple[bytes, Any] | None:
        """Put a new key in the table by cuckoo displacement; the entry left without a place
        after ``MAX_KICKS`` kicks is returned (it may be another key than ``key``)."""
        mask, fill = self._mask, self._fill
        b1 = int.from_bytes(key[:8], "little") & mask
        b2 = int.from_bytes(key[8:], "little") & mask
        if fill[b1] < SLOTS:
            self._put(b1, key, value)
            return None
        if fill[b2] < SLOTS:
            self._put(b2, key, value)
            return None
        rng = self._rng
        b = b1 if rng.random() < 0.5 else b2
        for _ in range(MAX_KICKS):
            s = rng.randrange(SLOTS)
            j = b * SLOTS + s
            victim, victim_value = self._kobj[j], self._vals[j]
            assert victim is not None
            self._keys[b, s] = key
            self._kobj[j], self._vals[j] = key, value
            key, value = victim, victim_value
            v1 = int.from_bytes(key[:8], "little") & mask
            v2 = int.from_bytes(key[8:], "little") & mask
            alt = v2 if v1 == b else v1
            if fill[alt] < SLOTS:
                self._put(alt, key, value)
                return None
            b = alt
        return key, value

    def _grow(self, extra: tuple[bytes, Any] | None = None) -> None:
        """Double the buckets and reinsert every entry (stash included); entries that find no
        place in the new table go to the stash."""
        entries = [(k, v) for k, v in zip(self._kobj, self._vals) if k is not None]
        entries.extend(self._stash.items())
        if extra is not None:
            entries.append(extra)
        self._alloc(self._buckets * 2)
        self._stash = {}
        for k, v in entries:
            homeless = self._place(k, v)
            if homeless is not None:
                self._stash[homeless[0]] = homeless[1]

    # -- delete --------------------------------------------------------------------------
    def __delitem__(self, key: bytes) -> None:
        _check_key(key)
        i = self._find(key)
        if i < 0:
            if key not in self._stash:
                raise KeyError(key)
            del self._stash[key]
            self._size -= 1
            return
        b, s = divmod(i, SLOTS)
        last = self._fill[b] - 1
        j = b * SLOTS + last
        if s != last:  # keep a bucket's entries in slots 0..fill-1
            self._keys[b, s] = self._keys[b, last]
            self._kobj[i], self._vals[i] = self._kobj[j], self._vals[j]
        self._keys[b, last] = _EMPTY
        self._kobj[j] = None
        self._vals[j] = None
        self._fill[b] = last
        self._in_table -= 1
        self._size -= 1

    def clear(self) -> None:
        """Remove every entry; the capacity stays."""
        self._alloc(self._buckets)
        self._stash = {}
        self._size = 0

    # -- iteration -----------------------------------------------------------------------
    def _entries(self) -> list[tuple[bytes, V]]:
        out = [(k, v) for k, v in zip(self._kobj, self._vals) if k is not None]
        out.extend(self._stash.items())
        return out

    def __iter__(self) -> Iterator[bytes]:
        return iter([k for k, _ in self._entries()])

    def keys(self) -> KeysView[bytes]:
        return KeysView(self)

    def items(self) -> ItemsView[bytes, V]:
        return _Items(self)

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def __repr__(self) -> str:
        return (f"CuckooIndex(len={self._size}, buckets={self._buckets}, "
                f"load_factor={self.load_factor:.3f}, stash={len(self._stash)})")


class _Items(ItemsView[bytes, V]):
    _mapping: CuckooIndex[V]

    def __iter__(self) -> Iterator[tuple[bytes, V]]:
        return iter(self._mapping._entries())


class _Values(ValuesView[V]):
    _mapping: CuckooIndex[V]

    def __iter__(self) -> Iterator[V]:
        return iter([v for _, v in self._mapping._entries()])


def make_index(kind: Literal["auto", "dict", "cuckoo"] = "auto",
               capacity: int = 1024) -> MutableMapping[bytes, Any]:
    """A new, empty block index: ``"dict"`` (``DictIndex``), ``"cuckoo"`` (``CuckooIndex`` of
    ``capacity`` slots, rounded up) or ``"auto"`` (``DEFAULT_KIND``, the faster one measured)."""
    if kind == "auto":
        kind = DEFAULT_KIND
    if kind == "dict":
        return DictIndex()
    if kind == "cuckoo":
        return CuckooIndex(capacity)
    raise ValueError(f"kind must be 'auto', 'dict' or 'cuckoo', got {kind!r}")
