"""The slot layout a (CKKS parameters, packing) pair fixes, and the ring chosen from it.

``SlotPlan``: values per slot part, weight bits, scale, ciphertexts per update; it raises
``ParameterError`` when the packing does not fit the ring. ``Packer`` turns pre-scaled values
into slot parts (quantize + pack when packed), shared by the client encryptor and the server's
noise top-up so both encode identically. Slot parts 0 and 1 of the first ciphertext hold the
weight sum and the contribution count (``HEADER_PARTS``); the values follow.

``preset_for``: the smallest ring of ``AUTO_PRESETS`` (``PQ_AUTO_PRESETS`` under he-security
post-quantum) whose one ciphertext holds the update; ``update_bytes_estimate`` its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crypto.context import PRESETS, CkksParams
from crypto.errors import ParameterError
from crypto.packing import PackingConfig, dequantize, dithered_quantize, pack_fields, stochastic_quantize

__all__ = ["AUTO_PRESETS", "HEADER_PARTS", "PQ_AUTO_PRESETS", "Packer", "SlotPlan", "preset_for",
           "update_bytes_estimate"]

HEADER_PARTS = 2  # slot part 0: weight sum, part 1: contribution count


@dataclass(frozen=True)
class SlotPlan:
    """Everything derived from (CkksParams, PackingConfig) that fixes the slot layout."""

    params: CkksParams
    packing: PackingConfig

    def __post_init__(self) -> None:
        pk, pa = self.packing, self.params
        if pk.mode == "packed":
            if self.k < 1:
                raise ParameterError(
                    f"a {pk.field_bits}-bit field (bits={pk.bits} + headroom {pk.headroom_bits}) "
                    f"does not fit a {pa.slot_bits}-bit slot part"
                )
            if self.wfrac < 16:
                raise ParameterError("max_clients too large for the weight slot")
        else:
            bound = pa.real_value_bound(pk.max_clients)
            if pk.clip_range > bound:
                raise ParameterError(
                    f"mode none: clip_range {pk.clip_range} x max_clients {pk.max_clients} would "
                    f"overflow q0 at scale 2^{pa.real_scale_bits}; use clip_range <= {bound:g}"
                )

    @property
    def packed(self) -> bool:
        return self.packing.mode == "packed"

    @property
    def k(self) -> int:
        return self.packing.fields_per_part(self.params.slot_bits)

    @property
    def wfrac(self) -> int:
        return self.packing.weight_frac_bits(self.params.slot_bits)

    @property
    def scale(self) -> float:
        bits = self.params.packed_scale_bits if self.packed else self.params.real_scale_bits
        return float(2**bits)

    @property
    def parts_per_ct(self) -> int:
        return self.params.slot_parts

    def n_data_parts(self, n_values: int) -> int:
        return -(-n_values // self.k)

    def n_ciphertexts(self, n_values: int) -> int:
        return max(1, -(-(HEADER_PARTS + self.n_data_parts(n_values)) // self.parts_per_ct))

    @property
    def max_ciphertext_bytes(self) -> int:
        # size-2 ciphertext with every limb, uncompressed, plus SEAL's header: a generous cap
        n, limbs = self.params.poly_modulus_degree, len(self.params.coeff_mod_bit_sizes)
        return 2 * n * limbs * 8 + 4096

    def bytes_per_param_estimate(self) -> float:
        """Seeded symmetric ciphertext: one N-coefficient 64-bit polynomial per N*k values."""
        return 8.0 / self.k


class Packer:
    """Turns pre-scaled values into slot parts (quantize + pack when packed); shared by the
    client encryptor and the server's noise top-up so both encode identically."""

    def __init__(self, plan: SlotPlan, rng: np.random.Generator) -> None:
        self.plan = plan
        self.rng = rng

    def encode_values(self, y: np.ndarray, contributions: int) -> np.ndarray:
        return self.quantize(y, contributions)[0]

    def quantize(self, y: np.ndarray, contributions: int, u: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(slot parts, the values they stand for): the second is what the sum will contain.
        With a dither `u` (one per summand, whatever its contributions) the rounding is
        subtractive-dithered."""
        plan, pk = self.plan, self.plan.packing
        if not plan.packed:
            return y, y
        if u is not None:
            q = dithered_quantize(y, pk.clip_range, pk.levels, u, contributions)
            sent = dequantize(q - u + 0.5, pk.clip_range, pk.levels, contributions)
        else:
            q = stochastic_quantize(y, pk.clip_range, pk.levels, self.rng, contributions)
            sent = dequantize(q, pk.clip_range, pk.levels, contributions)
        return pack_fields(q, pk.field_bits, plan.k).astype(np.float64), sent

    def assemble(self, header: tuple[float, float], data: np.ndarray, n_values: int) -> np.ndarray:
        n_ct = self.plan.n_ciphertexts(n_values)
        parts = np.zeros(n_ct * self.plan.parts_per_ct, dtype=np.float64)
        parts[0], parts[1] = header
        parts[HEADER_PARTS : HEADER_PARTS + data.shape[0]] = data
        return parts


AUTO_PRESETS = ("fedkv-2048", "fedkv-4096")
"""The rings `preset_for` chooses among (all classical 128-bit secure by the HE standard's
tables; not its post-quantum column)."""
PQ_AUTO_PRESETS = ("fedkv-2048-pq", "fedkv-4096-pq")
"""The same choice within the HE standard's post-quantum 128-bit column (he-security)."""


def update_bytes_estimate(params: CkksParams, packing: PackingConfig, n_values: int) -> int:
    """Bytes of a seeded update of `n_values` under `params`: one N-word polynomial per
    ciphertext plus SEAL's header and seed (~210 bytes, measured), envelope excluded."""
    plan = SlotPlan(params, packing)
    return plan.n_ciphertexts(n_values) * (8 * params.poly_modulus_degree + 210)


def preset_for(n_values: int, packing: PackingConfig, names: tuple[str, ...] = AUTO_PRESETS) -> str:
    """The smallest ring of `names` (ordered small to large) whose ONE ciphertext holds
    `n_values`; the last of `names` when none does. Why: a model below one N=4096 ciphertext's
    capacity pays for the whole ciphertext, and the smallest secure ring that holds it costs half
    as much. Larger models stay on the larger ring: the same bytes per parameter in fewer
    ciphertexts, and 60-bit coefficients the MAC reads fast (``crypto.binding``)."""
    for name in names:
        try:
            if SlotPlan(PRESETS[name], packing).n_ciphertexts(n_values) == 1:
                return name
        except ParameterError:
            continue  # this packing does not fit that ring's slots
    return names[-1]
