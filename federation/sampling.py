"""Which nodes train in a round: the sampler the client-level accountant assumes.

``client-sampling=fixed``: exactly k = max(min-clients, ceil(fraction-train · N)) of the N
admitted nodes (at most max-clients under HE), uniformly without replacement — accounted under
replace-one adjacency (``federation.client_accounting``). ``client-sampling=poisson``: each node
independently with probability q = fraction-train; the aggregate is divided by the fixed
expected count q·N (``poisson_mean_scale``), as DP-FedAvg's accounting requires.

Amplification by sampling assumes the adversary cannot predict the sample, so in a normal run
the draw comes from the OS CSPRNG (``secrets.SystemRandom``), not from the public ``seed``;
``sampler-seed >= 0`` makes it reproducible for experiments (and says so in the results).
"""

from __future__ import annotations

import math
import random
import secrets
from dataclasses import dataclass, field

__all__ = ["ClientSampler", "SampleOutsideBounds", "evaluation_size", "expected_sample_size", "poisson_mean_scale"]


class SampleOutsideBounds(RuntimeError):
    """A Poisson draw with fewer than min-clients (or, under HE, more than max-clients) nodes."""


def expected_sample_size(fraction: float, population: int) -> float:
    """q·N, the fixed denominator of a Poisson round (public). Not rounded: a fixed denominator
    need not be a whole number, and the accountant charges the sampler's own q
    (``ClientAccountant.step(..., sample_rate=q)``), so nothing here may stand in for q."""
    if not (0 < fraction <= 1 and population >= 1):
        raise ValueError(f"need 0 < q <= 1 and N >= 1, not q={fraction}, N={population}")
    return fraction * population


def evaluation_size(population: int, fraction: float, min_clients: int, cap: int) -> int:
    """Nodes that evaluate in a round: ceil(fraction · N), at most ``cap`` (0 = none) but never
    fewer than min-clients, and at most N. Evaluation releases no update, so its sample needs
    no accounting."""
    k = math.ceil(fraction * population)
    if cap > 0:
        k = min(k, cap)
    return min(max(k, min_clients), population)


def poisson_mean_scale(n_updates: int, fraction: float, population: int) -> float:
    """Factor turning the realised-count mean into sum / (q·N) (the fixed-denominator mean)."""
    return n_updates / expected_sample_size(fraction, population)


@dataclass
class ClientSampler:
    """Draws each round's training nodes; ``seed=None`` draws from OS entropy."""

    method: str = "fixed"
    """fixed | poisson."""
    fraction: float = 1.0
    """fraction-train: the share (fixed) or probability (poisson) per node."""
    min_clients: int = 2
    max_clients: int | None = None
    """The HE packing headroom; None = unbounded (he=false)."""
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in ("fixed", "poisson"):
            raise ValueError(f"client-sampling must be fixed or poisson, not {self.method!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction-train must be in (0, 1], not {self.fraction}")
        self._rng = secrets.SystemRandom() if self.seed is None else random.Random(self.seed)

    def fixed_size(self, population: int) -> int:
        """k of the fixed sampler for ``population`` admitted nodes."""
        k = max(self.min_clients, math.ceil(self.fraction * population))
        if self.max_clients is not None:
            k = min(k, self.max_clients)
        return min(k, population)

    def sample(self, nodes: list[int]) -> list[int]:
        """The round's nodes, sorted. Poisson raises ``SampleOutsideBounds`` (the round is
        skipped, not redrawn: a redraw would change the distribution the accountant assumes)."""
        if self.method == "fixed":
            return sorted(self._rng.sample(nodes, self.fixed_size(len(nodes))))
        chosen = sorted(n for n in nodes if self._rng.random() < self.fraction)
        too_many = self.max_clients is not None and len(chosen) > self.max_clients
        if len(chosen) < self.min_clients or too_many:
            raise SampleOutsideBounds(
                f"Poisson draw of {len(chosen)} node(s) outside [min-clients={self.min_clients}, "
                f"max-clients={self.max_clients}]")
        return chosen
