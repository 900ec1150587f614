"""The public encoding policy: how a run's DP settings become the packing every node uses.

A pure function of ``EncodingParams`` (the run config's fields read here; built from
``RunConfig`` by ``federation.codec.encoding_params``) and the number of values encoded, so it is
identical on every node and the server. What it costs in resolution: ``docs/encryption.md``
("Encoding rule").

* mode = ``packing``, bits = ``packing-bits``, max_clients = ``max-clients``; dither under
  dp-mode distributed (``crypto.dp.dither``: the rounding error does not depend on the data);
* max_weight = 1 under DP (every client has weight 1: the sensitivity analysis assumes equal
  weights), ``max-weight`` with dp-mode none (weight = min(num_examples, max-weight));
* clip_range R = ``packing-range`` if > 0, else derived from the coordinate bound C (updates are
  L2-clipped to C, always with he=true, so no coordinate exceeds C) and s, the largest
  per-contribution noise std a round can use (``contribution_std``: σC local, σC/√min-clients
  distributed, 0 without DP):

  - under DP (σ > 0): R = ``crypto.dp_clip_range(C, s, dim, max-clients, rounds, budget)``, the
    smallest range whose saturation bound δ_sat (``crypto.dp.saturation``) is at most
    ``saturation_budget(target-delta)`` = 0.01·δ / (1 + e^MEANINGFUL_EPSILON). That makes the
    premise of the coupling bound in ``crypto.dp.privacy`` true: what runs is
    (ε, δ + (1 + e^ε)·δ_sat)-DP (``run_saturation_delta``, reported per round). An explicit
    packing-range under DP is kept; its δ_sat is whatever it is, and reported.
  - dp-mode none: the heuristic R = sqrt((4·s)² + (12·C/√dim)²), capped at C + 4·s
    (``crypto.suggest_clip_range`` with a 3x wider allowance for heavy-tailed trained updates:
    at 4·C/√dim 1 % of digits values saturated and accuracy fell 0.4 points; at 12·C/√dim none).

  Rounded *up* to 6 significant digits (the range is in the packing fingerprint; up, so the
  bound still holds). Values outside ±R are saturated and counted, never wrapped.
* adaptive clipping under dp-mode distributed (``adaptive_clipping_for``): a contribution is
  ``wire_dim`` = dim + 1 values, the update divided by the nodes' current norm and the
  clipped-count coordinate ±a/2 (``crypto.dp.adaptive_clipping``), so the rules above run with
  C replaced by max(1, a/2) (``coordinate_bound``) and σ by σ_Δ (``wire_noise``). The encoding
  never depends on the adapted norm, which the server never holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from crypto.aggregate_bound import PLAIN_RELATIVE_ERROR, MeanBound
from crypto.dp.adaptive_clipping import AdaptiveClipping
from crypto.dp.saturation import dp_clip_range, saturation_budget, saturation_delta
from crypto.errors import ParameterError
from crypto.packing import PackingConfig

__all__ = [
    "EncodingParams", "RANGE_NOISE_TAIL", "RANGE_SIGNAL_TAIL", "adaptive_clipping_for", "client_max_weight",
    "client_weight", "contribution_std", "coordinate_bound", "mean_bound_for", "packing_for",
    "run_saturation_delta", "uses_error_feedback", "wire_clip_norm", "wire_dim", "wire_noise",
]

RANGE_NOISE_TAIL = 4.0
"""Noise standard deviations covered by the derived packing range."""
RANGE_SIGNAL_TAIL = 12.0
"""Multiples of the clipped signal's coordinate RMS (C/√dim) covered by the derived range."""


@dataclass(frozen=True)
class EncodingParams:
    """The run config's fields the policy reads (names and meaning as in ``RunConfig``)."""

    he: bool
    dp_mode: str
    noise_multiplier: float
    clip_norm: float
    min_clients: int
    max_clients: int
    num_server_rounds: int
    target_delta: float
    packing: str
    packing_bits: int
    packing_range: float
    max_weight: float
    error_feedback: bool
    adaptive_clipping: bool
    clipped_count_stddev: float
    target_clipped_quantile: float
    clip_norm_lr: float


