"""Client-level ε per observer: who sees what of a round's release, and how much of its noise
they do not know (SPEC, crypto: every reported ε says against whom it holds).

One round releases a noisy sum of clipped updates. Four observers see it differently:

* ``third_party`` — sees released models only and not who was sampled: the sampler's
  amplification applies (``ClientAccountant.epsilon``). This is ``epsilon_client``.
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

from federation.client_accounting import ClientAccountant, GaussianAccountant

__all__ = ["OBSERVERS", "RoundRelease", "observer_sigmas", "PrivacyLedger", "rounding_delta"]

OBSERVERS: tuple[str, ...] = ("third_party", "server", "node", "colluding")


@dataclass(frozen=True)
class RoundRelease:
    """What one round released, as the accountant needs it.

    ``sampled`` k; ``shares_by_node``: noise shares each contributing node made (1 for its own
    update plus the top-up shares it made; dp-mode distributed with he=true); ``server_shares``:
    shares the server drew itself (he=false top-up); ``skipped``: a Poisson draw outside
    [min, max]-clients released nothing (charged anyway: conservative)."""

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
    third party's figure is amplified. ``colluding`` is t."""

    sampling: str
    population: int
    delta: float
    dp_mode: str
    he: bool
    colluding: int = 2
    _third_party: ClientAccountant = field(init=False, repr=False)
    _plain: dict[str, GaussianAccountant] = field(init=False, repr=False)
    _void: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._third_party = ClientAccountant(self.sampling, self.population, self.delta)
        self._plain = {name: GaussianAccountant(self.population, self.delta, self.sampling)
                       for name in OBSERVERS[1:]}

    def record(self, release: RoundRelease, sigma: float, *, sample_size: int | None = None,
               sample_rate: float | None = None) -> None:
        """Compose one release for every observer; the third party's event is the sampler's:
        ``sample_rate`` q (poisson) or ``sample_size`` k of ``population`` (fixed)."""
        sigmas = observer_sigmas(self.dp_mode, self.he, sigma, release, self.colluding)
        for name, s in sigmas.items():
            if s <= 0 or name in self._void:
                self._void.add(name)
            elif name == "third_party":
                self._third_party.step(s, sample_size, sample_rate=sample_rate)
            else:
                self._plain[name].step(s)

    def epsilons(self) -> dict[str, float]:
        """ε per observer so far at ``delta`` (∞ once an observer knew all of a round's noise)."""
        out = {"third_party": self._third_party.epsilon()}
        out.update({name: acc.epsilon() for name, acc in self._plain.items()})
        return {name: math.inf if name in self._void else eps for name, eps in out.items()}
