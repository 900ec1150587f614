"""The public bound on a decrypted mean: what honest nodes cannot exceed, so nodes refuse more.

Why (issue 20): CKKS without range proofs lets a node that holds the key encrypt any values, and
tag (``crypto.binding``) and sign them validly. The honest encoder saturates each coordinate to
the public range ±R, but ±R on every coordinate is a vector of norm R·√d, and a node that skips
the encoder can put any integer its field's headroom holds in a slot, or any weight and count in
the encrypted header. On digits (d = 4810, R = 1.30) one such update moved the mean of three to
norm 30 against a clip norm of 1, and accuracy fell to chance. The MAC proves that an aggregate
is the sum of what the nodes tagged; nothing proves that what they tagged was clipped. What a
node can check is the result: the mean of clipped updates has norm at most C, and the noise and
rounding added to it are bounded with high probability. A mean beyond that bound did not come
from honest nodes (except with probability β), and every node refuses it.

Setup (the wire domain, ``crypto.dp.encoding_policy``: C and σ are what is encoded, ``wire_noise``; under
adaptive clipping an update is [Δ/C_t, a·(b - ½)], of norm at most √(1 + a²/4)). An aggregate has
J summands, its manifest's entries: n updates and J - n noise replies. Update i is pre-scaled by
its normalized weight w_i in [0, 1] (weight / max-weight; 1 under DP), so its encoder gets

    y_i = w_i·x_i + z_i + c_i,        ‖x_i‖ <= C,

with z_i its DP noise and c_i its error-feedback carry (what its previous encoding left out); a
noise reply j of m_j shares gets y_j = z_j. Each summand is saturated to ±m_j·R, rounded to the
grid (step = 2R / (2^bits - 1)) and encrypted; the decrypted header holds W = Σ w_i and the
contribution count k, and the node decodes mean = Σ_j sent_j / W.

The event E: no summand saturates and no carry holds a saturation remainder. On E every sent
value is y_j + e_j with e_j its rounding error, and c_i = -e'_i (node i's previous error), so

    W·mean = Σ w_i·x_i + V,   V = Σ z + Σ e - Σ e',   and   ‖Σ w_i·x_i‖ <= Σ w_i·C = W·C.

V, coordinate by coordinate:

* z, Gaussian: local, every update carries N(0, (σC)²); distributed, every contribution carries a
  share N(0, (σC)²/n_s) (n_s: the round's sampled count) and there are k <= n_s of them (the
  survivors plus the shares made for those who left), at most (σC)² in all; none, 0.
* e with a dither (dp-mode distributed, ``crypto.dp.dither``): uniform on an interval of one step,
  independent of every value; E exp(λe) = sinh(λh)/(λh) <= exp(λ²h²/6) with h = step/2, so e is
  sub-Gaussian with variance proxy step²/12, one per summand.
* e with stochastic rounding (none, local): given the value, two points one step apart with mean
  0, proxy step²/4 (Hoeffding's lemma), one per summand; the carry -e' is the same node's
  previous such error: proxy step²/4 per update, with error feedback.

Every draw is fresh per coordinate and its conditional moment bound holds given everything drawn
before it, so by the tower rule E exp(<λ, V>) <= exp(‖λ‖²·v/2) for every λ in R^d, with

    v = s² + J·p_e + n·p_carry          (s²: the total noise variance per coordinate).

For such a vector Hsu, Kakade and Zhang (2012, "A tail inequality for quadratic forms of
subgaussian random vectors", Theorem 1 with A = I; for a Gaussian V it is Laurent and Massart
2000, Lemma 1) give P(‖V‖² > v·(d + 2·√(d·t) + 2t)) <= e^-t, and d + 2√(dt) + 2t <= (√d + √(2t))².
With t = ln(1/β):

    ‖V‖ <= √v · (√d + √(2·ln(1/β)))            with probability >= 1 - β.

Packing mode "none" (CKKS reals) has no rounding but CKKS' own approximation error, below
ε = 2^-(real_scale_bits - 20) per coordinate of the sum (``PackingConfig.mean_error_bound``), which
adds ε·√d. Together, the check every node makes before it writes an aggregate back:

    ‖mean‖ <= B = C + (√v · (√d + √(2·ln(1/β))) + ε·√d) / W,        β = 1e-9.

An honest round is refused with probability at most β + P(not E). Under DP with the derived
range, P(not E) is at most δ_sat (``crypto.dp.saturation``: the event the privacy coupling charges,
sized to 0.01·δ/(1 + e^10), about 4.5e-7·δ, over the whole run). With dp-mode none (no noise, a
heuristic range) E fails only when an update, in this round or in the one its carry comes from,
has a coordinate beyond R, which the nodes count (``saturated`` in the reply metrics); such a
carry holds more than a rounding error, and an honest round can then exceed B (it is refused and
discarded like any other).

The decrypted header is checked against the manifest as well, exactly. Under DP every update has
weight 1 and every noise reply weight 0, so W = n. With dp-mode none each weight lies in
[1/max-weight, 1] (a node trains on at least one example), so n/max-weight <= W <= n: the lower
end caps how far a crafted weight can widen B (it grows as 1/W). The count k is n without noise
replies, and between J and max-clients with them.

The check is on the mean as decoded (the wire domain). What a node then writes back is that mean
times public factors only: n/(q·N) under Poisson sampling (the fixed denominator; n <= max-clients)
and the current norm C_t under adaptive clipping, so one accepted round moves the model by at most
B times them, as much as an honest round may.

What the bound does not stop: a node that holds the key can still put the mean anywhere within
B (its own update may have norm up to about n·B instead of C), and a refused aggregate does not
show which summand was bad (the round is discarded). Range proofs would; TenSEAL has none.

With he=false (the plaintext codec) the same check runs with the plaintext's terms: every update
is clipped to C (dp-mode none too), carries the same DP noise, and is neither saturated nor
rounded to a grid nor encrypted, so v = s² (no rounding, no carry, no CKKS error) and E always
holds; what remains is float32 on the wire (the update, the sum and the mean each cast once),
a relative error of a few 2^-24 on the norm, allowed for by ``relative_error``:

    ‖mean‖ <= B = (C + √(s²) · (√d + √(2·ln(1/β))) / W) · (1 + 2^-20).

The header is the server's own (weight sum, update count): the weight check is the same (W = n
under DP, n/max-weight <= W <= n otherwise), with n the header's count, which the caller holds
to at least min-clients. There a refusal means the server, or a node that skipped its clipping,
sent a mean no honest round makes; within B the server, which sees every update, can still
steer the model (its ``he=false`` row in docs/threat-model.md).

What leaves a node does not depend on the secret key's decryption noise: in mode "packed" the
check runs on exact integer sums (the noise was rounded away before), and an aggregate reaches
it only after the MAC, so it is a sum of tagged summands, which only key holders can make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from crypto.errors import ParameterError

__all__ = ["BETA", "PLAIN_RELATIVE_ERROR", "MeanBound", "norm_tail"]

BETA = 1e-9
"""The probability with which the bound may refuse an honest round (on the event E above)."""

PLAIN_RELATIVE_ERROR = 2.0**-20
"""he=false: B's relative slack for float32 on the wire (the clipped update, the weight pre-scale,
the sum and the mean each round once, a relative 2^-24 each; 16 ulps leave room)."""

_HEADER_TOLERANCE = 1e-6
"""|W - n| and W's floor, relative to n: exact in mode packed (fixed-point weights); mode none
decrypts W with CKKS' approximation error (~1e-8)."""


