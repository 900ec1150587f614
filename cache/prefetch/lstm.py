"""Prefetch mode ``lstm``: a small torch LSTM over the last 8 accesses, as address deltas in
first-seen order (Hashemi et al. 2018, "Learning Memory Access Patterns"), predicting the next
``degree`` accesses; it scores its own hits over a window and retrains when they fall below
70 %. torch is imported only when a model is built or run."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cache.prefetch.base import PREFETCH_DEGREE, BoundedMap, Key, PrefetchError, Prefetcher, check_positive

__all__ = ["AccessOrder", "LstmConfig", "LstmPrefetcher"]


class AccessOrder:
    """First-seen ordinals of keys: the 'address' space the LSTM learns deltas in (a block
    first used right after another one sits next to it, as in a log-structured store)."""

    def __init__(self, history: int = 1 << 20) -> None:
        self.ordinal: dict[Key, int] = BoundedMap(history)
        self.key: dict[int, Key] = BoundedMap(history)
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
        check_positive(history=self.history, max_delta=self.max_delta, embed=self.embed,
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
