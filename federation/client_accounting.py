"""Client-level ε that matches the client sampler, through Flower 1.42's ``RdpAccountant``.

In ``federation`` (not ``crypto``): it is Flower's accountant, and crypto never imports flwr.

Two samplers, each with the accountant that is proven for it (Flower's ``PrivacyConfig`` refuses
the other pairings):

* ``poisson``: every node joins a round independently with probability q; the aggregate is
  divided by the *fixed* expected count q·N, not the realised one (DP-FedAvg, McMahan et al.
  2018), so adding or removing one client moves the noisy sum by at most C. Accounted as the
  Poisson-subsampled Gaussian, add-or-remove-one adjacency, noise multiplier σ, at the
  sampler's own q (``step(..., sample_rate=q)``), never at a rounded q·N / N: Flower takes q as
  ``sample_size / population_size``, so the Poisson accountant's population is 2**1074, of
  which every double q in (0, 1] is an exact integer share (``_poisson_event``).
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

__all__ = ["ClientSampling", "CLIENT_SAMPLINGS", "ClientAccountant", "GaussianAccountant",
           "AccountantUnavailableError", "sigma_for_epsilon"]

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


_POISSON_DENOMINATOR = 2**1074
"""Population of the Poisson accountant: every double q in (0, 1] is k / 2**1074 for an integer k,
and Python's int / int is correctly rounded, so Flower's ``sample_size / population_size`` is q."""


def _poisson_event(noise_multiplier: float, q: float) -> Any:
    """Flower's event for a Poisson round at exactly rate q (see ``_POISSON_DENOMINATOR``)."""
    from flwr.serverapp import GaussianPrivacyEvent

    num, den = q.as_integer_ratio()
    event = GaussianPrivacyEvent(noise_multiplier, num * (_POISSON_DENOMINATOR // den), _POISSON_DENOMINATOR)
    assert event.sample_size / event.population_size == q
    return event


def _sensitivity_factor(sampling: str) -> float:
    """Sensitivity of the clipped sum in units of C under the sampler's adjacency."""
    return 2.0 if sampling == "fixed" else 1.0


@dataclass
class GaussianAccountant:
    """ε of releases whose sample the adversary knows (no amplification), for the sampler's
    adjacency (``_sensitivity_factor``); ``step(sigma)`` composes one noisy sum of std σ·C."""

    population: int
    delta: float
    sampling: str = "fixed"
    _rdp: Any = field(init=False, repr=False)
    steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        fs = _flower()
        self._rdp = fs.RdpAccountant(fs.PrivacyConfig(
            self.delta, self.population, fs.NeighboringRelation.ADD_OR_REMOVE_ONE,
            fs.SamplingMethod.NO_AMPLIFICATION))

    def step(self, sigma: float, rounds: int = 1) -> None:
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ParameterError(f"sigma must be finite and > 0 (σ = 0 has no finite ε), not {sigma}")
        from flwr.serverapp import GaussianPrivacyEvent

        noise = sigma / _sensitivity_factor(self.sampling)
        self._rdp.compose(GaussianPrivacyEvent(noise, self.population, self.population), rounds)
        self.steps += rounds

    def epsilon(self) -> float:
        """ε at ``delta`` (0 before any step)."""
        return float(self._rdp.get_epsilon(self.delta)) if self.steps else 0.0


@dataclass
class ClientAccountant:
    """ε of the client-level mechanism, with and without amplification by sampling.

    ``population`` is N (public); ``step(sigma, sample_size)`` composes one round whose noisy
    sum carries std σ·C. For ``fixed`` ``sample_size`` is the exact k. For ``poisson`` pass the
    sampler's probability as ``sample_rate=q`` (what the run does); an integer ``sample_size``
    k means q = k / N exactly.
    """

    sampling: str
    population: int
    delta: float
    _amplified: Any = field(init=False, repr=False)
    _plain: GaussianAccountant = field(init=False, repr=False)
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
        amplified_population = _POISSON_DENOMINATOR if self.sampling == "poisson" else self.population
        self._amplified = fs.RdpAccountant(fs.PrivacyConfig(self.delta, amplified_population, rel, method))
        self._plain = GaussianAccountant(self.population, self.delta, self.sampling)

    def step(self, sigma: float, sample_size: int | None = None, rounds: int = 1, *,
             sample_rate: float | None = None) -> None:
        """Compose ``rounds`` releases of a noisy sum with std σ·C: over exactly ``sample_size``
        clients (``fixed``), or each client drawn with probability ``sample_rate`` (``poisson``;
        or ``sample_size`` = q·N when that is a whole number)."""
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ParameterError(f"sigma must be finite and > 0 (σ = 0 has no finite ε), not {sigma}")
        if rounds < 1:
            raise ParameterError("rounds must be >= 1")
        if (sample_size is None) == (sample_rate is None):
            raise ParameterError("give exactly one of sample_size and sample_rate")
        if sample_rate is not None:
            if self.sampling != "poisson":
                raise ParameterError(f"sample_rate is the Poisson sampler's q; {self.sampling!r} takes sample_size k")
            if not (isinstance(sample_rate, float | int) and 0 < sample_rate <= 1):
                raise ParameterError(f"sample_rate must be in (0, 1], not {sample_rate!r}")
            q = float(sample_rate)
        else:
            if not (isinstance(sample_size, int) and 1 <= sample_size <= self.population):
                raise ParameterError(
                    f"sample_size must be an integer in [1, {self.population}], not {sample_size!r}")
            q = sample_size / self.population
        from flwr.serverapp import GaussianPrivacyEvent

        noise = sigma / _sensitivity_factor(self.sampling)
        if self.sampling == "poisson":
            self._amplified.compose(_poisson_event(noise, q), rounds)
        else:
            self._amplified.compose(GaussianPrivacyEvent(noise, sample_size, self.population), rounds)
        self._plain.step(sigma, rounds)  # no amplification: the plain Gaussian
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
        return self._plain.epsilon()


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
