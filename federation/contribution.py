"""What a node sends: ``make_contribution`` applies the node-side mechanism to one local update,
in one readable order, and returns the signed wire bytes (Opacus' ``make_private`` shape: one
call, its preconditions documented, its randomness injected).

The whole mechanism, in order, all of it here: the node only trains and hands over its raw
update (``node.cache_node.CacheNode.train_round``; DP-SGD's per-sample clipping and noise, when
on, happen inside that training):

1. **clip** the update to the round's norm C (dp-mode local/distributed; dp-mode none too, with
   the run's ``clip-norm``: the CKKS encoding needs a bounded range, ``federation.codec.packing_for``,
   and every node refuses a mean beyond the bound C implies, ``crypto.aggregate_bound``, he=false
   included);
2. **noise share** (dp-mode local/distributed): the node's Gaussian share (σC/√k distributed,
   σC local) drawn from ``rng``, in float64 so the encoder's dither sees the noisy value
   unrounded (steps 1 and 2: ``crypto.dp.privacy.clip_and_noise``);
3. **count coordinate** (adaptive clipping): the update divided by C plus one coordinate, the
   clipped count, with its own noise share drawn from ``rng``
   (``crypto.dp.adaptive_clipping``);
4. **weight** (``codec.client_weight``: capped example count, or 1 under DP);
5. **residual / dither**: the error-feedback carry of the last round (``uses_error_feedback``)
   and the quantization dither (``crypto.dp.dither``, derived from the key's dither key and the
   contribution's public coordinates);
6. **encode** (``federation.codec``: CKKS ciphertext, or the plaintext codec with he=false);
7. **tag** (he=true: the aggregate MAC over the ciphertext's coefficients, ``crypto.binding``);
8. **sign** (Ed25519 over run, node, round, key epoch, key id, kind, tag and payload digest).

``make_noise_shares`` is the same path for a ``query.fedkv_noise`` answer: zeros of weight 0
with m shares of noise, dithered, encoded as m contributions, tagged and signed as kind noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Context

from crypto import (
    CONTRIBUTION_NOISE,
    CONTRIBUTION_UPDATE,
    NO_KEY_ID,
    AggregateMac,
    NodeKeys,
    ciphertext_coefficients,
    clip_and_noise,
    clip_update,
    last_modulus,
    noise_std,
    payload_digest,
    sign_update,
)
from crypto.dp.dither import dither
from federation import key_service
from federation.codec import (
    ClientCodec, adaptive_clipping_for, client_weight, make_client_codec, packing_for, uses_error_feedback,
    wire_noise,
)
from federation.config import RunConfig
from federation.timing import PhaseTimer

__all__ = ["Contribution", "Sender", "dither_for", "make_contribution", "make_noise_shares", "node_codec",
           "sender_for", "tag_and_sign"]


@dataclass(frozen=True)
class Sender:
    """Who signs a contribution, and under which key: the run, this node, its identity keys, and
    the round's CKKS key epoch and secret context (epoch 0 and None with he=false)."""

    run_id: int
    node_id: str
    keys: NodeKeys
    epoch: int
    ctx: Any


@dataclass(frozen=True)
class Contribution:
    """One signed update and what the node reports about it."""

    blob: bytes
    """The signed wire bytes (``crypto.SignedUpdate``)."""
    num_values: int
    """Coordinates encoded (the model's, + the count coordinate under adaptive clipping)."""
    clipped: bool
    weight_capped: bool
    saturated: int
    """Coordinates the encoder saturated."""
    residual: np.ndarray | None
    """The error-feedback carry for the next round (None: the packing keeps none)."""


def node_codec(cfg: RunConfig, context: Context, dim: int, epoch: int | None = None) -> tuple[ClientCodec, int, Any]:
    """(client codec, key epoch, secret context or None): CKKS with the node's key (the newest it
    holds, or the one of ``epoch``), or the plaintext codec with he=false."""
    if not cfg.he:
        return make_client_codec(False, dim), 0, None
    ctx, epoch = key_service.secret_context(context, epoch)
    return make_client_codec(True, dim, packing_for(cfg, dim), ctx), epoch, ctx


def sender_for(context: Context, epoch: int, ctx: Any) -> Sender:
    """This node as the signer of a contribution under key ``epoch`` (``ctx``: its secret context)."""
    return Sender(int(context.run_id), str(context.node_id), key_service.node_keys(context), epoch, ctx)


def dither_for(cfg: RunConfig, sender: Sender, rnd: int, kind: int, dim: int) -> np.ndarray | None:
    """This contribution's quantization dither (``crypto.dp.dither``) when the packing uses one."""
    if sender.ctx is None or not packing_for(cfg, dim).dither:
        return None
    return dither(sender.ctx.dither_key, sender.run_id, rnd, sender.epoch, sender.node_id, kind, dim)


def tag_and_sign(cfg: RunConfig, sender: Sender, rnd: int, payload: bytes, kind: int, dim: int) -> bytes:
    """Tag (he=true, ``crypto.binding``) and sign one contribution: its wire bytes."""
    ctx = sender.ctx
    if ctx is None:
        return sign_update(sender.keys, sender.node_id, rnd, payload, sender.epoch, run_id=sender.run_id,
                           key_id=NO_KEY_ID, kind=kind, tag=b"")
    coeffs = ciphertext_coefficients(ctx, packing_for(cfg, dim), payload)
    tag = AggregateMac(ctx.mac_key, last_modulus(ctx)).tag(coeffs, sender.run_id, rnd, sender.epoch, sender.node_id,
                                                           kind, payload_digest(payload))
    return sign_update(sender.keys, sender.node_id, rnd, payload, sender.epoch, run_id=sender.run_id,
                       key_id=ctx.key_id, kind=kind, tag=tag)


