"""fedkv ClientApp: every Flower node hosts one ``CacheNode`` across rounds.

Protocols, routed by message type:

* ``query.fedkv_enroll`` / ``query.fedkv_keygen`` / ``query.fedkv_provision``: key provisioning
  (``federation/key_service.py``): the node's identity keys and CKKS keys live in its kit or
  node-local directory (``federation/node_store.py``), never in ``context.state``; one node
  makes the CKKS key (or the kits hold it) and the server only relays wrapped bundles.
* ``query.fedkv_noise``: distributed-DP noise shares for nodes that left a round (he=true).
* ``train.fedkv`` / ``evaluate.fedkv`` (the product path): the node first applies the
  aggregates it is missing (MAC -> decrypt -> the public bound on the mean -> write back; any
  failure is the one ``AggregateRejected``), then trains, clips, encrypts, signs
  and replies with the signed bytes, or evaluates on its held-out share. The server never
  sends or receives plaintext weights on this path. Train and noise requests are answered
  once per round (``NodeStore.answer_once``): a repeat gets the first reply's bytes, never a
  second MAC tag (``crypto.binding``).
* ``train`` / ``evaluate`` (Flower's array protocol): used by the ``flower-central``
  baseline (Flower's FedAvg wrapped in DifferentialPrivacyClientSideFixedClipping);
  ``fixedclipping_mod`` is attached to ``train`` only (on ``ClientApp(mods=...)`` it
  would break the evaluate replies).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod

from crypto import (
    CONTRIBUTION_NOISE,
    CONTRIBUTION_UPDATE,
    AggregateMac,
    Manifest,
    ciphertext_coefficients,
    ciphertext_info,
    clip_update,
    last_modulus,
    noise_std,
    payload_digest,
)
from crypto.dp.dither import dither, dither_total
from federation import node_host, protocol, key_service
from federation.codec import (
    ClientCodec, adaptive_clipping_for, client_weight, make_client_codec, mean_bound_for, packing_for,
    plain_update_count, uses_error_feedback, wire_dim, wire_noise,
)
from federation.config import RunConfig
from federation.logs import configure_logging
from federation.node_store import NodeStore
from federation.timing import PhaseTimer
from federation.sampling import poisson_mean_scale
from node.cache_node import CacheNode, DpConfig
from node.workload_pass import ServeReport
from node.workload import WorkloadConfig

configure_logging()  # each log line once (Opacus adds a root handler on import)
app = ClientApp()

APPLIED_KEY = "fedkv.applied"
"""context.state: the round of the last aggregate applied (public): an aggregate must come from
a later round, so a server cannot make a node apply the same round's sum twice."""


class AggregateRejected(RuntimeError):
    """The one answer a node gives for any aggregate it will not apply (no detail, no numbers:
    what leaves a node must not depend on the secret key's decryption noise)."""

    def __init__(self) -> None:
        super().__init__(protocol.AGGREGATE_REJECTED)


@app.query("fedkv_enroll")
def enroll(msg: Message, context: Context) -> Message:
    """Check the run against this node's policy; return its public identity keys."""
    return key_service.handle_enroll(msg, context)


@app.query("fedkv_keygen")
def keygen(msg: Message, context: Context) -> Message:
    """Make (or re-wrap) the CKKS key for the listed peers: this node is the key's origin."""
    return key_service.handle_keygen(msg, context)


@app.query("fedkv_provision")
def provision(msg: Message, context: Context) -> Message:
    """Verify a peer-wrapped CKKS key, keep it in the node's own files; acknowledge its key id."""
    return key_service.handle_provision(msg, context)


def _run_config(context: Context) -> RunConfig:
    """The run config, once it passed this node's policy (a run cannot lower the node's floors)."""
    cfg = RunConfig.from_run_config(context.run_config)
    key_service.node_policy(context).check(cfg)
    return cfg


def _codec(cfg: RunConfig, context: Context, dim: int, epoch: int | None = None) -> tuple[ClientCodec, int, Any]:
    """(client codec, key epoch, secret context or None): CKKS with the node's key, or plaintext."""
    if not cfg.he:
        return make_client_codec(False, dim), 0, None
    ctx, epoch = key_service.secret_context(context, epoch)
    return make_client_codec(True, dim, packing_for(cfg, dim), ctx), epoch, ctx


