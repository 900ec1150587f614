"""KV-cache sparsification policies: which cached positions a session keeps.

A policy watches the attention each layer pays to its cached positions (``observe``) and says
which positions stay (``keep``); the caller excludes the others from attention and frees their
K/V. Drops are monotone: a dropped position never comes back, so its memory can really be
freed. Positions are absolute (0 = the session's first token); the mask is shared by all heads
of a layer, because the engine stores K/V per token, not per head.

Policies (one small class each, like SGLang's ``evict_policy.py``):

* :class:`SlidingWindow` - StreamingLLM: the first ``sinks`` tokens plus the last ``window``.
  Attention sinks matter because softmax must put its mass somewhere; dropping the first
  tokens makes the remaining weights blow up.
* :class:`TopKRetention` - H2O: sinks, the ``recent`` newest, and the "heavy hitters" with the
  highest accumulated attention, up to ``budget`` positions in all.
* :class:`TimeDecay` - like H2O, but each past contribution decays by
  ``0.5 ** (age / half_life)`` (age in queries), so a position that mattered long ago but no
  longer does is dropped before one that matters now.

:func:`policy_for` sizes any of them to keep a given fraction of a context length.

Only torch and the stdlib are imported here: the engine calls policies, policies know nothing
of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "POLICY_NAMES",
    "SlidingWindow",
    "SparsityPolicy",
    "TimeDecay",
    "TopKRetention",
    "policy_for",
]


@runtime_checkable
class SparsityPolicy(Protocol):
    def observe(self, layer: int, attn: torch.Tensor) -> None:
        """attn: [heads, T, n] softmax weights of the T newest queries over the n cached
        positions of this layer (positions 0..n-1 in order)."""

    def keep(self, layer: int, n: int) -> torch.Tensor:
        """bool [n]: which of the n cached positions stay (shared by all heads of the layer).
        Positions once dropped must stay dropped (monotone) - the engine frees them."""


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_layer(layer: int) -> None:
    _check_count("layer", layer, 0)


def _check_attn(attn: torch.Tensor) -> None:
    if not isinstance(attn, torch.Tensor) or attn.dim() != 3:
        shape = tuple(attn.shape) if isinstance(attn, torch.Tensor) else type(attn).__name__
        raise ValueError(f"attn must be a [heads, T, n] tensor, got {shape}")


def _edges(n: int, sinks: int, recent: int) -> torch.Tensor:
    """bool [n]: the first ``sinks`` and the last ``recent`` positions."""
    pos = torch.arange(n)
    return (pos < sinks) | (pos >= n - recent)


class _AliveMasks:
    """Per-layer monotone masks of live positions; new positions start alive."""

    def __init__(self) -> None:
        self._alive: dict[int, torch.Tensor] = {}

    def get(self, layer: int, n: int) -> torch.Tensor:
        """The live mask of ``layer`` grown (with True) to ``n`` positions."""
        _check_layer(layer)
        _check_count("n", n, 0)
        alive = self._alive.get(layer, torch.ones(0, dtype=torch.bool))
        if n < alive.numel():
            raise ValueError(f"layer {layer} already holds {alive.numel()} positions; "
                             f"n={n} would forget some (positions only grow)")
        if n > alive.numel():
            alive = torch.cat([alive, torch.ones(n - alive.numel(), dtype=torch.bool)])
        self._alive[layer] = alive
        return alive

    def set(self, layer: int, alive: torch.Tensor) -> torch.Tensor:
        self._alive[layer] = alive
        return alive.clone()


@dataclass
class SlidingWindow:
    """StreamingLLM: keep the first ``sinks`` tokens and the newest ``window``; the rest drop.
    Ignores attention, so it costs nothing to observe."""

    window: int
    sinks: int = 4
    _masks: _AliveMasks = field(default_factory=_AliveMasks, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_count("window", self.window, 1)
        _check_count("sinks", self.sinks, 0)

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def observe(self, layer: int, attn: torch.Tensor) -> None:
        _check_layer(layer)
        _check_attn(attn)

    def keep(self, layer: int, n: int) -> torch.Tensor:
        alive = self._masks.get(layer, n)
        return self._masks.set(layer, alive & _edges(n, self.sinks, self.window))


class _HeavyHitters:
    """Shared H2O machinery: per-layer accumulated attention scores and the keep rule (sinks
    and the ``recent`` newest are protected; the highest scores fill the rest of ``budget``).
    Subclasses are dataclasses with ``budget``, ``recent`` and ``sinks`` and say how a batch
    of queries adds to the scores (``_accumulate``)."""

    budget: int
    recent: int
    sinks: int
    _masks: _AliveMasks
    _scores: dict[int, torch.Tensor]

    def _check_sizes(self) -> None:
        _check_count("budget", self.budget, 1)
        _check_count("recent", self.recent, 0)
        _check_count("sinks", self.sinks, 0)
        if self.sinks + self.recent > self.budget:
            raise ValueError(f"budget {self.budget} cannot hold sinks {self.sinks} + recent "
                             f"{self.recent}; raise budget or lower sinks/recent")

    def _accumulate(self, scores: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _scores_for(self, layer: int, n: int) -> torch.Tensor:
        """The accumulated scores of ``layer`` grown (with zeros) to ``n`` positions."""
        scores = self._scores.get(layer, torch.zeros(0, dtype=torch.float64))
        if n > scores.numel():
            scores = torch.cat([scores, torch.zeros(n - scores.numel(), dtype=torch.float64)])
            self._scores[layer] = scores
        return scores

    def observe(self, layer: int, attn: torch.Tensor) -> None:
        _check_layer(layer)
        _check_attn(attn)
        n = attn.shape[-1]
        have = self._scores.get(layer)
        if have is not None and n < have.numel():
            raise ValueError(f"layer {layer} already holds {have.numel()} positions; "
                             f"attention over {n} would forget some (positions only grow)")
        self._scores[layer] = self._accumulate(self._scores_for(layer, n), attn.detach())

    def keep(self, layer: int, n: int) -> torch.Tensor:
        alive = self._masks.get(layer, n)
        if int(alive.sum()) <= self.budget:
            return self._masks.set(layer, alive)
        protected = alive & _edges(n, self.sinks, self.recent)
        slots = self.budget - int(protected.sum())
        candidates = alive & ~protected
        scores = self._scores_for(layer, n).masked_fill(~candidates, float("-inf"))
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[torch.topk(scores, slots).indices] = True
        return self._masks.set(layer, protected | (chosen & candidates))


@dataclass
class TopKRetention(_HeavyHitters):
    """H2O heavy hitters: keep ``sinks``, the ``recent`` newest and the positions with the
    highest attention summed over heads and queries so far, ``budget`` positions in all.
    Recent tokens are protected because they have had no time to accumulate attention yet."""

    budget: int
    recent: int = 16
    sinks: int = 4
    _masks: _AliveMasks = field(default_factory=_AliveMasks, init=False, repr=False)
    _scores: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_sizes()

    def _accumulate(self, scores: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Plain H2O: the sum of every query's weights, over heads."""
        return scores + attn.sum(dim=(0, 1)).double()


