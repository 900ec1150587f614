"""Which unreferenced cached block to reclaim first: policies keyed by content hash.

A block is evictable when no session references it but its content stays cached for prefix
hits. The engine tells the policy when a block becomes evictable (``insert``), when it stops
being one (``remove``: referenced again or freed) and about every hit, also on referenced
blocks (``hit``), and asks for ``victims(n)``. Keys are content hashes, which outlive the
block that held them, so a policy may keep history (ARC's ghost lists, LFU counts) across
evictions. The engine never offers a referenced block.

Policies here (``POLICIES``, ``make_policy``): LRU (the engine's default), LFU, a time-decayed
LRU/LFU hybrid (LRFU), ARC (Megiddo & Modha 2003) and ``adaptive``, the hybrid with a half
life chosen online by sampled shadow caches (this project's). Every policy answers
``victims(n)`` for batch eviction (``EVICT_BATCH`` keys a round) and releases chain tails
before shared roots: the engine inserts a session's blocks tail first and every policy breaks
ties by that order. ``insert`` also takes an optional ``parent`` (the previous block's hash);
no policy here needs it yet, it is accepted so an engine may pass it.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count
from typing import Callable, Protocol

EVICT_BATCH = 16
"""Keys to free per eviction round (SGLang's ``evict_batch``): one ``victims`` call, amortized."""


class EvictionPolicy(Protocol):
    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        """The block with content ``key`` became evictable (``parent``: the previous block's
        hash in its chain, when the caller knows it; policies may ignore it)."""

    def remove(self, key: bytes) -> None:
        """``key`` is referenced again or its block was freed: not a candidate any more."""

    def hit(self, key: bytes) -> None:
        """A prefix hit on ``key`` (evictable or not)."""

    def victims(self, n: int) -> list[bytes]:
        """Up to ``n`` evictable keys, best victim first (the engine then frees them)."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first. The engine releases a session's blocks tail first, so among
    blocks released together the chain tails go before the shared roots (vLLM's order)."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def hit(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def victims(self, n: int) -> list[bytes]:
        out = []
        for key in self._order:
            if len(out) == n:
                break
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class _HeapPolicy:
    """Shared machinery: evictable keys in a lazy min-heap of ``(priority, seq, key)``; a key's
    live entry is the one whose ``seq`` matches. ``_priority`` is fixed when a key is pushed, so
    every update is O(log n) and ``victims(n)`` is O(n log n) (pop the best n, push them back)."""

    history: int = 1 << 20

    def __init__(self) -> None:
        self._live: dict[bytes, tuple[tuple, int]] = {}
        self._heap: list[tuple[tuple, int, bytes]] = []
        self._seq = count()
        self._clock = 0  # one tick per insert or hit: the recency scale
        self._hit_seen: set[bytes] = set()  # hit since its last insert

    def _priority(self, key: bytes) -> tuple:
        raise NotImplementedError

    def _access(self, key: bytes) -> None:
        """Record one access to ``key`` (a hit, or the use after a miss) at ``self._clock``."""
        raise NotImplementedError

    def _push(self, key: bytes) -> None:
        prio, seq = self._priority(key), next(self._seq)
        self._live[key] = (prio, seq)
        heapq.heappush(self._heap, (prio, seq, key))
        if len(self._heap) > 2 * len(self._live) + 1024:  # drop stale entries in one go
            self._heap = [(pr, sq, k) for k, (pr, sq) in self._live.items()]
            heapq.heapify(self._heap)

    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        self._clock += 1
        if key in self._hit_seen:  # its access was counted by ``hit``
            self._hit_seen.discard(key)
        else:  # a miss: the first use of a freshly computed block is an access too
            self._access(key)
        self._on_release(key)
        self._push(key)

    def _on_release(self, key: bytes) -> None:
        """``key`` became evictable now (before its heap key is computed)."""

    def remove(self, key: bytes) -> None:
        self._live.pop(key, None)

    def hit(self, key: bytes) -> None:
        self._clock += 1
        self._access(key)
        if len(self._hit_seen) > self.history:  # hits on keys freed while referenced
            self._hit_seen.clear()
        self._hit_seen.add(key)
        if key in self._live:
            self._push(key)

    def victims(self, n: int) -> list[bytes]:
        out: list[tuple[tuple, int, bytes]] = []
        heap, live = self._heap, self._live
        while heap and len(out) < min(n, len(live)):
            entry = heapq.heappop(heap)
            cur = live.get(entry[2])
            if cur is not None and cur[1] == entry[1]:
                out.append(entry)
        for entry in out:
            heapq.heappush(heap, entry)
        return [e[2] for e in out]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def _trim(self, stats: dict) -> None:
        """Bound the per-key history (``history`` keys, well above any cache size): forget the
        oldest half of the keys that are neither evictable nor awaiting their release."""
        if len(stats) > self.history:
            keep = self._live.keys() | self._hit_seen
            for k in [k for k in list(stats)[: len(stats) // 2] if k not in keep]:
                del stats[k]


class LFUPolicy(_HeapPolicy):
    """Least frequently used first, ties by least recent (SGLang's LFU: ``(hits, last_access)``).

    frequency = accesses seen on the key: hits plus misses (kept across evictions: hashes
    outlive blocks); recency = the clock tick of the last release (insert). Tails released
    before their roots carry the older tick, so at equal frequency the tail goes first."""

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict[bytes, int] = {}
        self._last: dict[bytes, int] = {}

    def _access(self, key: bytes) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        self._last[key] = self._clock
        self._trim(self._freq)

    def _on_release(self, key: bytes) -> None:
        self._last[key] = self._clock  # recency = the release, as LRU's

    def _trim(self, stats: dict) -> None:
        super()._trim(stats)
        if len(self._last) > len(self._freq):
            self._last = {k: v for k, v in self._last.items() if k in self._freq}

    def _priority(self, key: bytes) -> tuple:
        return (self._freq[key], self._last[key])


@dataclass
class HybridPolicy(_HeapPolicy):
    """The hybrid LRU/LFU as a time-decayed frequency (LRFU, Lee et al. 2001).

    Every access (a hit, or the release after a miss's first use) at clock tick ``t_i`` adds
    weight 1 that halves every ``half_life`` ticks (one tick per insert or hit call)::

        score(t) = sum_i 2 ** (-(t - t_i) / half_life)        evict the lowest score first

    ``half_life`` -> 0 is LRU, -> infinity is LFU. Ranking by score at a common ``t`` equals
    ranking by the static key ``log2(score(t_last)) + t_last / half_life``, so the heap key is
    fixed at push time (O(log n) updates). Ties (equal key) go to the earlier push: the tail.

    half_life: ticks (default 2,000); ``make_policy`` uses ``for_capacity``: 2 x the cache size
        in blocks, the best single factor of 0.25/1/2/4 x on the Mooncake conversation trace
        (a shorter one tends to LRU, a longer one keeps stale counts).
    first_weight: the weight of the first access (default 1.0, as LRFU).
    """

    half_life: float = 2000.0
    first_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__init__()
        self._score: dict[bytes, tuple[float, int]] = {}  # log2 score at tick, tick

    @classmethod
    def for_capacity(cls, capacity: int) -> "HybridPolicy":
        """A half life of twice the cache size in ticks: frequency counts within ~2 turnovers."""
        return cls(half_life=max(16.0, 2.0 * capacity))

    def _add(self, key: bytes, weight: float) -> None:
        t = self._clock
        prev = self._score.get(key)
        if prev is None:
            self._score[key] = (math.log2(weight), t)
            self._trim(self._score)
            return
        lg, t0 = prev
        decayed, w = lg - (t - t0) / self.half_life, math.log2(weight)
        hi, lo = max(decayed, w), min(decayed, w)  # log2(2**a + 2**b), stable
        self._score[key] = (hi + math.log2(1.0 + 2.0 ** (lo - hi)), t)

    def _access(self, key: bytes) -> None:
        self._add(key, 1.0 if key in self._score else self.first_weight)

    def score(self, key: bytes, at: int | None = None) -> float:
        """``score(t)`` of the docstring formula at tick ``at`` (default now)."""
        lg, t0 = self._score[key]
        return 2.0 ** (lg - ((self._clock if at is None else at) - t0) / self.half_life)

    def _priority(self, key: bytes) -> tuple:
        lg, t0 = self._score[key]
        return (lg + t0 / self.half_life,)


@dataclass
class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over content hashes.

    T1 holds keys seen once recently, T2 keys seen at least twice (both resident: evictable or
    referenced); B1/B2 are their ghosts (evicted keys, no data). A hit moves a key to T2's MRU
    end. A key evicted from T1 (T2) goes to B1 (B2); when it comes back (the engine inserts it
    again after recomputing it) a B1 ghost grows the target ``p`` of T1 by max(|B2|/|B1|, 1), a
    B2 ghost shrinks it by max(|B1|/|B2|, 1), and the key enters T2. REPLACE takes T1's LRU key
    when |T1| > p (else T2's LRU); ``victims`` simulates that rule for n evictions, skipping
    referenced keys. Directory bounds as in the paper: |T1| + |B1| <= c, total <= 2c.

    The engine's ``remove`` means "referenced again" right after a ``hit`` and "freed" otherwise
    (eviction, or a second remove of a referenced key): only freed keys become ghosts. The
    engine evicts before it admits the missing key, so REPLACE sees ``p`` as it was before that
    key's ghost hit adapts it (the paper adapts first; results differ only when |T1| lies
    between the two values of p).

    capacity: c, the cache size in blocks (T1 + T2 at most; also the ghost budget).
    """

    capacity: int

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError("ARC needs a capacity of at least one block")
        self.p = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self._evictable: set[bytes] = set()
        self._hit_pending: set[bytes] = set()  # hit while evictable: a remove now means "referenced"

    # -- engine events -------------------------------------------------------------------
    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        if key not in self.t1 and key not in self.t2:
            self._admit(key)
        self._evictable.add(key)
        self._hit_pending.discard(key)

    def remove(self, key: bytes) -> None:
        if key in self._evictable:
            self._evictable.discard(key)
            if key in self._hit_pending:  # referenced again: stays resident
                self._hit_pending.discard(key)
                return
        self._forget(key)

    def hit(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        else:
            return
        if key in self._evictable:
            self._hit_pending.add(key)

    def victims(self, n: int) -> list[bytes]:
        """The next ``n`` REPLACE choices: T1's LRU while |T1| > p, otherwise T2's LRU."""
        it1, it2 = self._evictable_in(self.t1), self._evictable_in(self.t2)
        n1 = len(self.t1)
        out: list[bytes] = []
        a, b = next(it1, None), next(it2, None)
        while len(out) < n and (a is not None or b is not None):
            if a is not None and (n1 > self.p or b is None):
                out.append(a)
                n1 -= 1
                a = next(it1, None)
            else:
                out.append(b)
                b = next(it2, None)
        return out

    def __len__(self) -> int:
        return len(self._evictable)

    def __contains__(self, key: object) -> bool:
        return key in self._evictable

    # -- ARC bookkeeping -----------------------------------------------------------------
    def _evictable_in(self, lst: OrderedDict[bytes, None]):
        return (k for k in lst if k in self._evictable)

    def _admit(self, key: bytes) -> None:
        """A miss brought ``key`` in: ghost hits adapt ``p`` (cases II/III), else case IV."""
        c = self.capacity
        if key in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._bound()

    def _forget(self, key: bytes) -> None:
        """``key``'s block was freed: its T entry becomes a ghost (MRU end of B1/B2)."""
        self._hit_pending.discard(key)
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        else:
            return
        self._bound()

    def _bound(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)


class _Shadow:
    """A sampled miniature cache run by one candidate policy: its decayed hit count says how
    that candidate would do on the real workload (SHARDS-style spatial sampling)."""

    def __init__(self, policy: HybridPolicy, capacity: int) -> None:
        self.policy, self.capacity = policy, capacity
        self.cached: set[bytes] = set()
        self.hits = 0.0

    def access(self, key: bytes) -> None:
        p = self.policy
        if key in self.cached:
            self.hits += 1.0
            p.hit(key)
        elif len(self.cached) >= self.capacity:
            for v in p.victims(1):
                p.remove(v)
                self.cached.discard(v)
        self.cached.add(key)
        p.insert(key)


@dataclass
class AdaptivePolicy(HybridPolicy):
    """The hybrid's formula with a half life that picks itself (this project's policy).

    Why: on KV traces the best recency/frequency balance depends on the cache size and the
    workload -- LFU (half life infinite) wins on small caches of the Mooncake conversation
    trace, a half life of ~2 cache turnovers on larger ones, and no fixed choice is best
    everywhere (ARC adapts a split, not the frequency horizon). So a fraction ``sample_rate``
    of the keys (chosen by CRC32 of the key, deterministic) also drives one miniature cache per
    candidate half life ``factor * capacity`` (capacity scaled by the same rate, at least
    ``min_shadow`` blocks); every ``window`` sampled accesses the candidate with the most
    (exponentially decayed, halved each window) shadow hits becomes the live half life and the
    heap is re-keyed (O(n), rare). Eviction order is the hybrid's: lowest
    ``score(t) = sum_i 2 ** (-(t - t_i) / half_life)`` first, ties to the earlier release
    (chain tails before roots). Prefix-aware when the caller passes ``parent``: a key no
    inserted key has named as its parent (a chain's leaf, e.g. a request's partial last block,
    which a longer next turn never reproduces) has its score divided by ``2 ** leaf_penalty``,
    so leaves go before the roots they hang from. Cost per access: O(log n) plus
    ``sample_rate * len(factors)`` shadow updates.

    capacity: cache size in blocks. leaf_penalty: log2 of a leaf's score divisor (default 2:
    leaves count a quarter; without ``parent`` info no key is treated as a leaf).
    factors: candidate half lives in cache sizes (default
    0.5, 2, 8, 32 and infinity = LFU with recency ties). start: index of the initial factor
    (2: 8x). sample_rate: default 1/8. window: sampled accesses per decision (default 1,000).
    """

    capacity: int = 1024
    leaf_penalty: float = 2.0
    factors: tuple[float, ...] = (0.5, 2.0, 8.0, 32.0, math.inf)
    start: int = 2
    sample_rate: float = 0.125
    min_shadow: int = 64
    window: int = 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity < 1:
            raise ValueError("capacity must be at least one block")
        rate = min(1.0, max(self.sample_rate, self.min_shadow / self.capacity))
        self._threshold = int(rate * 2**32)
        shadow_cap = max(1, round(self.capacity * rate))
        self._shadows = [_Shadow(HybridPolicy(half_life=f * shadow_cap), shadow_cap) for f in self.factors]
        self.choice = self.start
        self.half_life = self.factors[self.choice] * self.capacity
        self._sampled = 0
        self._parents: dict[bytes, None] = {}  # keys some inserted key named as its parent

    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        if parent is not None and parent not in self._parents:
            self._parents[parent] = None
            self._trim(self._parents)
            if parent in self._live:  # no longer a leaf: re-key it
                self._push(parent)
        super().insert(key, parent)

    def _priority(self, key: bytes) -> tuple:
        (base,) = super()._priority(key)
        if self._parents and key not in self._parents:
            base -= self.leaf_penalty
        return (base,)

    def _access(self, key: bytes) -> None:
        super()._access(key)
        if zlib.crc32(key) < self._threshold:
            for sh in self._shadows:
                sh.access(key)
            self._sampled += 1
            if self._sampled % self.window == 0:
                self._decide()

    def _decide(self) -> None:
        best = max(range(len(self._shadows)), key=lambda i: (self._shadows[i].hits, i == self.choice))
        for sh in self._shadows:
            sh.hits *= 0.5
        if best != self.choice:
            self.choice, self.half_life = best, self.factors[best] * self.capacity
            self._rekey()

    def _rekey(self) -> None:
        """Heap keys under the new half life; ``seq`` (push order) kept, so ties keep order."""
        self._live = {k: (self._priority(k), seq) for k, (_, seq) in self._live.items()}
        self._heap = [(pr, sq, k) for k, (pr, sq) in self._live.items()]
        heapq.heapify(self._heap)

    @classmethod
    def for_capacity(cls, capacity: int) -> "AdaptivePolicy":
        return cls(capacity=capacity)


POLICIES: dict[str, type] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "hybrid": HybridPolicy,
    "arc": ARCPolicy,
    "adaptive": AdaptivePolicy,
}
"""Name -> policy class; ``make_policy`` builds one for a cache size."""

_FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": lambda capacity: LRUPolicy(),
    "lfu": lambda capacity: LFUPolicy(),
    "hybrid": HybridPolicy.for_capacity,
    "arc": ARCPolicy,
    "adaptive": AdaptivePolicy.for_capacity,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The named policy for a cache of ``capacity`` blocks (LRU and LFU need no size; the
    hybrid's half life is 2 x capacity; ARC's c and the adaptive shadows use it)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return _FACTORIES[name](capacity)