def _signed(cfg: RunConfig, context: Context, rnd: int, payload: bytes, epoch: int, ctx: Any, kind: int,
            dim: int) -> bytes:
    """Tag (he=true, ``crypto.binding``) and sign one contribution."""
    keys = key_service.node_keys(context)
    if ctx is None:
        return key_service.sign(context, keys, rnd, payload, epoch, kind=kind)
    coeffs = ciphertext_coefficients(ctx, packing_for(cfg, dim), payload)
    tag = AggregateMac(ctx.mac_key, last_modulus(ctx)).tag(coeffs, int(context.run_id), rnd, epoch, str(context.node_id),
                                                           kind, payload_digest(payload))
    return key_service.sign(context, keys, rnd, payload, epoch, key_id=ctx.key_id, kind=kind, tag=tag)


@app.train("fedkv")
@node_host.releasing
def train(msg: Message, context: Context) -> Message:
    """Catch up to the global model, train, clip/noise, encode, tag, sign, reply with bytes.

    Once per round (``NodeStore.answer_once``): a repeated request for a round gets the reply
    kept from the first, byte for byte (no retraining, no second MAC tag: ``crypto.binding``).

    Every phase is timed (``*-s`` reply metrics, ``protocol.NODE_TRAIN_PHASES``) and
    ``handler-s`` is the whole handler, so the server can show what the phases leave out."""
    timer = PhaseTimer()
    cfg = _run_config(context)
    key_service.node_keys(context)  # raises if this node was never enrolled
    server_round = int(msg.content[protocol.CONFIG]["server-round"])
    with NodeStore.for_context(context).answer_once(server_round, CONTRIBUTION_UPDATE) as slot:
        if slot.stored is None:
            blob, metrics = _train(cfg, msg, context, server_round, timer)
            slot.keep(protocol.pack_blobs([blob, json.dumps(metrics).encode()]))
        assert slot.stored is not None
        blob, metrics_json = protocol.unpack_blobs(slot.stored, limit=2)
    content = RecordDict(
        {
            protocol.UPDATE: ArrayRecord({"update": protocol.bytes_to_array(blob)}),
            protocol.METRICS: MetricRecord(json.loads(metrics_json)),
        }
    )
    return Message(content, reply_to=msg)


def _train(cfg: RunConfig, msg: Message, context: Context, server_round: int,
           timer: PhaseTimer) -> tuple[bytes, dict[str, Any]]:
    """The train handler's work: (signed update bytes, reply metrics)."""
    with timer.phase("restore"):
        node, source = node_host.get_node(context)
    try:
        clip_norm = _catch_up(cfg, node, msg, context, timer)
        dim = wire_dim(cfg, node.layout.size)
        with timer.phase("key"):
            codec, epoch, ctx = _codec(cfg, context, dim)
        num_sampled = int(msg.content[protocol.CONFIG]["num-sampled"])
        dp = DpConfig(
            mode=cfg.dp_mode,
            clip_norm=clip_norm,
            noise_multiplier=wire_noise(cfg)[1],
            num_sampled=num_sampled,
            dp_sgd=cfg.dp_sgd,
            target_delta=cfg.target_delta,
        )
        # Fresh OS entropy on purpose: DP noise must not be reproducible from the seed.
        out = node.train_round(cfg.local_epochs, cfg.lr, dp, np.random.default_rng())
        timer.add("train", out.train_s)
        with timer.phase("encrypt"):
            delta, clipped = out.delta, bool(out.clipped)
            if adaptive_clipping_for(cfg) is not None:
                delta = _with_clipped_count(cfg, delta, clip_norm, clipped, num_sampled)
            if cfg.he and cfg.dp_mode == "none":
                # Under DP the node clips (before its noise); under HE without DP we clip here:
                # the CKKS encoding needs a bounded range (federation.codec.packing_for).
                res = clip_update(delta, cfg.clip_norm)
                delta, clipped = np.asarray(res.clipped, dtype=np.float32), clipped or res.was_clipped
            weight, capped = client_weight(cfg, out.num_examples)
            feedback = uses_error_feedback(cfg)
            store = NodeStore.for_context(context)
            carry = store.load_residual(int(delta.shape[0])) if feedback else None
            u = _dither(cfg, context, ctx, server_round, epoch, CONTRIBUTION_UPDATE, int(delta.shape[0]))
            payload = codec.encode(delta, weight, carry=carry, dither=u) if cfg.he else codec.encode(delta, weight)
        with timer.phase("sign"):
            blob = _signed(cfg, context, server_round, payload, epoch, ctx, CONTRIBUTION_UPDATE, dim)
        with timer.phase("save"):
            node_host.save_node(context, node)
            if feedback:
                store.save_residual(codec.residual)
    except Exception:
        node_host.discard(context)  # the cached object may be half-updated
        raise
    metrics: dict[str, Any] = {
        "num-examples": out.num_examples,
        "upload-bytes": len(blob),
        "num-values": int(delta.shape[0]),
        "weight-capped": int(capped),
        **_phase_metrics(timer, protocol.NODE_TRAIN_PHASES),
        "version": node.version,
        "node-source": source,
        "kv-on-disk": node_host.kv_on_disk(node, source),
        "pid": node_host.pid(),
    }
    if cfg.dp_sgd:
        metrics["epsilon-sample"] = out.epsilon
    if cfg.dp_mode not in ("local", "distributed"):  # under DP these are private, outside the accounting
        metrics.update({"train-loss": out.loss, "clipped": int(clipped), "delta-norm": out.delta_norm,
                        "saturated": int(codec.saturated)})
    return blob, metrics


