"""Client-level ε that matches the client sampler, through Flower 1.42's ``RdpAccountant``.

In ``federation`` (not ``crypto``): it is Flower's accountant, and crypto never imports flwr.

Two samplers, each with the accountant that is proven for it (Flower's ``PrivacyConfig`` refuses
the other pairings):

* ``poisson``: every node joins a round independently with probability q; the aggregate is
  divided by the *fixed* expected count q·N, not the realised one (DP-FedAvg, McMahan et al.
  2018), so adding or removing one client moves the noisy sum by at most C. Accounted as the
  Poisson-subsampled Gaussian, add-or-remove-one adjacency, noise multiplier σ.
* ``fixed``: exactly k of the N nodes, uniformly without replacement (N public). Accounted with
  Wang, Balle & Kasiviswanathan (2019, Thm 27) under replace-one adjacency. Replacing one
  client's clipped update by another's moves the sum by up to 2C, and dp-accounting's noise
  multiplier is std / sensitivity, so the event carries σ/2.

``epsilon_no_amplification``: the same releases without credit for sampling (what holds
against the server, which knows the sample). Flower offers no-amplification only with
add-or-remove adjacency; for ``fixed`` the replace-one Gaussian with σ/2 is the add-or-remove
Gaussian with σ/2 (same sensitivity ratio), so that is what is composed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from crypto.errors import ParameterError

__all__ = ["ClientSampling", "CLIENT_SAMPLINGS", "ClientAccountant", "AccountantUnavailableError", "sigma_for_epsilon"]

ClientSampling = Literal["fixed", "poisson"]
CLIENT_SAMPLINGS: tuple[str, ...] = ("fixed", "poisson")


class AccountantUnavailableError(ImportError):
    """Flower's RdpAccountant needs the optional ``dp-accounting`` package (``flwr[dp]``)."""


def _flower() -> Any:
    try:
        import flwr.serverapp as fs

        fs.RdpAccountant  # noqa: B018 - lazy export: raises ImportError without dp-accounting
    except ImportError as err:
        raise AccountantUnavailableError(
            'client-level accounting needs Flower\'s RdpAccountant: pip install "flwr[dp]==1.42.0"') from err
    # dp-accounting logs through absl for every order whose series does not converge; that
    # order is then left out of the minimum (still a valid bound), so the warning is noise here.
    logging.getLogger("absl").setLevel(logging.ERROR)
    return fs


def _sensitivity_factor(sampling: str) -> float:
    """Sensitivity of the clipped sum in units of C under the sampler's adjacency."""
    return 2.0 if sampling == "fixed" else 1.0


@dataclass
class ClientAccountant:
    """ε of the client-level mechanism, with and without amplification by sampling.

    ``population`` is N (public); ``step(sigma, sample_size)`` composes one round whose noisy
    sum carries std σ·C. For ``poisson`` ``sample_size`` is the *expected* count q·N (rounded,
    >= 1: Flower takes q = sample_size / N), for ``fixed`` the exact k.
    """

    sampling: str
    population: int
    delta: float
    _amplified: Any = field(init=False, repr=False)
    _plain: Any = field(init=False, repr=False)
    steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.sampling not in CLIENT_SAMPLINGS:
            raise ParameterError(f"client sampling must be one of {CLIENT_SAMPLINGS}, not {self.sampling!r}")
        if not (isinstance(self.population, int) and self.population >= 1):
            raise ParameterError(f"population must be an integer >= 1, not {self.population!r}")
        if not 0 < self.delta < 1:
            raise ParameterError(f"delta must be in (0, 1), not {self.delta}")
        fs = _flower()
        rel, method = ((fs.NeighboringRelation.REPLACE_ONE, fs.SamplingMethod.WITHOUT_REPLACEMENT)
                       if self.sampling == "fixed"
                       else (fs.NeighboringRelation.ADD_OR_REMOVE_ONE, fs.SamplingMethod.POISSON))
        self._amplified = fs.RdpAccountant(fs.PrivacyConfig(self.delta, self.population, rel, method))
        self._plain = fs.RdpAccountant(fs.PrivacyConfig(
            self.delta, self.population, fs.NeighboringRelation.ADD_OR_REMOVE_ONE,
            fs.SamplingMethod.NO_AMPLIFICATION))

    def step(self, sigma: float, sample_size: int, rounds: int = 1) -> None:
        """Compose ``rounds`` releases of a noisy sum with std σ·C over ``sample_size`` clients."""
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ParameterError(f"sigma must be finite and > 0 (σ = 0 has no finite ε), not {sigma}")
        if not (isinstance(sample_size, int) and 1 <= sample_size <= self.population):
            raise ParameterError(f"sample_size must be an integer in [1, {self.population}], not {sample_size!r}")
        if rounds < 1:
            raise ParameterError("rounds must be >= 1")
        from flwr.serverapp import GaussianPrivacyEvent

        event = GaussianPrivacyEvent(sigma / _sensitivity_factor(self.sampling), sample_size, self.population)
        self._amplified.compose(event, rounds)
        self._plain.compose(event, rounds)
        self.steps += rounds

    def epsilon(self) -> float:
        """ε at ``delta`` with amplification by the sampler (0 before any step). Both bounds
        hold, so the smaller one: at large q the without-replacement bound (its fractional
        orders are interpolated) can exceed the plain Gaussian's."""
        if not self.steps:
            return 0.0
        return min(float(self._amplified.get_epsilon(self.delta)), self.epsilon_no_amplification())

    def epsilon_no_amplification(self) -> float:
        """ε at ``delta`` when the sample is known to the adversary (the server)."""
        return float(self._plain.get_epsilon(self.delta)) if self.steps else 0.0


def sigma_for_epsilon(target_eps: float, sampling: str, population: int, sample_size: int, rounds: int,
                      delta: float, tol: float = 1e-3) -> float:
    """Smallest σ (bisection, relative ``tol``) whose amplified ε after ``rounds`` is <= target."""
    if not (target_eps > 0 and math.isfinite(target_eps)):
        raise ParameterError(f"target ε must be finite and > 0, not {target_eps}")

    def eps(sigma: float) -> float:
        acc = ClientAccountant(sampling, population, delta)
        acc.step(sigma, sample_size, rounds)
        return acc.epsilon()

    lo, hi = 1e-2, 1.0
    while eps(hi) > target_eps:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ParameterError(f"no σ below 1e4 reaches ε={target_eps}")
    while hi - lo > tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if eps(mid) > target_eps else (lo, mid)
    return hi