@dataclass
class TimeDecay(_HeavyHitters):
    """H2O with forgetting: each query's contribution decays by ``0.5 ** (age / half_life)``
    (age counted in later queries), so old attention fades and positions that stopped being
    read are dropped first when the layer holds more than ``budget``."""

    budget: int
    half_life: float
    recent: int = 16
    sinks: int = 4
    _masks: _AliveMasks = field(default_factory=_AliveMasks, init=False, repr=False)
    _scores: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_sizes()
        if isinstance(self.half_life, bool) or not isinstance(self.half_life, (int, float)) \
                or not 0 < self.half_life < float("inf"):
            raise ValueError(f"half_life must be a finite number > 0, got {self.half_life!r}")

    def _accumulate(self, scores: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        T = attn.shape[1]
        # query j of T is (T-1-j) queries old once all T are seen; the old scores are T older
        ages = torch.arange(T - 1, -1, -1, dtype=torch.float64)
        weights = 0.5 ** (ages / self.half_life)
        fresh = torch.einsum("t,htn->n", weights, attn.double())
        return scores * 0.5 ** (T / self.half_life) + fresh


POLICY_NAMES = ("window", "topk", "decay")


def policy_for(name: str, kept_fraction: float, context: int, *, sinks: int = 4,
               recent: int = 16, half_life: float | None = None) -> SparsityPolicy:
    """A fresh policy (one per session) that keeps ``round(kept_fraction * context)`` positions
    once the session is ``context`` tokens long. ``sinks`` and ``recent`` shrink to a quarter of
    the budget each when the budget is small, so some room is always left for the policy's own
    choice. ``half_life`` (decay) defaults to half the budget: attention paid half a budget ago
    counts half."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown sparsity policy {name!r}; expected one of {POLICY_NAMES}")
    if isinstance(kept_fraction, bool) or not isinstance(kept_fraction, (int, float)) \
            or not 0 < kept_fraction <= 1:
        raise ValueError(f"kept_fraction must be in (0, 1], got {kept_fraction!r}")
    _check_count("context", context, 1)
    budget = max(1, round(kept_fraction * context))
    sinks = min(sinks, budget // 4)
    recent = min(recent, budget // 4)
    if name == "window":
        return SlidingWindow(window=budget - sinks, sinks=sinks)
    if name == "topk":
        return TopKRetention(budget=budget, recent=recent, sinks=sinks)
    return TimeDecay(budget=budget, recent=recent, sinks=sinks,
                     half_life=float(half_life) if half_life is not None else max(1.0, budget / 2))
