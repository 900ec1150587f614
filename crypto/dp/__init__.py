"""Differential privacy, apart from the HE, MAC, signatures and secrets of ``crypto``.

- ``privacy``: L2 clipping, Gaussian noise placements, the sample-level accountant, the
  coupling bound that charges saturation, ``privacy_claim``.
- ``adaptive_clipping``: Andrew et al.'s norm update with the count in the ciphertext.
- ``saturation``: δ_sat of a packing range, and the range that fits a δ budget.
- ``dither``: the keyed subtractive dither, the rounding half of the distributed mechanism (its
  error must not depend on the data, or the released sum is not the accounted Gaussian's).
- ``encoding_policy``: the public packing of a run (range, weights, noise placement, dither).

Everything here may import ``crypto``'s core (errors, layout, packing, the mean bound); the core
never imports ``crypto.dp``. The names are re-exported by ``crypto`` (``from crypto import X``).
"""