def _dither(cfg: RunConfig, context: Context, ctx: Any, rnd: int, epoch: int, kind: int, dim: int) -> np.ndarray | None:
    """This contribution's quantization dither (``crypto.dither``) when the packing uses one."""
    if ctx is None or not packing_for(cfg, dim).dither:
        return None
    return dither(ctx.dither_key, int(context.run_id), rnd, epoch, str(context.node_id), kind, dim)


def _with_clipped_count(cfg: RunConfig, delta: np.ndarray, clip_norm: float, clipped: bool,
                        num_sampled: int) -> np.ndarray:
    """Adaptive clipping under HE (``crypto.adaptive_clipping``): the clipped, noised update
    divided by the round's norm, plus the clipped-count coordinate with its own noise share
    (the same std as every other coordinate's: z_Δ/√n on the normalized sum)."""
    adaptive = adaptive_clipping_for(cfg)
    assert adaptive is not None
    count = adaptive.count_coordinate(unclipped=not clipped)
    sigma = adaptive.update_noise_multiplier
    if sigma > 0:  # fresh OS entropy, like the update's noise
        count += float(np.random.default_rng().normal(0.0, noise_std(sigma, 1.0, "distributed", num_sampled)))
    return np.concatenate([np.asarray(delta, dtype=np.float64) / clip_norm, [count]])  # float64: see TrainOutcome


def _phase_metrics(timer: PhaseTimer, phases: tuple[str, ...]) -> dict[str, float]:
    """``<phase>-s`` for every phase (0 when it did not happen) plus ``handler-s`` (the whole
    handler up to here; what the phases leave out is ``handler-s`` minus their sum)."""
    out = {f"{p}-s": float(timer.seconds.get(p, 0.0)) for p in phases}
    out["handler-s"] = timer.total
    return out


@app.query("fedkv_noise")
@node_host.releasing
def noise(msg: Message, context: Context) -> Message:
    """Distributed DP under HE: noise shares for sampled nodes that left the round (tagged, signed;
    once per round, a repeated request gets the same bytes: ``NodeStore.answer_once``)."""
    cfg = _run_config(context)
    if not cfg.he or cfg.dp_mode != "distributed":
        raise RuntimeError("noise shares are made only with he=true and dp-mode=distributed")
    req = msg.content[protocol.CONFIG]
    rnd, shares, sampled = int(req["server-round"]), int(req["shares"]), int(req["num-sampled"])
    if not (1 <= shares < sampled <= cfg.max_clients):
        raise RuntimeError("noise request out of range")
    with NodeStore.for_context(context).answer_once(rnd, CONTRIBUTION_NOISE) as slot:  # once per round, as train
        if slot.stored is None:
            slot.keep(_noise_shares(cfg, context, rnd, shares, sampled))
        blob = slot.stored
    return Message(RecordDict({protocol.UPDATE: ArrayRecord({"update": protocol.bytes_to_array(blob)})}), reply_to=msg)


def _noise_shares(cfg: RunConfig, context: Context, rnd: int, shares: int, sampled: int) -> bytes:
    """``shares`` noise shares as one signed, tagged contribution of kind noise."""
    node, _ = node_host.get_node(context)
    dim = wire_dim(cfg, node.layout.size)
    codec, epoch, ctx = _codec(cfg, context, dim)
    clip, sigma = wire_noise(cfg)  # (1, σ_Δ) under adaptive clipping: updates travel as Δ/C
    std = noise_std(sigma, clip, "distributed", sampled) * math.sqrt(shares)
    rng = np.random.default_rng()  # fresh OS entropy (crypto.privacy.gaussian_noise)
    # m shares as m contributions (range ±m·R, like CkksAggregator.add_noise): one of range R
    # would saturate the sum of m shares far more often than crypto.saturation allows for
    payload = codec.encode(np.zeros(dim, dtype=np.float32), 0.0, noise=rng.normal(0.0, std, dim),
                           dither=_dither(cfg, context, ctx, rnd, epoch, CONTRIBUTION_NOISE, dim), contributions=shares)
    return _signed(cfg, context, rnd, payload, epoch, ctx, CONTRIBUTION_NOISE, dim)


