"""Third parties' ε of Poisson rounds that are skipped outside [min-clients, max-clients].

A Poisson draw of fewer than min-clients (or, under HE, more than max-clients) nodes is skipped
(``federation.sampling``), and a third party sees the skip: no new model that round. Whether
the round goes ahead depends on the target's presence, so the skip bit is part of the release;
charging only the subsampled Gaussian under-reports (issue 31: 1.198 where one explicit pair
needs >= 3.25).

The rule, per round (skipped or not: it is the same mechanism), for add-or-remove adjacency:
the third party is also told m, how many of the *other* nodes were drawn. That can only help
it, m has the same law with or without the target, and given m the other nodes' updates are a
known shift, so whatever those updates are, the round is the mixture over m ~ Bin(n, q) of:

* m in [lo, hi − 1] (the round goes ahead with or without the target): the Poisson-subsampled
  Gaussian at σ and q;
* m = lo − 1 or m = hi (the target decides the skip): with the target, the round goes ahead
  (resp. is skipped) with probability q and otherwise does what it does without it. Privacy
  loss ln(1 − q) with mass 1 − q and +∞ with mass q (remove); ln(1/(1 − q)) with mass 1 (add);
* any other m: skipped either way, loss 0.

The mixture is built and composed with dp-accounting's PLD (pessimistic discretization), and
its ε at δ is the maximum over the two ways the run's population N relates to the pair
(n = N − 1 others with the target in the run, n = N with it out). The +∞ mass, q·P(m on the
boundary) a round, lands in δ: where it exceeds target-delta ε is ∞. It is pessimistic when
the noise hides m (large σ) and tight when it does not (the other nodes' updates can spell m
out); docs/privacy.md gives the arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from crypto.errors import ParameterError

__all__ = ["WindowedPoissonAccountant", "window_masses"]


def window_masses(others: int, q: float, lo: int, hi: int | None) -> tuple[float, float, float]:
    """P(m in [lo, hi − 1]), P(m in {lo − 1, hi}), P(otherwise) for m ~ Bin(others, q);
    ``hi`` None = no upper bound."""
    from scipy.stats import binom

    top = others if hi is None else min(hi - 1, others)
    inner = float(binom.cdf(top, others, q) - binom.cdf(lo - 1, others, q)) if top >= lo else 0.0
    edge = float(binom.pmf(lo - 1, others, q)) if lo >= 1 else 0.0
    if hi is not None:
        edge += float(binom.pmf(hi, others, q))
    return inner, edge, max(0.0, 1.0 - inner - edge)


def _discretization(sigma: float) -> float:
    """PLD grid: 1e-3 at σ >= 1, coarser below (the loss spreads as 1/σ²). Each round's
    pessimistic rounding adds at most one step to ε; dp-accounting's connect-the-dots bound
    keeps it far below that (σ 1, q 0.25, 3 rounds: the same ε to 1e-6 as on a 1e-4 grid)."""
    return 1e-3 * max(1.0, 1.0 / sigma**2)


@functools.lru_cache(maxsize=32)
def _round_pld(sigma: float, q: float, others: int, lo: int, hi: int | None, h: float) -> Any:
    """One round's PLD on grid ``h`` (module docstring): the mixture over the other nodes' count."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    inner, edge, outside = window_masses(others, q, lo, hi)

    def atoms(remove: dict[int, float], inf_remove: float, add: dict[int, float], inf_add: float) -> Any:
        return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
            remove, inf_remove, h, True, add, inf_add, symmetric=False)

    if q < 1:
        keep = {math.ceil(math.log1p(-q) / h): 1 - q}
        boundary = atoms(keep, q, {math.ceil(-math.log1p(-q) / h): 1.0}, 0.0)
    else:
        boundary = atoms({0: 0.0}, 1.0, {0: 0.0}, 1.0)  # the target alone decides: all +∞ (``_epsilon`` says ∞ first)
    nothing = atoms({0: 1.0}, 0.0, {0: 1.0}, 0.0)
    gaussian = pld_lib.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=h)
    rest = inner + outside
    tail = nothing if rest == 0 else gaussian.compute_mixture(nothing, inner / rest)
    return boundary.compute_mixture(tail, edge) if edge > 0 else tail


@dataclass
class WindowedPoissonAccountant:
    """ε against third parties of Poisson rounds with a count window [lo, hi] (``hi`` None =
    unbounded); ``step(sigma, q, population)`` composes one round, skipped or not."""

    delta: float
    lo: int
    hi: int | None = None
    _rounds: Counter = field(init=False, default_factory=Counter)
    _cached: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ParameterError(f"delta must be in (0, 1), not {self.delta}")
        if self.lo < 1 or (self.hi is not None and self.hi < self.lo):
            raise ParameterError(f"need 1 <= min-clients <= max-clients, not [{self.lo}, {self.hi}]")

    @property
    def steps(self) -> int:
        return sum(self._rounds.values())

    def step(self, sigma: float, q: float, population: int, rounds: int = 1) -> None:
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ParameterError(f"sigma must be finite and > 0 (σ = 0 has no finite ε), not {sigma}")
        if not 0 < q <= 1:
            raise ParameterError(f"sample_rate must be in (0, 1], not {q!r}")
        if not (isinstance(population, int) and population >= 1):
            raise ParameterError(f"population must be an integer >= 1, not {population!r}")
        self._rounds[(float(sigma), float(q), population)] += rounds
        self._cached = None

    def epsilon(self) -> float:
        """ε at ``delta`` (0 before any step; ∞ where the boundary mass alone exceeds δ)."""
        if not self._rounds:
            return 0.0
        if self._cached is None:
            self._cached = max(self._epsilon(target_in) for target_in in (True, False))
        return self._cached

    def _epsilon(self, target_in: bool) -> float:
        """The pair where the run's N nodes hold the target (n = N − 1 others) or not (n = N)."""
        spared = 1.0  # P(no round's +∞ loss): each round's is q·P(m on the edge), either way
        for (_, q, population), count in self._rounds.items():
            spared *= (1 - q * window_masses(population - (1 if target_in else 0), q, self.lo, self.hi)[1]) ** count
        if 1 - spared > self.delta:  # δ(ε) is at least that mass at every ε
            return math.inf
        h = _discretization(min(sigma for sigma, _, _ in self._rounds))  # one grid: PLDs compose on it
        composed = None
        for (sigma, q, population), count in sorted(self._rounds.items()):
            others = population - 1 if target_in else population
            pld = _round_pld(sigma, q, others, self.lo, self.hi, h).self_compose(count)
            composed = pld if composed is None else composed.compose(pld)
        return float(composed.get_epsilon_for_delta(self.delta))
