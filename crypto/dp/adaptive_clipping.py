"""Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping") for a sum that only key holders can read.

Each round every client clips its update to the current norm C and also contributes the bit
b = 1[‖Δ‖ <= C]; the noisy share of unclipped updates b̃ moves C geometrically towards the
target quantile γ: C ← C·exp(−η(b̃ − γ)). Flower's ``DifferentialPrivacyClientSideAdaptiveClipping``
does this with the count in plaintext; under CKKS the count must be summed like the update, so
it rides in the *same* ciphertext as one extra coordinate:

    v = [Δ_clipped / C,  a·(b − ½)]        with a = z_Δ / σ_b

Encoding Δ/C (norm <= 1) keeps the public encoding independent of C (the server never learns
C and its packing range stays fixed), and adding the same Gaussian noise z_Δ (std z_Δ on the
normalized sum, shared out over the clients) to every coordinate of v releases the update sum
with noise multiplier z_Δ and the centered count Σ(b − ½) with noise σ_b — exactly Andrew et
al.'s pair, whose joint sensitivity is sqrt(1 + a²/4) = z_Δ/z, so the release is one Gaussian
mechanism at noise multiplier
z = (z_Δ⁻² + (2σ_b)⁻²)^(−1/2): the accountant charges z, and z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)
is what the clients add (their Theorem 1; Flower makes the same split). C is then a function of
released values only (public to every key holder), so nodes can keep it themselves.

A hostile node can lie about its bit as it can about its update. Through the honest encoder its
count value is saturated to the public range ±R like every other value, so it moves b̃ by at most
(R + a/2)/(a·m); a key holder that skips the encoder can encrypt more, but the nodes refuse a
mean beyond the public bound B on the whole vector (``crypto.aggregate_bound``, issue 20), so the
mean's count coordinate stays within ±B and b̃ within (n/2 ± n·B/a)/m for n summed updates. C
moves by at most that times η in the exponent, per round; the other nodes' guarantee does not
depend on it (C is a function of released values, and their noise is their own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from crypto.errors import ParameterError

__all__ = ["AdaptiveClipping"]


@dataclass(frozen=True)
class AdaptiveClipping:
    """The public parameters of adaptive clipping and the arithmetic on them.

    noise_multiplier: z, what the accountant charges per round (0: no noise, the count is exact).
    count_stddev:     σ_b, the noise std of the summed clipped count (> z/2 when z > 0).
    target_quantile:  γ in (0, 1), the share of updates the norm aims to leave unclipped. Default 0.5.
    learning_rate:    η >= 0 of the geometric update. Default 0.2 (Flower's ``clip_norm_lr``).
    """

    noise_multiplier: float
    count_stddev: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2

    def __post_init__(self) -> None:
        z, sb = self.noise_multiplier, self.count_stddev
        if not (math.isfinite(z) and z >= 0):
            raise ParameterError(f"noise_multiplier must be finite and >= 0, not {z!r}")
        if not (math.isfinite(sb) and sb > 0):
            raise ParameterError(f"count_stddev must be finite and > 0, not {sb!r}")
        if z > 0 and not 2 * sb > z:
            raise ParameterError(f"count_stddev {sb} must exceed noise_multiplier/2 = {z / 2}: "
                                 "the count would use all the noise the round is charged for")
        if not 0 < self.target_quantile < 1:
            raise ParameterError(f"target_quantile must be in (0, 1), not {self.target_quantile!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            raise ParameterError(f"learning_rate must be finite and >= 0, not {self.learning_rate!r}")

    @property
    def update_noise_multiplier(self) -> float:
        """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the noise multiplier clients add (0 when z = 0)."""
        z = self.noise_multiplier
        if z == 0:
            return 0.0
        return (z**-2 - (2 * self.count_stddev) ** -2) ** -0.5

    @property
    def count_scale(self) -> float:
        """a = z_Δ/σ_b: the count coordinate per unit of (b − ½), so that noise z_Δ on it is σ_b
        on the count. 1 without noise (any scale is exact then)."""
        return self.update_noise_multiplier / self.count_stddev if self.noise_multiplier > 0 else 1.0

    def count_coordinate(self, unclipped: bool) -> float:
        """A client's extra coordinate: a·(b − ½), b = 1 when its update was not clipped."""
        return self.count_scale * (float(bool(unclipped)) - 0.5)

    def unclipped_fraction(self, coordinate_sum: float, updates: int, expected: float) -> float:
        """b̃ = (noisy Σb) / expected, from the decrypted sum of the count coordinates over
        ``updates`` summed updates (noise shares add noise only); ``expected`` is the
        denominator the update mean uses (the realized count, or q·N under Poisson sampling)."""
        if not (math.isfinite(coordinate_sum) and updates >= 0 and expected > 0):
            raise ParameterError("count sum must be finite, updates >= 0 and expected > 0")
        return (coordinate_sum / self.count_scale + updates / 2) / expected

    def next_clip_norm(self, clip_norm: float, unclipped_fraction: float) -> float:
        """C·exp(−η(b̃ − γ)): shrink when more than γ of the updates were left unclipped."""
        if not (math.isfinite(clip_norm) and clip_norm > 0 and math.isfinite(unclipped_fraction)):
            raise ParameterError("clip norm must be finite and > 0, the fraction finite")
        return clip_norm * math.exp(-self.learning_rate * (unclipped_fraction - self.target_quantile))
