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

Where the noise sits relative to quantization and saturation (he=true; issue 13). In a node:
clip to C -> add the noise (local: N(0, (sigma*C)^2); distributed: the share) -> weight pre-scale
(1 under DP) -> error-feedback carry (not under distributed) -> saturate to the public range
+-R (counted, never wrapped) -> quantize -> pack -> encrypt. So the Gaussian mechanism the
accountant charges is the one that runs, up to what is stated here:

- local: each client's ``y = clip(update) + N(0, (sigma*C)^2)`` is the mechanism's output;
  saturation, stochastic rounding and the error-feedback carry (``y`` minus what was sent, fed
  into the next round) are functions of earlier outputs and of independent randomness:
  post-processing, and adaptive composition covers the carry.
- distributed: only the *sum* ``sum(clip(update_i) + share_i)`` is the mechanism; a client's
  rounding error must therefore not depend on its data. The packing is subtractive-dithered
  (``crypto.dp.dither``, ``PackingConfig.dither``): each coordinate's error is uniform on a step,
  independent of the value, so the decrypted sum is the mechanism's output plus independent
  noise — post-processing. Error feedback is off (a share's residual is not a function of the
  released sum). Saturation is covered by the coupling bound below, not by post-processing.

Saturation: the coupling bound (dp-mode distributed under he=true). Let M be the accounted
mechanism: over all rounds, the Gaussian sums plus the independent dither noise, (ε, δ)-DP by
the accountant. Let M' be what runs: the same, with every contribution saturated to ±R per
coordinate (±m·R for a node's reply of m noise shares) before the sum. Run both on one
probability space (the same noise, dithers and sampling). Let E be the event "no coordinate of
any contribution in any round saturates". On E, M' = M: by induction over rounds the models,
hence the next updates, are the same, and nothing was clipped. P(E^c) <= δ_sat for every input
D, where δ_sat is ``crypto.dp.saturation.saturation_delta``: a clipped update has every
coordinate |x_j| <= C whatever the history, its noise is fresh, so coordinate j saturates with
probability Φ̄((R-C)/s) + Φ̄((R+C)/s) <= 2·Φ̄((R-C)/s) (s: the share's std; a pure-noise
reply of m shares, std s·√m at range m·R: 2·Φ̄(√m·R/s), smaller); the union bound over the
dim coordinates, <= max-clients contributions per round and the rounds. Then for every set S
of outcomes:

    P(M'(D) ∈ S) <= P(M(D) ∈ S) + δ_sat                 (they differ only on E^c)
                 <= e^ε · P(M(D') ∈ S) + δ + δ_sat      (M is (ε, δ)-DP)
                 <= e^ε · P(M'(D') ∈ S) + δ + (1 + e^ε) · δ_sat,

using P(M(D') ∈ S) <= P(M'(D') ∈ S) + δ_sat the same way. So M' is (ε, δ + (1 + e^ε)·δ_sat)-DP:
``crypto.dp.saturation.delta_total``, reported per round as ``delta_total`` next to ε. The
premise is made true where the range is chosen: with ``packing-range = 0`` the range is
``crypto.dp_clip_range`` at the budget ``crypto.saturation_budget(δ)`` = 0.01·δ /
(1 + e^MEANINGFUL_EPSILON) (``crypto.dp.encoding_policy.packing_for``), so δ_total <= 1.01·δ at every ε
a run may claim. Caveats stated rather than hidden: the bound holds for the fixed C and σ of
the encoding; adaptive clipping (``crypto.dp.adaptive_clipping``) keeps them fixed by encoding Δ/C
(every coordinate <= 1) and the count coordinate ±a/2, so there C is max(1, a/2) and σ is
σ_Δ (``crypto.dp.encoding_policy.coordinate_bound``, ``wire_noise``) whatever norm a round uses; the dither
is a keyed SHAKE-256 stream, so "independent uniform" holds against parties without the
dither key (the server); the encryptor counts saturations, which under DP stay on the node.
With dp-mode local the coupling is not needed: each node's ``clip + N(0, (σC)²)`` is its
release and saturation is post-processing of it (its δ_sat is reported as 0). A discrete
(Skellam) mechanism on the integer encoding, which would make saturation part of the
mechanism itself, is not implemented.

Accounting. Client level (every ε a run prints, plots or quotes): the server's
`federation.client_accounting.ClientAccountant` (Flower 1.42's RdpAccountant), matched to the
client sampler: Poisson at the sampler's own q (add-or-remove-one) or fixed-size without
replacement (replace-one, σ/2). Nothing in crypto accounts client level (crypto never imports
flwr). Sample level (DP-SGD inside a node): `dp_sgd_epsilon` / `dp_sgd_noise_multiplier`, plain
Opacus RDP as its `PrivacyEngine` keeps it; the node and the experiments all call these. (The
former `PrivacyAccountant`, an Opacus Poisson accountant with extra orders that no run used, is
retired: issue 21.)

`privacy_claim(epsilon, dp_mode)` turns an ε into the label a results file may print: no ε above
`MEANINGFUL_EPSILON` is presented as a guarantee.
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
    "clip_and_noise",
    "dp_sgd_epsilon",
    "dp_sgd_noise_multiplier",
    "privacy_claim",
    "MEANINGFUL_EPSILON",
    "NO_MEANINGFUL_EPSILON",
]

Placement = Literal["local", "distributed", "server"]


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

    `rng` defaults to fresh OS entropy, checked in numpy 2.4.6: ``np.random.default_rng()``
    builds ``PCG64(SeedSequence())`` and a SeedSequence without entropy draws 128 bits from
    ``numpy.random.bit_generator.randbits``, which *is* ``secrets.randbits`` (a
    ``random.SystemRandom`` method: ``os.urandom``); ``tests/crypto/test_privacy.py`` checks
    both. So the seed is cryptographically random and never derived from the run's public
    ``seed``; PCG64 itself is a fast statistical generator, not a CSPRNG (its output after the
    seed is predictable to whoever learns its state), and numpy's sampler is not a
    constant-time, floating-point hardened DP sampler (see Mironov 2012): acceptable for
    research, noted for production. Every DP-noise draw in crypto/, node/ and federation/
    uses such a generator (a fresh ``default_rng()`` or one made once per process from it).
    """
    std = noise_std(sigma, clip_norm, placement, n_clients, missing)
    rng = rng if rng is not None else np.random.default_rng()
    return rng.normal(0.0, std, size=shape)


def clip_and_noise(
    update: np.ndarray,
    placement: Literal["local", "distributed"],
    clip_norm: float,
    sigma: float,
    n_clients: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, bool]:
    """A node's update-level Gaussian mechanism: (clip(update) + its noise, whether clipping
    changed it). Clip the flat ``update`` to ``clip_norm`` (skipped when ``clip_norm`` is 0),
    then add the ``placement``'s noise (local: N(0, (sigma*C)^2); distributed: the share
    N(0, (sigma*C)^2 / n_clients)) drawn from ``rng`` (skipped when ``sigma`` is 0).

    The clipped update is float32; once noised the result is float64 and stays so: casting the
    noisy value to float32 before the encoder's dither would round it by an amount that depends
    on the data (``crypto.dp.dither``). ``rng``: fresh OS entropy in a run (``gaussian_noise``).
    """
    clipped = False
    if clip_norm > 0:
        res = clip_update(update, clip_norm)
        update, clipped = res.clipped, res.was_clipped
    out = np.asarray(update, dtype=np.float32)
    if sigma > 0:
        out = out.astype(np.float64) + gaussian_noise(out.shape, sigma, clip_norm, placement, n_clients, rng)
    return out, bool(clipped)


# -- sample-level accounting (DP-SGD inside a node) -------------------------------------------------
def dp_sgd_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of ``steps`` DP-SGD steps at (σ, q): Opacus' ``RDPAccountant`` with its default orders, the
    accountant ``PrivacyEngine(accountant="rdp")`` keeps. The one sample-level accountant: the
    node reports it (``node.cache_node``) and the experiments audit and size σ with it."""
    from opacus.accountants import RDPAccountant

    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ParameterError(f"noise_multiplier must be finite and >= 0, not {noise_multiplier}")
    if not 0 < sample_rate <= 1:
        raise ParameterError("sample_rate must be in (0, 1]")
    if not 0 < delta < 1:
        raise ParameterError("delta must be in (0, 1)")
    if steps < 1:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acct = RDPAccountant()
    acct.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    with warnings.catch_warnings():
        # "optimal order is the largest alpha": larger orders could tighten the bound; this one is
        # still an upper bound on ε, so the warning says nothing a reader of ε must act on
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(acct.get_epsilon(delta))


def dp_sgd_noise_multiplier(target_eps: float, delta: float, sample_rate: float, steps: int) -> float:
    """Smallest σ whose ``dp_sgd_epsilon`` after ``steps`` is at most ``target_eps`` (Opacus' search,
    same accountant)."""
    from opacus.accountants.utils import get_noise_multiplier

    if not (target_eps > 0 and math.isfinite(target_eps)):
        raise ParameterError(f"target ε must be finite and > 0, not {target_eps}")
    with warnings.catch_warnings():  # as in dp_sgd_epsilon
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return float(get_noise_multiplier(target_epsilon=target_eps, target_delta=delta,
                                          sample_rate=sample_rate, steps=steps, accountant="rdp"))


# -- what a run may claim -------------------------------------------------------------------------
MEANINGFUL_EPSILON = 10.0
"""Above this ε (or at ε = ∞) a run claims no DP guarantee, only the mechanism."""
NO_MEANINGFUL_EPSILON = "clipping and noise, no meaningful ε at this population"
_DP_MODES = ("none", "local", "distributed", "flower-central")


def privacy_claim(
    epsilon: float, dp_mode: str, *, delta: float | None = None,
    level: Literal["client", "sample", "example"] = "client"
) -> str:
    """The short, honest label of what a run's DP amounts to.

    * dp_mode "none" (client level): ``"none: no DP"``;
    * ε <= `MEANINGFUL_EPSILON`: ``"client-level (ε=2.31, δ)"``, or with `delta`
      ``"client-level (ε=2.31, δ=1e-05)"`` (`level="sample"` or ``"example"`` for DP-SGD inside
      the nodes);
    * ε > `MEANINGFUL_EPSILON`, ε = ∞ or ε not accounted (NaN): exactly `NO_MEANINGFUL_EPSILON`.
    """
    if dp_mode not in _DP_MODES:
        raise ParameterError(f"dp_mode must be one of {_DP_MODES}, not {dp_mode!r}")
    if level not in ("client", "sample", "example"):
        raise ParameterError(f"level must be 'client', 'sample' or 'example', not {level!r}")
    if dp_mode == "none" and level == "client":
        return "none: no DP"
    epsilon = float(epsilon)
    if epsilon < 0:
        raise ParameterError(f"epsilon must be >= 0, not {epsilon}")
    if math.isnan(epsilon) or epsilon > MEANINGFUL_EPSILON:
        return NO_MEANINGFUL_EPSILON
    if delta is None:
        return f"{level}-level (ε={epsilon:.3g}, δ)"
    if not 0 < delta < 1:
        raise ParameterError(f"delta must be in (0, 1), not {delta}")
    return f"{level}-level (ε={epsilon:.3g}, δ={delta:.3g})"