@app.evaluate("fedkv")
@node_host.releasing
def evaluate(msg: Message, context: Context) -> Message:
    """Catch up to the newest aggregate, evaluate on the local held-out share, then serve a
    chat turn through the cache (the K/V the next process finds on disk)."""
    timer = PhaseTimer()
    cfg = _run_config(context)
    with timer.phase("restore"):
        node, source = node_host.get_node(context)
    try:
        _catch_up(cfg, node, msg, context, timer)
        with timer.phase("eval"):
            loss, acc, n = node.evaluate()
        with timer.phase("serve"):  # chat sessions through the cache (their blocks persist)
            serving = node.serve_between_rounds(
                WorkloadConfig(sessions=cfg.serve_sessions), seed=cfg.seed + 7919 * node.version)
        with timer.phase("save"):
            node_host.save_node(context, node)
    except Exception:
        node_host.discard(context)
        raise
    metrics = {
        "num-examples": n,
        "eval-loss": loss,
        "eval-metric": acc,
        **_phase_metrics(timer, protocol.NODE_EVAL_PHASES),
        "version": node.version,
        "node-source": source,
        "kv-on-disk": node_host.kv_on_disk(node, source),
        "pid": node_host.pid(),
        **serve_metrics(serving),
    }
    return Message(RecordDict({protocol.METRICS: MetricRecord(metrics)}), reply_to=msg)


def serve_metrics(r: ServeReport | None) -> dict[str, int | float]:
    """The serving pass as ``protocol.SERVE_COUNTS``/``SERVE_AMOUNTS`` (zeros: none served)."""
    if r is None:
        return {**dict.fromkeys(protocol.SERVE_COUNTS, 0), **dict.fromkeys(protocol.SERVE_AMOUNTS, 0.0)}
    return {
        "serve-sessions": r.sessions, "serve-turns": r.turns,
        "serve-prompt-tokens": r.prompt_tokens, "serve-prefix-hit-tokens": r.prefix_hit_tokens,
        "serve-lookups": r.lookups, "serve-hit-hot": r.tier_hits["hot"],
        "serve-hit-warm": r.tier_hits["warm"], "serve-hit-cold": r.tier_hits["cold"],
        "serve-decode-tokens": r.decode_tokens, "serve-recomputed": r.recomputed_tokens,
        "serve-invalidated": r.invalidated_blocks, "serve-stale-served": r.stale_tokens_served,
        "serve-scored": r.scored, "serve-busy-s": r.seconds, "serve-nll": r.nll,
        "serve-nll-fresh": r.nll_fresh, "serve-trace-shaped": int(r.shape == "mooncake"),
    }


def _catch_up(cfg: RunConfig, node: CacheNode, msg: Message, context: Context, timer: PhaseTimer) -> float:
    """Apply every aggregate newer than the node's version (timed as key / decrypt / writeback);
    return the clip norm of the version reached (``clip-norm``, or the adaptive one)."""
    target = int(msg.content[protocol.CONFIG]["target-version"])
    dim = wire_dim(cfg, node.layout.size)
    norms = _clip_norms(cfg, context, node.version)
    known = len(norms)
    for version, blob, manifest in protocol.unpack_aggregates(msg.content.array_records.get(protocol.AGGREGATES)):
        if version <= node.version:
            continue  # already applied (e.g. the server did not see our last reply)
        mean, made_in = _open(cfg, context, dim, blob, manifest, timer)
        scale = _fixed_denominator_scale(cfg, context, dim, blob, manifest)
        mean = _adapt(cfg, norms, mean, scale, manifest) if norms else mean * scale
        with timer.phase("writeback"):
            node.apply_mean_update(mean, version)
        context.state[APPLIED_KEY] = ConfigRecord({"round": made_in})
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


def _clip_norms(cfg: RunConfig, context: Context, version: int) -> list[float]:
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


def _fixed_denominator_scale(cfg: RunConfig, context: Context, dim: int, blob: bytes, manifest: bytes) -> float:
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
    return poisson_mean_scale(n_updates, cfg.fraction_train, population)


