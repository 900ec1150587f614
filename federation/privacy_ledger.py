"""Client-level ε per observer: who sees what of a round's release, and how much of its noise
they do not know (SPEC, crypto: every reported ε says against whom it holds).

One round releases a noisy sum of clipped updates. Four observers see it differently:

* ``third_party`` — sees released models only and not who was sampled: the sampler's
  amplification applies (``ClientAccountant.epsilon``; Poisson: ``WindowedPoissonAccountant``,
  which also charges the skip a third party sees when a draw falls outside [min-clients,
  max-clients]). This is ``epsilon_client``.
* ``server`` — draws the sample, so no amplification. With he=true it sees only ciphertexts
  and, at most, the released models: the plain Gaussian at the release's σ. With he=false and
  dp-mode distributed it sees every update carrying only its own share: σ/√k.
* ``node`` — a curious key holder. It decrypts every aggregate, reads the manifest (it knows the
  sample), holds the dither key and knows the noise it added itself (its own share and the
  top-up shares it made): no amplification, σ·sqrt((shares it did not make) / k).
* ``colluding`` — t key holders pooling what they know (run-config ``colluding-nodes``): the
  same with the t largest share counts of the round removed, σ·sqrt((n−t)/n) when each made
  one share. No figure holds against a key holder colluding with the server: all nodes share
  one CKKS key, so together they read single updates (docs/threat-model.md).

dp-mode local: every update carries σC of its own, unknown to everyone else, so σ holds
against each observer (the sum's extra noise is not credited). A σ of 0 against an observer
(colluders made all the noise) is ε = ∞ from then on.

Rounding, for a key holder: third parties and the server do not know the dither, so the
subtractive-dither argument makes the rounding independent of the data (``crypto.dp.dither``). A
key holder knows the dither, so for it that argument is void; it is replaced by smoothing. A
node encodes ``floor(y/step + u)`` of its noisy value y. The fractional part y/step mod 1 is
within total variation η/2 of uniform whatever the data, η = 2·Σ_j exp(−2π²j²s²) (Poisson
summation), where s is the noise share's std in lattice steps. That is charged into the key
holders' δ by the coupling bound, m·η/2 for m rounded coordinates (``rounding_delta``). Given
uniform fractional parts the integer parts are discrete Gaussians and the sum is the distributed
discrete Gaussian mechanism (Kairouz, Liu & Steinke 2021). Its correction to ε (their τ, of
order exp(−π²s²)) is NOT charged: the key holders' ε is the continuous Gaussian's at the σ
above, stated as such. The round reports s (``rounding_share_steps``). The argument needs s ≳ 1;
well below that ``rounding_delta`` reaches 1 and the key holders' δ says so.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

from flwr.common import log

from federation.client_accounting import ClientAccountant, GaussianAccountant
from federation.poisson_window import WindowedPoissonAccountant

__all__ = ["OBSERVERS", "RoundCharge", "RoundRelease", "charge_round", "observer_sigmas", "PrivacyLedger",
           "rounding_delta"]

OBSERVERS: tuple[str, ...] = ("third_party", "server", "node", "colluding")


@dataclass(frozen=True)
class RoundRelease:
    """What one round released, as the accountant needs it.

    ``sampled`` k; ``shares_by_node``: noise shares each contributing node made (1 for its own
    update plus the top-up shares it made; dp-mode distributed with he=true); ``server_shares``:
    shares the server drew itself (he=false top-up); ``skipped``: a Poisson draw outside
    [min, max]-clients released nothing but the skip, which third parties see (charged as the
    same windowed Poisson round as any other: ``federation.poisson_window``)."""

    sampled: int
    shares_by_node: dict[int, int] = field(default_factory=dict)
    server_shares: int = 0
    skipped: bool = False


def _known_shares(release: RoundRelease, t: int) -> int:
    """Noise shares t colluding nodes know at most: the t largest share counts of the round."""
    return sum(heapq.nlargest(t, release.shares_by_node.values()))


def observer_sigmas(dp_mode: str, he: bool, sigma: float, release: RoundRelease,
                    colluding: int) -> dict[str, float]:
    """Noise multiplier of the round's release as each observer sees it (module docstring)."""
    k = release.sampled
    if dp_mode == "local" or release.skipped or k == 0:
        return dict.fromkeys(OBSERVERS, sigma)
    present = min(k, sum(release.shares_by_node.values()) + release.server_shares)
    released = sigma * math.sqrt(present / k)

    def unknown_to(t: int) -> float:
        return sigma * math.sqrt(max(0, present - min(present, _known_shares(release, t))) / k)

    return {"third_party": released, "server": released if he else sigma / math.sqrt(k),
            "node": unknown_to(1), "colluding": unknown_to(colluding)}


