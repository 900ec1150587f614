"""Differential privacy for updates: L2 clipping, Gaussian noise placements, accounting.

Noise placements (C = clip_norm, sigma = noise multiplier, n = clients whose noise is summed):

- ``local``:       every client adds N(0, (sigma*C)^2); the sum carries n times the variance
                   needed, but nobody has to be trusted.
- ``distributed``: every client adds a share N(0, (sigma*C)^2 / n); the *sum* carries exactly
                   (sigma*C)^2, central-DP utility without a trusted curator — valid only because
                   the server sees the encrypted sum alone (CKKS) and clients see only the sum.
- ``server``:      top-up for m missing shares: N(0, m*(sigma*C)^2/n), added to the encrypted sum
                   by `CkksAggregator.add_noise(noise_std(..., "distributed", n), shares=m)`.
                   The server must be trusted to add it (it cannot see or remove client noise).

With weighted aggregation, add the share *after* the weight pre-scale
(`UpdateEncryptor.encrypt(..., noise=share)`): noise added to the raw update would be scaled
down by weight/max_weight. Sensitivity of the weighted sum is C*max(weight/max_weight) <= C.

Accounting is Opacus' (RDP or PRV); nothing here re-derives a bound. Client level: one step per
round with sample rate = clients per round / population and noise multiplier sigma. Sample
level (DP-SGD inside a node): Opacus' `PrivacyEngine` keeps its own accountant; wrap its history
with `PrivacyAccountant.from_opacus`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import numpy as np

from crypto.errors import NonFiniteUpdateError, ParameterError
from crypto.layout import to_numpy

__all__ = [
    "Placement",
    "ClipResult",
    "global_l2_norm",
    "clip_update",
    "noise_std",
    "gaussian_noise",
    "client_sample_rate",
    "PrivacyAccountant",
    "noise_multiplier_for",
]

Placement = Literal["local", "distributed", "server"]
Mechanism = Literal["rdp", "prv"]


class ClipResult(NamedTuple):
    clipped: Any  # same container/types as the input (ndarray, tensor or dict of them)
    norm: float  # L2 norm of the whole update before clipping
    was_clipped: bool


def _items(update: Any) -> list[Any]:
    return list(update.values()) if isinstance(update, Mapping) else [update]


def global_l2_norm(update: Any) -> float:
    """L2 norm over every tensor of the update together (float64 accumulation)."""
    total = 0.0
    for t in _items(update):
        a = to_numpy(t).astype(np.float64, copy=False).reshape(-1)
        if not np.isfinite(a).all():
            raise NonFiniteUpdateError("update contains NaN or Inf; refusing to clip or send it")
        total += float(a @ a)
    return math.sqrt(total)


def _scale(t: Any, factor: float) -> Any:
    if hasattr(t, "detach"):  # torch tensor: keep dtype/device
        return t.detach() * factor
    return np.asarray(t) * factor


def clip_update(update: Any, clip_norm: float) -> ClipResult:
    """Scale the whole update so its global L2 norm is at most `clip_norm` (DP-FedAvg clipping).

    Accepts a flat vector, a tensor, or a dict of numpy arrays / torch tensors; returns the same
    kind. NaN/Inf raise NonFiniteUpdateError.
    """
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ParameterError(f"clip_norm must be finite and > 0, not {clip_norm}")
    norm = global_l2_norm(update)
    was_clipped = norm > clip_norm
    factor = clip_norm / norm if was_clipped else 1.0
    if isinstance(update, Mapping):
        clipped: Any = {k: _scale(v, factor) for k, v in update.items()}
    else:
        clipped = _scale(update, factor)
    return ClipResult(clipped, norm, bool(was_clipped))


def noise_std(
    sigma: float, clip_norm: float, placement: Placement = "local", n_clients: int = 1, missing: int = 0
) -> float:
    """Per-coordinate standard deviation of the noise one party adds.

    local: sigma*C. distributed: sigma*C/sqrt(n) (one client's share). server: the total top-up
    for `missing` absent shares, sigma*C*sqrt(missing/n).
    """
    if sigma < 0 or clip_norm <= 0 or not (math.isfinite(sigma) and math.isfinite(clip_norm)):
        raise ParameterError("sigma must be >= 0 and clip_norm > 0 (finite)")
    if n_clients < 1:
        raise ParameterError("n_clients must be >= 1")
    if placement == "local":
        return sigma * clip_norm
    if placement == "distributed":
        return sigma * clip_norm / math.sqrt(n_clients)
    if placement == "server":
        if not 0 <= missing <= n_clients:
            raise ParameterError(f"missing={missing} must be within [0, n_clients={n_clients}]")
        return sigma * clip_norm * math.sqrt(missing / n_clients)
    raise ParameterError(f"placement must be local, distributed or server, not {placement!r}")


def gaussian_noise(
    shape: int | tuple[int, ...],
    sigma: float,
    clip_norm: float,
    placement: Placement = "local",
    n_clients: int = 1,
    rng: np.random.Generator | None = None,
    missing: int = 0,
) -> np.ndarray:
    """Gaussian noise with `noise_std(...)` per coordinate (float64).

    `rng` defaults to fresh OS entropy. numpy's sampler is not a constant-time, floating-point
    hardened DP sampler (see Mironov 2012); acceptable for research, noted for production.
    """
    std = noise_std(sigma, clip_norm, placement, n_clients, missing)
    rng = rng if rng is not None else np.random.default_rng()
    return rng.normal(0.0, std, size=shape)


def client_sample_rate(clients_per_round: int, population: int) -> float:
    """Client-level sampling rate q = clients per round / population."""
    if not 0 < clients_per_round <= population:
        raise ParameterError("need 0 < clients_per_round <= population")
    return clients_per_round / population


def _opacus_accountant(mechanism: Mechanism) -> Any:
    from opacus.accountants import PRVAccountant, RDPAccountant  # lazy: opacus imports torch

    if mechanism == "rdp":
        return RDPAccountant()
    if mechanism == "prv":
        return PRVAccountant()
    raise ParameterError(f"accountant must be 'rdp' or 'prv', not {mechanism!r}")


class PrivacyAccountant:
    """Opacus' RDP/PRV accountant with bulk steps and ε for a given δ.

    Opacus stores history as (noise_multiplier, sample_rate, num_steps); `step(..., steps=k)`
    extends that history directly instead of calling Opacus' `step` k times (same math).
    """

    def __init__(self, mechanism: Mechanism = "rdp") -> None:
        self.mechanism = mechanism
        self._acc = _opacus_accountant(mechanism)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        return list(self._acc.history)

    @property
    def steps(self) -> int:
        return sum(int(h[2]) for h in self._acc.history)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record `steps` applications of the subsampled Gaussian mechanism."""
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ParameterError("noise_multiplier must be > 0 (sigma = 0 has no finite epsilon)")
        if not 0 < sample_rate <= 1:
            raise ParameterError("sample_rate must be in (0, 1]")
        if steps < 1:
            raise ParameterError("steps must be >= 1")
        hist = self._acc.history
        if hist and hist[-1][0] == noise_multiplier and hist[-1][1] == sample_rate:
            nm, sr, k = hist.pop()
            hist.append((nm, sr, k + steps))
        else:
            hist.append((float(noise_multiplier), float(sample_rate), int(steps)))

    def epsilon(self, delta: float) -> float:
        """ε spent so far for this δ (0 before any step)."""
        if not 0 < delta < 1:
            raise ParameterError("delta must be in (0, 1)")
        if not self._acc.history:
            return 0.0
        with warnings.catch_warnings():
            # PRV bounds its discretisation domain with an internal RDP estimate and warns when
            # that estimate's optimal order is the largest alpha; it does not affect the PRV ε.
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            return float(self._acc.get_epsilon(delta=delta))

    @classmethod
    def from_opacus(cls, accountant: Any, mechanism: Mechanism | None = None) -> PrivacyAccountant:
        """Wrap the history of an Opacus accountant (e.g. `PrivacyEngine.accountant`).

        `mechanism` re-accounts the same history with another method (e.g. PRV for a tighter ε).
        """
        mech = mechanism or getattr(accountant, "mechanism", lambda: "rdp")()
        out = cls(mech)
        out._acc.history = [tuple(h) for h in accountant.history]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "history": [list(h) for h in self._acc.history]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyAccountant:
        out = cls(state["mechanism"])
        out._acc.history = [(float(a), float(b), int(c)) for a, b, c in state["history"]]
        return out


def noise_multiplier_for(
    target_eps: float, delta: float, sample_rate: float, steps: int, accountant: Mechanism = "rdp"
) -> float:
    """Smallest noise multiplier reaching `target_eps` after `steps` (Opacus' search)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # the bisection probes tiny sigmas whose RDP optimum is alpha_max
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(
            get_noise_multiplier(
                target_epsilon=target_eps,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
            )
        )