def _open(cfg: RunConfig, context: Context, dim: int, blob: bytes, manifest: bytes,
          timer: PhaseTimer) -> tuple[np.ndarray, int]:
    """Check an aggregate against its manifest (he=true) and decode it; AggregateRejected otherwise.
    Returns (mean update, round the aggregate was made in).

    Every check that can fail before decryption is public (run, a round later than the last
    applied one, distinct summands and digests, summand count, the MAC); after it, a failure can
    only come from a summand a node tagged, and it gets the same answer. The MAC is checked on the
    very ciphertexts that are then decrypted (loaded once). After decryption the mean must respect
    the public bound (``crypto.aggregate_bound``, ``codec.mean_bound_for``): its header the
    manifest's counts, its norm at most C plus the noise and rounding an honest round has with
    probability 1 - 1e-9. A key holder that encrypted, tagged and signed an update beyond its
    clipping ball (issue 20) is refused there, with the same answer: in mode packed the check
    reads exact integer sums, nothing of the decryption noise."""
    try:
        if not cfg.he:
            with timer.phase("decrypt"):
                return make_client_codec(False, dim).decode_mean(blob), 0
        m = Manifest.from_bytes(manifest)
        updates = [e for e in m.entries if e.kind == CONTRIBUTION_UPDATE]
        distinct = len({(e.node_id, e.kind) for e in m.entries}) == len({e.digest for e in m.entries}) == len(m.entries)
        floor = max(cfg.min_clients, key_service.node_policy(context).min_clients)
        applied = context.state.config_records.get(APPLIED_KEY)
        last = int(applied["round"]) if applied is not None else 0
        if m.run_id != int(context.run_id) or m.round <= last or not distinct or len(updates) < floor:
            raise AggregateRejected()
        with timer.phase("key"):
            codec, _, ctx = _codec(cfg, context, dim, m.epoch)
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
            return result.mean.astype(np.float32), m.round
    except Exception:  # noqa: BLE001 - one answer for every reason, chained to nothing
        raise AggregateRejected() from None


# --- Flower's array protocol: the flower-central DP baseline --------------------------


def clipping_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's fixed or adaptive clipping mod, as the run's ``adaptive-clipping`` says (one train
    handler serves both: mods are bound per handler)."""
    adaptive = RunConfig.from_run_config(context.run_config).adaptive_clipping
    return (adaptiveclipping_mod if adaptive else fixedclipping_mod)(msg, context, call_next)


@app.train(mods=[clipping_mod])
@node_host.releasing
def train_arrays(msg: Message, context: Context) -> Message:
    """Load the global weights, train, return weights (Flower's mod clips the update)."""
    cfg = RunConfig.from_run_config(context.run_config)
    node, source = node_host.get_node(context)
    arrays = msg.content.array_records["arrays"]
    node.set_weights(arrays.to_torch_state_dict())
    before = np.concatenate([a.ravel() for a in arrays.to_numpy_ndarrays()])
    server_round = int(msg.content.config_records["config"]["server-round"])
    loss, n, train_s = node.train_in_place(cfg.local_epochs, cfg.lr, server_round)
    reply_arrays = ArrayRecord(node.get_weights())
    after = np.concatenate([a.ravel() for a in reply_arrays.to_numpy_ndarrays()])
    norm = float(np.linalg.norm(after - before))
    clip = float(msg.content.config_records["config"].get("clipping_norm", 0.0))
    metrics = {
        "num-examples": n,
        "unit-weight": 1,  # flower_central.UNIT_WEIGHT: FedAvg with uniform weights
        "train-loss": loss,
        "train-s": train_s,
        "upload-bytes": sum(len(a.data) for a in reply_arrays.values()),
        "clipped": int(clip > 0 and norm > clip),
        "delta-norm": norm,
        "node-source": source,
        "pid": node_host.pid(),
    }
    content = RecordDict({"arrays": reply_arrays, "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
@node_host.releasing
def evaluate_arrays(msg: Message, context: Context) -> Message:
    """Evaluate Flower-sent global weights on the local held-out share."""
    node, _ = node_host.get_node(context)
    node.set_weights(msg.content.array_records["arrays"].to_torch_state_dict())
    loss, acc, n = node.evaluate()
    # unit-weight: Flower's FedAvg checks its weight key in evaluate replies too
    metrics = MetricRecord({"num-examples": n, "unit-weight": 1, "eval-loss": loss, "eval-metric": acc})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