def rounding_delta(share_steps: float, coordinates: int) -> float:
    """The key holders' δ for rounding, m·η/2 capped at 1 (module docstring). The series for η
    is summed to j = 8: its tail is below exp(−2π²·81·s²)."""
    if not (share_steps > 0 and math.isfinite(share_steps)):
        return 1.0
    a = 2 * math.pi**2 * share_steps**2
    eta = 2 * sum(math.exp(-a * j * j) for j in range(1, 9))
    return min(1.0, coordinates * eta / 2)


@dataclass
class PrivacyLedger:
    """One accountant per observer; ``record(release, sigma)`` composes one round for each.

    ``sampling`` and ``population`` are the client sampler's (``ClientAccountant``); only the
    third party's figure is amplified. ``colluding`` is t. ``min_clients`` / ``max_clients``
    (None = unbounded) are a Poisson sampler's window: a draw outside it is skipped, and third
    parties are charged for seeing that (``WindowedPoissonAccountant``)."""

    sampling: str
    population: int
    delta: float
    dp_mode: str
    he: bool
    colluding: int = 2
    min_clients: int = 1
    max_clients: int | None = None
    _third_party: ClientAccountant | WindowedPoissonAccountant = field(init=False, repr=False)
    _plain: dict[str, GaussianAccountant] = field(init=False, repr=False)
    _void: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._third_party = (WindowedPoissonAccountant(self.delta, self.min_clients, self.max_clients)
                             if self.sampling == "poisson"
                             else ClientAccountant(self.sampling, self.population, self.delta))
        self._plain = {name: GaussianAccountant(self.population, self.delta, self.sampling)
                       for name in OBSERVERS[1:]}

    def record(self, release: RoundRelease, sigma: float, *, sample_size: int | None = None,
               sample_rate: float | None = None, population: int | None = None) -> None:
        """Compose one release for every observer; the third party's event is the sampler's:
        ``sample_rate`` q of the round's ``population`` (poisson; default the ledger's) or
        ``sample_size`` k of ``population`` (fixed)."""
        sigmas = observer_sigmas(self.dp_mode, self.he, sigma, release, self.colluding)
        for name, s in sigmas.items():
            if s <= 0 or name in self._void:
                self._void.add(name)
            elif name != "third_party":
                self._plain[name].step(s)
            elif isinstance(self._third_party, WindowedPoissonAccountant):
                if sample_rate is None:
                    raise ValueError("a Poisson round is charged at the sampler's q: pass sample_rate")
                self._third_party.step(s, sample_rate, population or self.population)
            else:
                self._third_party.step(s, sample_size, sample_rate=sample_rate)

    def epsilons(self) -> dict[str, float]:
        """ε per observer so far at ``delta`` (∞ once an observer knew all of a round's noise)."""
        out = {"third_party": self._third_party.epsilon()}
        out.update({name: acc.epsilon() for name, acc in self._plain.items()})
        return {name: math.inf if name in self._void else eps for name, eps in out.items()}


@dataclass
class RoundCharge:
    """What ``charge_round`` needs of the run besides the round: the strategy's public state."""

    cfg: Any
    """The run's ``RunConfig`` (dp-mode, noise-multiplier, target-delta, colluding-nodes, he)."""
    sampler: Any
    """The run's ``federation.sampling.ClientSampler`` (its method, q and fixed sizes)."""
    saturation_delta: float
    packing: Any
    """The public ``PackingConfig`` (he=true) or None."""
    dim: int