def adaptive_clipping_for(p: EncodingParams) -> AdaptiveClipping | None:
    """fedkv's adaptive clipping under HE (``crypto.dp.adaptive_clipping``), or None (fixed norm,
    or Flower's own wrapper under flower-central). σ_b = 0 means max(max-clients/20, σ)."""
    if not (p.adaptive_clipping and p.dp_mode == "distributed"):
        return None
    count_std = p.clipped_count_stddev or max(p.max_clients / 20, p.noise_multiplier)
    return AdaptiveClipping(p.noise_multiplier, count_std, p.target_clipped_quantile, p.clip_norm_lr)


def wire_dim(p: EncodingParams, model_dim: int) -> int:
    """Values per contribution: the model's, plus the clipped-count coordinate under adaptive clipping."""
    return model_dim + 1 if adaptive_clipping_for(p) is not None else model_dim


def wire_noise(p: EncodingParams) -> tuple[float, float]:
    """(clip norm, noise multiplier) of what is encoded: (C, σ), or under adaptive clipping
    (1, σ_Δ), since updates travel divided by the nodes' current norm."""
    adaptive = adaptive_clipping_for(p)
    if adaptive is None:
        return p.clip_norm, p.noise_multiplier
    return 1.0, adaptive.update_noise_multiplier


def coordinate_bound(p: EncodingParams) -> float:
    """The largest |value| a contribution holds before noise: C (no coordinate of an update
    clipped to C exceeds it), or under adaptive clipping max(1, a/2) (Δ/C and the count)."""
    adaptive = adaptive_clipping_for(p)
    if adaptive is None:
        return p.clip_norm
    return max(1.0, adaptive.count_scale / 2)


def contribution_std(p: EncodingParams) -> float:
    """The largest per-contribution noise std a round can use: σC (local), σC/√min-clients
    (distributed: a round has >= min-clients clients, so its share is at most this), 0 (none);
    with (C, σ) as encoded (``wire_noise``)."""
    c, sigma = wire_noise(p)
    if p.dp_mode == "local":
        return sigma * c
    if p.dp_mode == "distributed":
        return sigma * c / math.sqrt(max(p.min_clients, 1))
    return 0.0


def _round_up_6(x: float) -> float:
    """x rounded *up* to 6 significant digits: the range goes into the packing fingerprint every
    ciphertext carries, so a last-bit libm difference between machines must not split the run;
    up, so the saturation bound computed at the unrounded range still holds."""
    r = float(f"{x:.6g}")
    if r >= x:
        return r
    exp10 = math.floor(math.log10(x)) - 5
    return float(f"{r + 10.0**exp10:.6g}")


def _derived_range(p: EncodingParams, dim: int, s: float) -> float:
    """R for packing-range = 0: ``dp_clip_range`` under DP (δ_sat <= ``saturation_budget``),
    the saturation heuristic without DP (module docstring)."""
    c = coordinate_bound(p)
    if p.dp_mode in ("local", "distributed") and s > 0:
        return _round_up_6(dp_clip_range(c, s, max(dim, 1), p.max_clients, p.num_server_rounds,
                                         saturation_budget(p.target_delta)))
    signal_rms = c / math.sqrt(max(dim, 1))
    heuristic = min(math.hypot(RANGE_NOISE_TAIL * s, RANGE_SIGNAL_TAIL * signal_rms), c + RANGE_NOISE_TAIL * s)
    adaptive = adaptive_clipping_for(p)
    if adaptive is not None:  # σ = 0: the clipped-count coordinate is ±a/2 exactly and must not saturate
        heuristic = max(heuristic, adaptive.count_scale / 2)
    return float(f"{heuristic:.6g}")


def packing_for(p: EncodingParams, dim: int) -> PackingConfig:
    """The public ``PackingConfig`` of a run (same on every node and the server).

    A pure function of the parameters and the number of values encoded (``wire_dim``); see
    the module docstring for the rule. Raises ``ValueError`` when crypto rejects the
    resulting parameters.
    """
    try:
        clip_range = p.packing_range if p.packing_range > 0 else _derived_range(p, dim, contribution_std(p))
        return PackingConfig(
            mode=p.packing,
            bits=p.packing_bits,
            clip_range=float(clip_range),
            max_clients=p.max_clients,
            max_weight=client_max_weight(p),
            dither=p.dp_mode == "distributed",  # rounding independent of the data (crypto.dp.dither)
        )
    except ParameterError as err:
        raise ValueError(f"bad run config: packing parameters rejected by crypto: {err}") from None


