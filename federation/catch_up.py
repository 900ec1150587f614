"""``catch_up``: a node applies the aggregates it is missing before it trains or evaluates, in
one order: manifest checks -> MAC -> decrypt -> the public bound on the mean -> write-back
(he=false: decode -> the header's count and weight sum -> the same bound -> write-back).

Any aggregate the node will not apply gets the one answer ``AggregateRejected`` (no detail, no
numbers: what leaves a node must not depend on the secret key's decryption noise), except a
replay, refused by a public check before anything is decrypted: an aggregate made in a round at
or before the one that made the node's version, or under an older key epoch, is
``ReplayedAggregate`` (a text without numbers). The node's record of what it applied lives in its
node directory (``federation.applied_log``), so a restart does not reopen old rounds. Under
adaptive clipping the node also rebuilds the clip norm each aggregate implies (``clip_norms``)
and under Poisson sampling rescales the mean to the run's fixed denominator
(``fixed_denominator_scale``).
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Context

from crypto import CONTRIBUTION_UPDATE, AggregateMac, Manifest, ciphertext_info, last_modulus
from crypto.dp.dither import dither_total
from federation import key_service, messages, protocol
from federation.applied_log import AppliedLog, AppliedRound
from federation.codec import (
    PlainClientCodec, adaptive_clipping_for, mean_bound_for, packing_for, plain_update_count, wire_dim,
)
from federation.config import RunConfig
from federation.contribution import node_codec
from federation.node_store import NodeStore
from federation.sampling import poisson_mean_scale
from federation.timing import PhaseTimer
from node.cache_node import CacheNode

__all__ = ["AggregateRejected", "REPLAYED", "ReplayedAggregate", "catch_up", "clip_norms", "fixed_denominator_scale"]

_log = logging.getLogger("fedkv.catch_up")

REPLAYED = ("replayed aggregate: made in a round this node applied already, or under an older key epoch; "
            + protocol.AGGREGATE_REJECTED)
"""``ReplayedAggregate``'s text: no numbers, and ends as every refusal does (the server counts it
as one: ``OpaqueFedAvg.discard_if_refused``)."""


class AggregateRejected(RuntimeError):
    """The one answer a node gives for any aggregate it will not apply (no detail, no numbers:
    what leaves a node must not depend on the secret key's decryption noise)."""

    def __init__(self, text: str = protocol.AGGREGATE_REJECTED) -> None:
        super().__init__(text)


class ReplayedAggregate(AggregateRejected):
    """An aggregate of a round at or before the one that made the node's version, or of an older
    key epoch. Public (the manifest's round and epoch against the node's record, before any key
    is loaded), so it may say what it is; the numbers go to the node's own log only."""

    def __init__(self) -> None:
        super().__init__(REPLAYED)


def catch_up(cfg: RunConfig, node: CacheNode, req: messages.RoundRequest, context: Context,
             timer: PhaseTimer) -> float:
    """Apply every aggregate newer than the node's version (timed as key / decrypt / writeback);
    return the clip norm of the version reached (``clip-norm``, or the adaptive one)."""
    target, committed = req.target_version, node.version
    dim = wire_dim(cfg, node.layout.size)
    norms = clip_norms(cfg, context, node.version)
    known = len(norms)
    applied = AppliedLog.for_context(context) if cfg.he else None
    last = applied.at(committed) if applied is not None else None
    for version, blob, manifest in req.aggregates():
        if version <= node.version:
            continue  # already applied (e.g. the server did not see our last reply)
        mean, made = _open(cfg, context, dim, blob, manifest, timer, last, version)
        scale = fixed_denominator_scale(cfg, context, dim, blob, manifest)
        mean = _adapt(cfg, norms, mean, scale, manifest) if norms else mean * scale
        with timer.phase("writeback"):
            node.apply_mean_update(mean, version)
            if applied is not None:  # before the commit: a restart must not reopen this round
                last = AppliedRound(version, *made)
                applied.note(last, committed)
    if node.version != target:
        raise RuntimeError(
            f"node is at global v{node.version} but the server expects v{target}; "
            "aggregates are missing (server will resend the full history)"
        )
    if not norms:
        return cfg.clip_norm
    if len(norms) > known:  # a restored node's longer saved history is rebuilt identically
        NodeStore.for_context(context).save_clip_norms(norms)
    return norms[-1]


def clip_norms(cfg: RunConfig, context: Context, version: int) -> list[float]:
    """Adaptive clipping: the node's norm history up to ``version`` (``[clip-norm]`` at v0); []
    with a fixed norm. A history shorter than the node's version cannot be rebuilt (the norm is
    a function of every aggregate since v0), so that raises."""
    if adaptive_clipping_for(cfg) is None:
        return []
    norms = NodeStore.for_context(context).load_clip_norms() or [cfg.clip_norm]
    if len(norms) <= version:
        raise RuntimeError(f"the node's adaptive clip-norm history ends at v{len(norms) - 1} but the node is at "
                           f"v{version}; it cannot rebuild the norm (rejoin the run from a fresh node directory)")
    return norms[: version + 1]


def _adapt(cfg: RunConfig, norms: list[float], mean: np.ndarray, scale: float, manifest: bytes) -> np.ndarray:
    """Adaptive clipping: the model's mean update from an aggregate of [Δ/C, count] (``scale``
    turns the realized-count mean into the run's denominator), and the next norm appended to
    ``norms`` from the noisy unclipped share."""
    adaptive = adaptive_clipping_for(cfg)
    assert adaptive is not None
    updates = sum(1 for e in Manifest.from_bytes(manifest).entries if e.kind == CONTRIBUTION_UPDATE)
    clip = norms[-1]
    fraction = adaptive.unclipped_fraction(float(mean[-1]) * updates, updates, updates / scale)
    norms.append(adaptive.next_clip_norm(clip, fraction))
    return (mean[:-1].astype(np.float64) * (scale * clip)).astype(np.float32)


def fixed_denominator_scale(cfg: RunConfig, context: Context, dim: int, blob: bytes, manifest: bytes) -> float:
    """client-sampling=poisson: the mean over the realised count becomes sum / (q·N), with N =
    num-partitions (public), as DP-FedAvg's accounting assumes; 1 for the fixed sampler. Under
    DP every update has weight 1, so the realised count is the number of update summands."""
    if cfg.client_sampling != "poisson":
        return 1.0
    if cfg.he:
        n_updates = sum(1 for e in Manifest.from_bytes(manifest).entries if e.kind == CONTRIBUTION_UPDATE)
    else:
        n_updates = plain_update_count(blob, dim)
    population = int(context.node_config["num-partitions"])
    if n_updates > population:  # no honest round samples a node twice; the count scales the mean
        raise AggregateRejected()
    return poisson_mean_scale(n_updates, cfg.fraction_train, population)


def _replayed(m: Manifest, last: AppliedRound | None, version: int) -> bool:
    """Made in a round at or before ``last`` (the aggregate that made the node's version), or
    under an older key epoch: logged here, with its numbers (public), on the node only."""
    if last is None or (m.round > last.round and m.epoch >= last.epoch):
        return False
    _log.warning("refused the aggregate of round %d (key epoch %d) offered as v%d: v%d came from round %d "
                 "(key epoch %d); a replayed aggregate is never applied", m.round, m.epoch, version,
                 last.version, last.round, last.epoch)
    return True


def _open(cfg: RunConfig, context: Context, dim: int, blob: bytes, manifest: bytes,
          timer: PhaseTimer, last: AppliedRound | None, version: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Check an aggregate against its manifest (he=true) and decode it; AggregateRejected otherwise
    (``ReplayedAggregate`` for a replay, ``_replayed``). Returns (mean update, (round, key epoch)
    the aggregate was made in).

    Every check that can fail before decryption is public (run, a round later and a key epoch no
    older than the last applied one's, distinct summands and digests, summand count, the MAC);
    after it, a failure can only come from a summand a node tagged, and it gets the same answer.
    The MAC is checked on the very ciphertexts that are then decrypted (loaded once). After
    decryption the mean must respect the public bound (``crypto.aggregate_bound``,
    ``codec.mean_bound_for``): its header the manifest's counts, its norm at most C plus the
    noise and rounding an honest round has with probability 1 - 1e-9. A key holder that
    encrypted, tagged and signed an update beyond its clipping ball (issue 20) is refused there,
    with the same answer: in mode packed the check reads exact integer sums, nothing of the
    decryption noise."""
    try:
        if not cfg.he:
            return _open_plain(cfg, context, dim, blob, timer), (0, 0)
        m = Manifest.from_bytes(manifest)
        updates = [e for e in m.entries if e.kind == CONTRIBUTION_UPDATE]
        distinct = len({(e.node_id, e.kind) for e in m.entries}) == len({e.digest for e in m.entries}) == len(m.entries)
        if m.run_id != int(context.run_id) or m.round < 1 or not distinct or len(updates) < _floor(cfg, context):
            raise AggregateRejected()
        if _replayed(m, last, version):
            raise ReplayedAggregate()
        with timer.phase("key"):
            codec, _, ctx = node_codec(cfg, context, dim, m.epoch)
            mac = AggregateMac(ctx.mac_key, last_modulus(ctx))
        with timer.phase("decrypt"):
            if ciphertext_info(blob)["n_updates"] != len(m.entries):
                raise AggregateRejected()
            total = None
            if packing_for(cfg, dim).dither:
                total = dither_total(ctx.dither_key, m.run_id, m.round, m.epoch,
                                     [(e.node_id, e.kind) for e in m.entries], dim)
            result = codec.decode(blob, accept=lambda coeffs: mac.check(coeffs, m), dither_total=total)
            bound = mean_bound_for(cfg, dim, ctx.params.real_scale_bits)
            if not bound.admits(result.mean, len(updates), len(m.entries),
                                result.weight_sum / codec.packing.max_weight, result.contributions):
                raise AggregateRejected()  # beyond the public bound: a key holder's crafted summand
            return result.mean.astype(np.float32), (m.round, m.epoch)
    except ReplayedAggregate:
        raise
    except Exception:  # noqa: BLE001 - one answer for every reason, chained to nothing
        raise AggregateRejected() from None


def _floor(cfg: RunConfig, context: Context) -> int:
    """The fewest updates an aggregate may hold: the run's min-clients or the node policy's."""
    return max(cfg.min_clients, key_service.node_policy(context).min_clients)


def _open_plain(cfg: RunConfig, context: Context, dim: int, blob: bytes, timer: PhaseTimer) -> np.ndarray:
    """he=false: the plaintext mean, held to the same public bound as a decrypted one
    (``codec.mean_bound_for``: C, the run's noise, no rounding). The server wrote the header
    (weight sum, update count) as well as the sum, so both are checked: at least min-clients
    updates, a weight sum an honest round of that count has, a finite mean of norm at most B.
    Any failure raises; the caller turns it into the one ``AggregateRejected``."""
    with timer.phase("decrypt"):
        result = PlainClientCodec(dim).decode(blob)
        bound = mean_bound_for(cfg, dim)
        n = result.count
        if n < _floor(cfg, context) or not bound.admits(result.mean, n, n, result.weight_sum / bound.max_weight, n):
            raise AggregateRejected()  # beyond what an honest round makes: the server's, or an unclipped update
        return result.mean.astype(np.float32)