def charge_round(run: RoundCharge, ledger: PrivacyLedger | None, rec: Any, release: RoundRelease,
                 topup_summands: int) -> tuple[PrivacyLedger | None, float]:
    """Charge one round's release (dp-mode local/distributed): fill ``rec``'s ε per observer and
    δ figures; return the ledger (made at the first charged round, for that round's population:
    Flower's accountant fixes N) and the third parties' ε so far (``epsilon_client``).

    Poisson is charged at the sampler's own q (fraction-train), not at a rounded q·N / N, and
    every Poisson round, skipped (a draw outside [min-clients, max-clients]: nobody trains, and
    third parties see that) or not, as the same windowed mechanism
    (``federation.poisson_window``)."""
    from crypto import delta_total

    cfg = run.cfg
    rec.colluding_nodes = cfg.colluding_nodes
    ledger, eps = _epsilons_after(run, ledger, rec, release)
    rec.epsilon_server, rec.epsilon_node, rec.epsilon_colluding = eps["server"], eps["node"], eps["colluding"]
    rec.saturation_delta = run.saturation_delta
    rec.delta_total = delta_total(cfg.target_delta, eps["third_party"], run.saturation_delta)
    rec.rounding_share_steps, rec.rounding_delta = _rounding(run, release, topup_summands)
    rec.delta_total_key_holders = delta_total(
        cfg.target_delta, eps["node"], min(1.0, run.saturation_delta + rec.rounding_delta))
    return ledger, eps["third_party"]


def _epsilons_after(run: RoundCharge, ledger: PrivacyLedger | None, rec: Any,
                    release: RoundRelease) -> tuple[PrivacyLedger | None, dict[str, float]]:
    """The ledger's ε per observer after this round's release. Each observer is followed on its
    own: the third parties' ε can be ∞ (a Poisson window that binds often) while the others'
    are finite."""
    cfg, sampler = run.cfg, run.sampler
    sigma = cfg.noise_multiplier
    if sigma <= 0:
        return ledger, dict.fromkeys(OBSERVERS, math.inf)
    if ledger is None:
        ledger = PrivacyLedger(sampler.method, rec.population, cfg.target_delta, cfg.dp_mode, cfg.he,
                               cfg.colluding_nodes, sampler.min_clients, sampler.max_clients)
    if sampler.method == "poisson":  # the probability the sampler draws each node with
        ledger.record(release, sigma, sample_rate=sampler.fraction, population=rec.population)
    else:
        ledger.record(release, sigma, sample_size=_event_size(sampler, ledger, rec))
    return ledger, ledger.epsilons()


def _rounding(run: RoundCharge, release: RoundRelease, topup_summands: int) -> tuple[float, float]:
    """(noise share std in lattice steps, the key holders' rounding δ) of a dithered packed
    round (module docstring); (nan, 0) where nothing is rounded that way."""
    packing = run.packing
    if packing is None or not packing.dither or not release.sampled or release.skipped:
        return math.nan, 0.0
    from crypto import noise_std
    from federation.codec import wire_noise

    clip, sigma = wire_noise(run.cfg)
    steps = noise_std(sigma, clip, "distributed", release.sampled) / packing.step
    summands = len(release.shares_by_node) + topup_summands
    return steps, rounding_delta(steps, run.dim * summands)


def _event_size(sampler: Any, ledger: PrivacyLedger, rec: Any) -> int:
    """The fixed sampler's k in the accountant's own population N0, scaled to N0 and rounded
    up (conservative) when the admitted population changed. (Poisson is charged at the
    sampler's q whatever N is.)"""
    n0 = ledger.population
    k = sampler.fixed_size(rec.population) if rec.sampling_skipped else rec.sampled
    if rec.population != n0:
        log(WARNING, "population %d differs from the accountant's %d: charging k=%d as a share of %d",
            rec.population, n0, k, n0)
        k = min(n0, math.ceil(k * n0 / rec.population))
    return k
