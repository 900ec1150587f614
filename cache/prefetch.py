"""Prefetch: predict which cached blocks are about to be used and move them from warm/cold to
hot before the access that needs them (the article's ``prefetch_engine.c``).

One small class per mode (SGLang ``evict_policy.py`` style), all with the same interface::

    p = make_prefetcher("hybrid", degree=2)
    p.observe(key)                      # an access of block ``key`` (a hit or a computed block)
    keys = p.predict(resident=hot)      # at most ``degree`` blocks to fetch, none of them in hot
    p.ledger                            # issued / used / wasted prefetches and bytes

* ``sequential``: the blocks ``stride .. stride + degree - 1`` steps ahead along the block chain
  (a block's successor is the block that followed it last time: a conversation's next turn
  re-reads its history in order);
* ``heat``: a decayed access-count table; a prediction draws a random sample of the recent
  accesses (no sort of the whole table) and fetches the hottest drawn blocks not in hot
  (knowledge retrieval: a hot set of documents);
* ``hybrid``: runs both, scores each one's predictions over a sliding window and follows the
  one that has been predicting better recently;
* ``lstm``: a small torch LSTM over the last 8 accesses, as address deltas in first-seen order
  (Hashemi et al. 2018, "Learning Memory Access Patterns"), predicting the next ``degree``
  accesses; it scores its own hits over a window and retrains when they fall below 70 %;
* ``none``: never prefetches (the baseline).

On a live cache's block manager: :func:`prefetch_after_lookup` observes the blocks a lookup touched and
restores the predicted ones into hot as unreferenced cached blocks, so the next
``match_prefix`` of them is a hot hit. A prefetched block takes hot room like any other (the
restore evicts the policy's victim): prefetching competes with demand blocks.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Container, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache.errors import CacheError

if TYPE_CHECKING:
    from cache.manager import BlockManager

Key = Hashable
PREFETCH_DEGREE = 2
"""Blocks each prediction fetches at most (the issue's ``prefetch_degree``)."""
PREFETCH_MODES = ("none", "sequential", "heat", "hybrid", "lstm")


class PrefetchError(CacheError, ValueError):
    """A prefetcher argument out of range, an unknown mode, or a cache with nothing below hot."""


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise PrefetchError(f"{name} must be a positive number, got {v!r}")


# == accounting ===============================================================================
@dataclass
class PrefetchLedger:
    """Issued, used and wasted prefetches (and their bytes). A prefetched block is *used* when
    it is accessed while still in hot, *wasted* when it leaves hot (or the replay ends) first."""

    issued: int = 0
    used: int = 0
    wasted: int = 0
    issued_bytes: int = 0
    used_bytes: int = 0
    wasted_bytes: int = 0
    pending: dict[Key, int] = field(default_factory=dict)
    """Prefetched blocks not used yet -> their bytes."""

    def issue(self, key: Key, nbytes: int) -> None:
        if key in self.pending:
            return
        self.pending[key] = int(nbytes)
        self.issued += 1
        self.issued_bytes += int(nbytes)

    def access(self, key: Key) -> bool:
        """An access of ``key``; True when it was an unused prefetch (now used)."""
        nbytes = self.pending.pop(key, None)
        if nbytes is None:
            return False
        self.used += 1
        self.used_bytes += nbytes
        return True

    def evicted(self, key: Key) -> None:
        """``key`` left hot; a pending prefetch of it was wasted."""
        nbytes = self.pending.pop(key, None)
        if nbytes is not None:
            self.wasted += 1
            self.wasted_bytes += nbytes

    def close(self) -> None:
        """End of a replay: what is still pending was never used (counted as wasted)."""
        for key in list(self.pending):
            self.evicted(key)

    @property
    def accuracy(self) -> float:
        """used / issued (nan before anything was issued)."""
        return self.used / self.issued if self.issued else float("nan")

    @property
    def wasted_fraction(self) -> float:
        """Wasted bytes / prefetched bytes (nan before anything was issued)."""
        return self.wasted_bytes / self.issued_bytes if self.issued_bytes else float("nan")


class AccuracyWindow:
    """Of the last ``window`` predictions, the share that was accessed within ``horizon``
    accesses of being made: how a predictor judges itself (or hybrid judges its modes)."""

    def __init__(self, horizon: int, window: int) -> None:
        _check_positive(horizon=horizon, window=window)
        self.horizon, self.step = int(horizon), 0
        self.results: deque[bool] = deque(maxlen=int(window))
        self._open: dict[Key, int] = {}
        self._deadlines: deque[tuple[int, Key]] = deque()

    def record(self, keys: Iterable[Key]) -> None:
        for k in keys:
            if k not in self._open:
                self._open[k] = self.step + self.horizon
                self._deadlines.append((self.step + self.horizon, k))

    def observe(self, key: Key) -> None:
        self.step += 1
        if self._open.pop(key, None) is not None:
            self.results.append(True)
        while self._deadlines and self._deadlines[0][0] < self.step:
            deadline, k = self._deadlines.popleft()
            if self._open.get(k) == deadline:
                del self._open[k]
                self.results.append(False)

    def reset(self) -> None:
        self.results.clear()
        self._open.clear()
        self._deadlines.clear()

    @property
    def accuracy(self) -> float:
        """nan while nothing was resolved yet."""
        return sum(self.results) / len(self.results) if self.results else float("nan")


# == predictors ===============================================================================
class Prefetcher(ABC):
    """Observe accesses, predict at most ``degree`` blocks to fetch; ``ledger`` counts the
    outcome of what a caller actually fetched."""

    name = "base"

    def __init__(self, degree: int = PREFETCH_DEGREE) -> None:
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise PrefetchError(f"prefetch_degree must be an int >= 1, got {degree!r}")
        self.degree = degree
        self.ledger = PrefetchLedger()

    @abstractmethod
    def observe(self, key: Key) -> None:
        """An access of block ``key``."""

    @abstractmethod
    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        """At most ``degree`` blocks to fetch next, none in ``resident`` (what hot holds)."""

    def stats(self) -> dict:
        led = self.ledger
        return {"mode": self.name, "degree": self.degree, "issued": led.issued, "used": led.used,
                "wasted": led.wasted, "issued_bytes": led.issued_bytes,
                "wasted_bytes": led.wasted_bytes, "accuracy": led.accuracy,
                "wasted_fraction": led.wasted_fraction}


class NoPrefetch(Prefetcher):
    """The baseline: never fetches ahead."""

    name = "none"

    def observe(self, key: Key) -> None:
        pass

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        return []


class _BoundedMap(dict):
    """A dict that forgets its oldest-inserted keys beyond ``limit`` (bounded predictor state)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            del self[next(iter(self))]


class SequentialPrefetcher(Prefetcher):
    """Fixed stride ahead along the block chain: after an access of ``k``, the blocks
    ``stride .. stride + degree - 1`` successors later, where a block's successor is the block
    that followed it the last time it was used (block hashes have no address order; the chain
    is what a conversation re-reads)."""

    name = "sequential"

    def __init__(self, degree: int = PREFETCH_DEGREE, stride: int = 1, history: int = 1 << 20
                 ) -> None:
        super().__init__(degree)
        _check_positive(stride=stride, history=history)
        if not isinstance(stride, int):
            raise PrefetchError(f"stride must be an int >= 1, got {stride!r}")
        self.stride = stride
        self.successor: dict[Key, Key] = _BoundedMap(int(history))
        self.last: Key | None = None

    def observe(self, key: Key) -> None:
        if self.last is not None and self.last != key:
            self.successor[self.last] = key
        self.last = key

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        out: list[Key] = []
        k, seen = self.last, {self.last}
        for step in range(1, self.stride + self.degree):
            k = self.successor.get(k)
            if k is None or k in seen:  # chain ends or loops back
                break
            seen.add(k)
            if step >= self.stride and k not in resident:
                out.append(k)
        return out


class HeatPrefetcher(Prefetcher):
    """Heat-table random sampling: every access adds 1 to a key's heat, which halves every
    ``half_life`` accesses; a prediction samples ``sample`` of the last ``recent`` accesses at
    random (so a block is drawn in proportion to how often it was used lately, and no sort of
    the table is needed) and returns the hottest drawn blocks not in hot whose heat reaches
    ``min_heat``. Sampling the table's keys uniformly instead drew almost only one-off blocks
    (they outnumber the hot set), and ``min_heat`` > 1 leaves out blocks used once, which on
    the Mooncake conversation trace made every heat prefetch a waste."""

    name = "heat"

    def __init__(self, degree: int = PREFETCH_DEGREE, sample: int = 16, half_life: float = 2048,
                 min_heat: float = 1.5, recent: int = 4096, history: int = 1 << 20,
                 seed: int = 0) -> None:
        super().__init__(degree)
        _check_positive(sample=sample, half_life=half_life, history=history, min_heat=min_heat,
                        recent=recent)
        self.sample, self.half_life, self.min_heat = int(sample), float(half_life), float(min_heat)
        self.rng = random.Random(seed)
        self.step = 0
        self.heat: dict[Key, tuple[float, int]] = _BoundedMap(int(history))
        """key -> (heat at step, step)."""
        self._recent: list[Key] = []
        self._size = int(recent)
        self.last: Key | None = None

    def heat_of(self, key: Key) -> float:
        h, at = self.heat.get(key, (0.0, self.step))
        return h * math.exp2((at - self.step) / self.half_life)

    def observe(self, key: Key) -> None:
        self.heat[key] = (self.heat_of(key) + 1.0, self.step)
        if len(self._recent) < self._size:
            self._recent.append(key)
        else:  # a ring: the slot of the access ``recent`` ago
            self._recent[self.step % self._size] = key
        self.step += 1
        self.last = key

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        if not self._recent:
            return []
        picks = {self.rng.choice(self._recent) for _ in range(self.sample)}
        heat = {k: self.heat_of(k) for k in picks if k != self.last and k not in resident}
        ranked = sorted((k for k in heat if heat[k] >= self.min_heat), key=heat.get, reverse=True)
        return ranked[: self.degree]


class HybridPrefetcher(Prefetcher):
    """Sequential and heat side by side: both observe every access and predict, each one's
    predictions are scored by an :class:`AccuracyWindow`, and only the active one's are
    returned; the other takes over when its windowed accuracy is ``margin`` higher."""

    name = "hybrid"

    def __init__(self, degree: int = PREFETCH_DEGREE, window: int = 64, horizon: int | None = None,
                 margin: float = 0.05, seed: int = 0) -> None:
        super().__init__(degree)
        if not 0 <= margin < 1:
            raise PrefetchError(f"margin must be in [0, 1), got {margin!r}")
        horizon = horizon or 4 * degree
        self.modes: dict[str, Prefetcher] = {"sequential": SequentialPrefetcher(degree),
                                             "heat": HeatPrefetcher(degree, seed=seed)}
        self.scores = {n: AccuracyWindow(horizon, window) for n in self.modes}
        self.margin, self.active, self.switches = margin, "sequential", 0

    def observe(self, key: Key) -> None:
        for name, p in self.modes.items():
            p.observe(key)
            self.scores[name].observe(key)

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        preds = {}
        for name, p in self.modes.items():
            preds[name] = p.predict(resident)
            self.scores[name].record(preds[name])
        other = "heat" if self.active == "sequential" else "sequential"
        mine, theirs = self.scores[self.active].accuracy, self.scores[other].accuracy
        mine, theirs = (0.0 if math.isnan(a) else a for a in (mine, theirs))  # unknown: 0
        if theirs > mine + self.margin:
            self.active, self.switches = other, self.switches + 1
        return preds[self.active]

    def stats(self) -> dict:
        return super().stats() | {"active": self.active, "switches": self.switches}


class AccessOrder:
    """First-seen ordinals of keys: the 'address' space the LSTM learns deltas in (a block
    first used right after another one sits next to it, as in a log-structured store)."""

    def __init__(self, history: int = 1 << 20) -> None:
        self.ordinal: dict[Key, int] = _BoundedMap(history)
        self.key: dict[int, Key] = _BoundedMap(history)
        self._next = 0

    def of(self, key: Key) -> int:
        o = self.ordinal.get(key)
        if o is None:
            o = self.ordinal[key] = self._next
            self.key[o] = key
            self._next += 1
        return o


@dataclass(frozen=True)
class LstmConfig:
    """The LSTM predictor's size and training schedule. A training with the defaults (256
    samples, 60 epochs, 9,188 parameters) costs 0.26 s of CPU, median of 5 (about 1 s of wall
    time while this shared 2-core machine ran at load 11)."""

    history: int = 8
    """Accesses the model reads (the issue's 'last 8 accesses')."""
    max_delta: int = 16
    """Deltas in [-max_delta, max_delta] are classes; any other is one 'far' class."""
    embed: int = 16
    hidden: int = 32
    train_window: int = 256
    """Most recent accesses a (re)training fits."""
    min_history: int = 64
    """Accesses seen before the first training."""
    epochs: int = 60
    lr: float = 0.02
    threshold: float = 0.7
    """Retrain when the windowed hit accuracy falls below this."""
    window: int = 64
    """Predictions the accuracy is taken over (a full window is needed to judge)."""
    retrain_every: int = 128
    """Fewest accesses between two trainings. Each retraining doubles the gap (up to 64x); a
    training whose first full window reaches ``threshold`` halves it again: a stream no model
    predicts well (the Mooncake trace hovers near 70 %) must not retrain every few hundred
    accesses (104 trainings, 2 ms per access, when a good window reset the gap)."""
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(history=self.history, max_delta=self.max_delta, embed=self.embed,
                        hidden=self.hidden, train_window=self.train_window, epochs=self.epochs,
                        lr=self.lr, window=self.window, retrain_every=self.retrain_every,
                        min_history=self.min_history)
        if not 0 < self.threshold <= 1:
            raise PrefetchError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.min_history <= self.history + 1:
            raise PrefetchError(f"min_history ({self.min_history}) must exceed history + 1")


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run a tiny model on one intra-op thread: on this shared 2-core machine a forward pass
    took 30-55 ms with torch's 2 threads spinning against other work and 1 ms with one."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class LstmPrefetcher(Prefetcher):
    """A torch LSTM over the deltas (in first-seen order) of the last ``history`` accesses;
    head ``j`` predicts the delta from the current access to the ``j``-th next one, so one
    forward pass predicts ``degree`` blocks. A head's prediction is a hit when the access
    ``j`` later is that block (exact position, not 'soon'); when the hit share of the last
    ``window`` predictions falls below ``threshold`` it retrains on the recent accesses."""

    name = "lstm"

    def __init__(self, degree: int = PREFETCH_DEGREE, config: LstmConfig = LstmConfig()) -> None:
        super().__init__(degree)
        self.config = config
        self.order = AccessOrder()
        self.ordinals: deque[int] = deque(maxlen=config.train_window + degree + 1)
        self.results: deque[bool] = deque(maxlen=config.window)
        self._made: deque[tuple[int, list[Key | None]]] = deque(maxlen=degree)
        self.model = None
        self.trainings, self.last_train, self.step = 0, 0, 0
        self.backoff = config.retrain_every
        self._judged = False
        self.last: Key | None = None
        self._memo: dict[tuple[int, ...], list[int]] = {}
        """Input classes -> predicted delta per head: the model is a function of 8 discrete
        classes and streams repeat contexts, so each context runs once per trained model."""

    # -- encoding ----------------------------------------------------------------------
    @property
    def far(self) -> int:
        return 2 * self.config.max_delta + 1

    def _cls(self, delta: int) -> int:
        m = self.config.max_delta
        return delta + m if -m <= delta <= m else self.far

    def _build(self):
        import torch

        c, n = self.config, self.far + 1
        return torch.nn.ModuleDict({
            "embed": torch.nn.Embedding(n, c.embed),
            "lstm": torch.nn.LSTM(c.embed, c.hidden, batch_first=True),
            "head": torch.nn.Linear(c.hidden, self.degree * n)})

    def _forward(self, x):
        m = self.model
        out, _ = m["lstm"](m["embed"](x))
        return m["head"](out[:, -1]).view(x.shape[0], self.degree, self.far + 1)

    # -- training ----------------------------------------------------------------------
    def _samples(self):
        """Inputs [N, history] of delta classes and targets [N, degree]."""
        import torch

        o, h, d = list(self.ordinals), self.config.history, self.degree
        deltas = [self._cls(b - a) for a, b in zip(o, o[1:])]  # deltas[i]: o[i] -> o[i+1]
        xs, ys = [], []
        for t in range(h, len(o) - d):  # current access o[t]; inputs: deltas ending at it
            xs.append(deltas[t - h : t])
            ys.append([self._cls(o[t + j] - o[t]) for j in range(1, d + 1)])
        return torch.tensor(xs, dtype=torch.long), torch.tensor(ys, dtype=torch.long)

    def train(self) -> None:
        """Fit a fresh model to the recent accesses (full batch, Adam; seeded, without
        touching the global torch RNG). Samples weigh less with age (half weight every
        ``window`` accesses): after a pattern change the new pattern is a minority of the
        training window, and unweighted fits kept predicting the old one (77 % vs 100 %)."""
        import torch
        from torch.nn.functional import cross_entropy

        x, y = self._samples()
        n = len(x)
        if n == 0:
            return
        w = 0.5 ** ((n - 1 - torch.arange(n)) / self.config.window)
        with torch.random.fork_rng(), _one_torch_thread():
            torch.manual_seed(self.config.seed + self.trainings)
            self.model = self._build()
            opt = torch.optim.Adam(self.model.parameters(), lr=self.config.lr)
            for _ in range(self.config.epochs):
                opt.zero_grad()
                per = cross_entropy(self._forward(x).reshape(-1, self.far + 1), y.reshape(-1),
                                    reduction="none").view(n, -1).mean(1)
                ((per * w).sum() / w.sum()).backward()
                opt.step()
        self.model.eval()
        self.trainings += 1
        self.last_train = self.step
        self.results.clear()
        self._made.clear()
        self._memo.clear()
        self._judged = False

    def _should_train(self) -> bool:
        c = self.config
        if self.model is None:
            return self.step >= c.min_history
        if len(self.results) < c.window:
            return False
        if not self._judged:  # the first full window since the last training judges it
            self._judged = True
            if self.accuracy >= c.threshold:  # it helped: retrain sooner next time
                self.backoff = max(c.retrain_every, self.backoff // 2)
        if self.accuracy >= c.threshold:
            return False
        if self.step - self.last_train < self.backoff:
            return False
        self.backoff = min(self.backoff * 2, 64 * c.retrain_every)
        return True

    def _score(self, key: Key) -> None:
        """Head j of the prediction made j accesses ago names the access now (``step`` has
        just counted this access)."""
        for made_at, heads in self._made:
            j = self.step - made_at
            if 1 <= j <= self.degree and heads[j - 1] is not None:
                self.results.append(heads[j - 1] == key)

    # -- interface ---------------------------------------------------------------------
    def observe(self, key: Key) -> None:
        self.step += 1
        self._score(key)
        self.ordinals.append(self.order.of(key))
        self.last = key
        if self._should_train():
            self.train()

    def predict(self, resident: Container[Key] = frozenset()) -> list[Key]:
        import torch

        h = self.config.history
        if self.model is None or len(self.ordinals) <= h:
            return []
        o = list(self.ordinals)[-h - 1 :]
        ctx = tuple(self._cls(b - a) for a, b in zip(o, o[1:]))
        deltas = self._memo.get(ctx)
        if deltas is None:
            with torch.no_grad(), _one_torch_thread():
                logits = self._forward(torch.tensor([ctx], dtype=torch.long))[0]
            logits[:, self.far] = -math.inf  # 'far' names no block
            deltas = self._memo[ctx] = [c - self.config.max_delta
                                        for c in logits.argmax(dim=1).tolist()]
        heads = [self.order.key.get(o[-1] + d) for d in deltas]
        self._made.append((self.step, heads))
        out: list[Key] = []
        for k in heads:
            if k is not None and k != self.last and k not in out and k not in resident:
                out.append(k)
        return out

    @property
    def accuracy(self) -> float:
        """Hit share of the last ``window`` head predictions (nan before any)."""
        return sum(self.results) / len(self.results) if self.results else float("nan")

    def stats(self) -> dict:
        return super().stats() | {"trainings": self.trainings, "window_accuracy": self.accuracy}


def make_prefetcher(mode: str, degree: int = PREFETCH_DEGREE, seed: int = 0) -> Prefetcher:
    """A prefetcher by mode name (``PREFETCH_MODES``)."""
    if mode == "none":
        return NoPrefetch(degree)
    if mode == "sequential":
        return SequentialPrefetcher(degree)
    if mode == "heat":
        return HeatPrefetcher(degree, seed=seed)
    if mode == "hybrid":
        return HybridPrefetcher(degree, seed=seed)
    if mode == "lstm":
        return LstmPrefetcher(degree, LstmConfig(seed=seed))
    raise PrefetchError(f"prefetch mode must be one of {PREFETCH_MODES}, got {mode!r}")


# == applying predictions to a live cache's blocks ============================================
def settle(blocks: "BlockManager", ledger: PrefetchLedger) -> None:
    """Count as wasted every pending prefetch that has left hot unused."""
    for key in [k for k in ledger.pending if k not in blocks.index]:
        ledger.evicted(key)


def prefetch_into_hot(blocks: "BlockManager", keys: Iterable[bytes],
                      ledger: PrefetchLedger | None = None) -> list[bytes]:
    """Restore each block of ``keys`` held in warm or cold into hot, as an unreferenced cached
    block (most recently used in the policy): its next ``match_prefix`` is a hot hit. Blocks
    already hot, held nowhere, or of another model version are skipped; when hot has no room
    the entry goes back to its tier and the rest are not fetched. Returns the keys fetched."""
    m = blocks
    if m.tiers is None:
        raise PrefetchError("this cache has no warm tier or cold store: nothing to prefetch from")
    fetched = []
    for h in keys:
        if h in m.index:
            continue
        e = m.tiers.take(h)
        if e is None:
            continue
        if e.version != m.version:  # as lookup: K/V of another version are never served
            continue
        if m.restore(h, e) is None:
            m.tiers.put(h, e)  # no room: nothing lost
            break
        fetched.append(h)
        if ledger is not None:
            ledger.issue(h, len(e.payload))
    return fetched


def prefetch_after_lookup(blocks: "BlockManager", prefetcher: Prefetcher,
                          keys: Iterable[bytes]) -> list[bytes]:
    """The engine hook: observe the block hashes a lookup touched (in order), then fetch what
    the prefetcher predicts into hot. Returns the keys fetched."""
    led = prefetcher.ledger
    for h in keys:
        led.access(h)
        prefetcher.observe(h)
    settle(blocks, led)
    return prefetch_into_hot(blocks, prefetcher.predict(blocks.index), led)