def run_saturation_delta(p: EncodingParams, dim: int) -> float:
    """δ_sat of the run (``crypto.dp.saturation``): the probability bound that some contribution
    saturates, at the run's packing range, rounds and max-clients. 0 where saturation is not
    part of the analysis: he=false (nothing is saturated), dp-mode none / flower-central, and
    dp-mode local (each node's noisy update is its release; saturating it is post-processing,
    ``crypto.dp.privacy``)."""
    s = contribution_std(p)
    if not p.he or p.dp_mode != "distributed" or s <= 0:
        return 0.0
    clip_range = packing_for(p, dim).clip_range
    return saturation_delta(clip_range, coordinate_bound(p), s, max(dim, 1), p.max_clients, p.num_server_rounds)


def uses_error_feedback(p: EncodingParams) -> bool:
    """Error feedback runs with he=true, packed, and not under distributed DP (crypto.dp.privacy)."""
    return p.he and p.packing == "packed" and p.error_feedback and p.dp_mode != "distributed"


def wire_clip_norm(p: EncodingParams) -> float:
    """The L2 bound of one encoded update's signal: C, or under adaptive clipping the norm of
    [Δ/C_t, a·(b - ½)], at most √(1 + a²/4)."""
    adaptive = adaptive_clipping_for(p)
    if adaptive is None:
        return p.clip_norm
    return math.hypot(1.0, adaptive.count_scale / 2)


def mean_bound_for(p: EncodingParams, dim: int, real_scale_bits: int = 40) -> MeanBound:
    """The public bound a decoded mean must respect (``crypto.aggregate_bound``). he=true:
    C = ``wire_clip_norm``; noise (σC)² per update (local) or per sum (distributed) with (C, σ) of
    ``wire_noise``; rounding step²/12 per summand with a dither, step²/4 with stochastic
    rounding, plus step²/4 per update for the error-feedback carry; in mode none CKKS' error
    2^-(real_scale_bits - 20) (``real_scale_bits`` of the node's CKKS parameters) instead.
    he=false: the same C, noise and weights, no rounding or CKKS term, float32's relative slack
    (``crypto.aggregate_bound``, "With he=false")."""
    c, sigma = wire_noise(p)
    noise_var = (sigma * c) ** 2
    if not p.he:
        return MeanBound(
            dim=dim,
            clip_norm=wire_clip_norm(p),
            update_noise_var=noise_var if p.dp_mode == "local" else 0.0,
            shared_noise_var=noise_var if p.dp_mode == "distributed" else 0.0,
            relative_error=PLAIN_RELATIVE_ERROR,
            unit_weights=p.dp_mode != "none",
            max_weight=client_max_weight(p),
            max_clients=p.max_clients,
        )
    packing = packing_for(p, dim)
    packed = packing.mode == "packed"
    step2 = packing.step**2 if packed else 0.0
    return MeanBound(
        dim=dim,
        clip_norm=wire_clip_norm(p),
        update_noise_var=noise_var if p.dp_mode == "local" else 0.0,
        shared_noise_var=noise_var if p.dp_mode == "distributed" else 0.0,
        rounding_proxy=step2 / 12 if packing.dither else step2 / 4,
        carry_proxy=step2 / 4 if uses_error_feedback(p) else 0.0,
        ckks_error=0.0 if packed else 2.0 ** -(real_scale_bits - 20),
        unit_weights=p.dp_mode != "none",
        max_weight=client_max_weight(p),
        noise_replies=p.dp_mode == "distributed",
        max_clients=p.max_clients,
    )


def client_max_weight(p: EncodingParams) -> float:
    """Public bound on a client weight: 1 under DP (equal weights), else ``max-weight``."""
    return p.max_weight if p.dp_mode == "none" else 1.0


def client_weight(p: EncodingParams, num_examples: int) -> tuple[float, bool]:
    """(FedAvg weight, was it capped). Equal weights under DP: the sensitivity analysis
    assumes each client counts once; example counts capped at ``max-weight`` otherwise."""
    if p.dp_mode != "none":
        return 1.0, False
    w = float(num_examples)
    return (p.max_weight, True) if w > p.max_weight else (w, False)