def make_contribution(cfg: RunConfig, delta: np.ndarray, *, num_examples: int, clip_norm: float,
                      num_sampled: int, rnd: int, codec: ClientCodec, sender: Sender, residual: np.ndarray | None,
                      rng: np.random.Generator, timer: PhaseTimer | None = None) -> Contribution:
    """The node's contribution for round ``rnd``: steps 1 to 8 of the module docstring.

    Preconditions (the caller's, not checked here):

    * ``delta`` is the node's raw local update (new parameters minus the global ones, as
      ``CacheNode.train_round`` returns it), finite, neither clipped nor noised: this call is
      the only place the update-level mechanism runs (DP-SGD, if on, already ran inside the
      training and does not replace it).
    * ``clip_norm`` is the norm of the version the node reached (``catch_up.catch_up``: the
      run's ``clip-norm``, or the adaptive one), > 0 under dp-mode local/distributed;
      ``num_sampled`` the round's k (the distributed share's √k).
    * ``codec`` and ``sender`` are of the same key epoch (``node_codec``, ``sender_for``);
      ``residual`` is the carry the node kept from its last contribution (``None`` when the
      packing keeps none), of ``num_values`` coordinates.
    * ``rng`` draws all of this contribution's DP noise, in order: the update's noise share
      (step 2), then the count coordinate's (step 3, adaptive clipping only); it must be fresh
      OS entropy in a run (DP noise must not be reproducible from the seed), a seeded
      generator only in tests.

    Time goes to ``timer``'s ``encrypt`` (steps 1 to 6) and ``sign`` (7 and 8) phases."""
    timer = timer if timer is not None else PhaseTimer()
    with timer.phase("encrypt"):
        if cfg.dp_mode in ("local", "distributed"):  # 1. + 2.
            delta, clipped = clip_and_noise(delta, cfg.dp_mode, clip_norm, wire_noise(cfg)[1], num_sampled, rng)
        else:
            delta, clipped = np.asarray(delta, dtype=np.float32), False
            if cfg.dp_mode == "none":  # 1. (no noise: the encoding's range and the nodes' bound on the mean)
                res = clip_update(delta, cfg.clip_norm)
                delta, clipped = np.asarray(res.clipped, dtype=np.float32), res.was_clipped
        if adaptive_clipping_for(cfg) is not None:  # 3. (dp-mode distributed only: never with 1.)
            delta = _with_clipped_count(cfg, delta, clip_norm, clipped, num_sampled, rng)
        weight, capped = client_weight(cfg, num_examples)  # 4.
        dim = int(delta.shape[0])
        if cfg.he:  # 5. + 6.
            carry = residual if uses_error_feedback(cfg) else None
            u = dither_for(cfg, sender, rnd, CONTRIBUTION_UPDATE, dim)
            payload = codec.encode(delta, weight, carry=carry, dither=u)
        else:
            payload = codec.encode(delta, weight)
    with timer.phase("sign"):  # 7. + 8.
        blob = tag_and_sign(cfg, sender, rnd, payload, CONTRIBUTION_UPDATE, dim)
    kept = codec.residual if uses_error_feedback(cfg) else None
    return Contribution(blob, dim, bool(clipped), bool(capped), int(codec.saturated), kept)


def _with_clipped_count(cfg: RunConfig, delta: np.ndarray, clip_norm: float, clipped: bool, num_sampled: int,
                        rng: np.random.Generator) -> np.ndarray:
    """Adaptive clipping under HE (``crypto.dp.adaptive_clipping``): the clipped, noised update
    divided by the round's norm, plus the clipped-count coordinate with its own noise share
    (the same std as every other coordinate's: z_Δ/√n on the normalized sum)."""
    adaptive = adaptive_clipping_for(cfg)
    assert adaptive is not None
    count = adaptive.count_coordinate(unclipped=not clipped)
    sigma = adaptive.update_noise_multiplier
    if sigma > 0:
        count += float(rng.normal(0.0, noise_std(sigma, 1.0, "distributed", num_sampled)))
    return np.concatenate([np.asarray(delta, dtype=np.float64) / clip_norm, [count]])  # float64: see clip_and_noise


def make_noise_shares(cfg: RunConfig, *, rnd: int, shares: int, sampled: int, dim: int, codec: ClientCodec,
                      sender: Sender, rng: np.random.Generator) -> bytes:
    """``shares`` noise shares for sampled nodes that left round ``rnd`` (he=true, dp-mode
    distributed) as one signed, tagged contribution of kind noise. ``rng``: fresh OS entropy in
    a run (``crypto.dp.privacy.gaussian_noise``)."""
    clip, sigma = wire_noise(cfg)  # (1, σ_Δ) under adaptive clipping: updates travel as Δ/C
    std = noise_std(sigma, clip, "distributed", sampled) * math.sqrt(shares)
    # m shares as m contributions (range ±m·R, like CkksAggregator.add_noise): one of range R
    # would saturate the sum of m shares far more often than crypto.dp.saturation allows for
    payload = codec.encode(np.zeros(dim, dtype=np.float32), 0.0, noise=rng.normal(0.0, std, dim),
                           dither=dither_for(cfg, sender, rnd, CONTRIBUTION_NOISE, dim), contributions=shares)
    return tag_and_sign(cfg, sender, rnd, payload, CONTRIBUTION_NOISE, dim)