def norm_tail(proxy: float, dim: int, beta: float = BETA) -> float:
    """√v·(√d + √(2·ln(1/β))): ‖V‖ stays below it with probability >= 1 - β for a d-dimensional
    V with E exp(<λ, V>) <= exp(‖λ‖²·v/2) (Hsu-Kakade-Zhang; Laurent-Massart when Gaussian)."""
    if not (math.isfinite(proxy) and proxy >= 0):
        raise ParameterError(f"variance proxy must be finite and >= 0, not {proxy!r}")
    if not (isinstance(dim, int) and dim >= 1):
        raise ParameterError(f"dim must be an int >= 1, not {dim!r}")
    if not 0 < beta < 1:
        raise ParameterError(f"beta must be in (0, 1), not {beta!r}")
    return math.sqrt(proxy) * (math.sqrt(dim) + math.sqrt(2.0 * math.log(1.0 / beta)))


@dataclass(frozen=True)
class MeanBound:
    """The public bound on an aggregate's decrypted mean (module docstring), in the wire domain.

    Every field is public: a function of the run config and the model size
    (``crypto.dp.encoding_policy.mean_bound_for``), the same on every node.
    """

    dim: int
    """d: values per contribution."""
    clip_norm: float
    """C: the L2 bound of one update's (weight-normalized) signal."""
    update_noise_var: float = 0.0
    """Per coordinate, the noise variance every update carries (local: (σC)²)."""
    shared_noise_var: float = 0.0
    """Per coordinate, the noise variance of all the shares in one sum (distributed: (σC)²)."""
    rounding_proxy: float = 0.0
    """Per coordinate and summand, the rounding error's variance proxy (dither step²/12,
    stochastic rounding step²/4, mode none 0)."""
    carry_proxy: float = 0.0
    """Per coordinate and update, the error-feedback carry's proxy (step²/4; 0 without feedback)."""
    ckks_error: float = 0.0
    """Per coordinate of the sum, CKKS' approximation error in mode none (0 when packed)."""
    relative_error: float = 0.0
    """Relative slack on B for float32 wire values (he=false: ``PLAIN_RELATIVE_ERROR``; 0 under
    HE, whose rounding the proxies above hold)."""
    unit_weights: bool = True
    """DP: every update has weight 1 and a noise reply 0, so W must be n."""
    max_weight: float = 1.0
    """dp-mode none: weights are in [1/max_weight, 1] after normalization."""
    noise_replies: bool = False
    """dp-mode distributed: noise replies may be summands (k between J and max_clients)."""
    max_clients: int = 32
    beta: float = BETA

    def __post_init__(self) -> None:
        if not (isinstance(self.dim, int) and self.dim >= 1):
            raise ParameterError(f"dim must be an int >= 1, not {self.dim!r}")
        for name in ("update_noise_var", "shared_noise_var", "rounding_proxy", "carry_proxy", "ckks_error",
                     "relative_error"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ParameterError(f"{name} must be finite and >= 0, not {value!r}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ParameterError(f"clip_norm must be finite and > 0, not {self.clip_norm!r}")
        if not (math.isfinite(self.max_weight) and self.max_weight >= 1):
            raise ParameterError(f"max_weight must be finite and >= 1, not {self.max_weight!r}")
        if not 0 < self.beta < 1:
            raise ParameterError(f"beta must be in (0, 1), not {self.beta!r}")

    def allowance(self, n_updates: int, n_summands: int) -> float:
        """The sum-domain allowance for noise and rounding: √v·(√d + √(2 ln 1/β)) + ε·√d."""
        v = (self.shared_noise_var + n_updates * (self.update_noise_var + self.carry_proxy)
             + n_summands * self.rounding_proxy)
        return norm_tail(v, self.dim, self.beta) + self.ckks_error * math.sqrt(self.dim)

    def radius(self, n_updates: int, n_summands: int, weight_sum: float) -> float:
        """B = (C + allowance / W)·(1 + relative error), with W the normalized weight sum
        (Σ weight / max-weight)."""
        return (self.clip_norm + self.allowance(n_updates, n_summands) / weight_sum) * (1.0 + self.relative_error)

    def header_matches(self, n_updates: int, n_summands: int, weight_sum: float, contributions: int) -> bool:
        """Whether the decrypted weight sum W (normalized) and count k can be the manifest's:
        W = n under DP, n/max-weight <= W <= n otherwise; k = n without noise replies, J <= k <=
        max-clients with them."""
        if not (1 <= n_updates <= n_summands and math.isfinite(weight_sum)):
            return False
        tol = _HEADER_TOLERANCE * n_updates
        if self.unit_weights:
            weights_ok = abs(weight_sum - n_updates) <= tol
        else:
            weights_ok = n_updates / self.max_weight - tol <= weight_sum <= n_updates + tol
        if self.noise_replies:
            count_ok = n_summands <= contributions <= self.max_clients
        else:
            count_ok = contributions == n_updates == n_summands
        return weights_ok and count_ok

    def admits(self, mean: np.ndarray, n_updates: int, n_summands: int, weight_sum: float,
               contributions: int) -> bool:
        """The node's check: the header matches the manifest and ‖mean‖ <= B."""
        mean = np.asarray(mean, dtype=np.float64)
        if mean.shape != (self.dim,) or not np.isfinite(mean).all():
            return False
        if not self.header_matches(n_updates, n_summands, weight_sum, contributions):
            return False
        return float(np.linalg.norm(mean)) <= self.radius(n_updates, n_summands, weight_sum)
