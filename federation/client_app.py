"""fedkv ClientApp: every Flower node hosts one ``CacheNode`` across rounds.

Protocols, routed by message type:

* ``query.fedkv_enroll`` / ``query.fedkv_provision``: key provisioning
  (``federation/provisioning.py``): the node makes its X25519/Ed25519 keys once, keeps them
  in ``context.state``, and (he=true) receives the CKKS secret context wrapped for it.
* ``train.fedkv`` / ``evaluate.fedkv`` (the product path): the node first applies the
  aggregates it is missing (decrypt -> write back), then trains, clips, encrypts, signs
  and replies with the signed bytes, or evaluates on its held-out share. The server never
  sends or receives plaintext weights on this path.
* ``train`` / ``evaluate`` (Flower's array protocol): used by the ``flower-central``
  baseline (Flower's FedAvg wrapped in DifferentialPrivacyClientSideFixedClipping);
  ``fixedclipping_mod`` is attached to ``train`` only (on ``ClientApp(mods=...)`` it
  would break the evaluate replies).
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from federation import node_host, protocol, provisioning
from federation.codec import ClientCodec, client_weight, make_client_codec, packing_for
from federation.config import RunConfig
from node.cache_node import CacheNode, DpConfig

app = ClientApp()


@app.query("fedkv_enroll")
def enroll(msg: Message, context: Context) -> Message:
    """Return this node's public keys (generated on first contact, kept in context.state)."""
    return provisioning.handle_enroll(msg, context)


@app.query("fedkv_provision")
def provision(msg: Message, context: Context) -> Message:
    """Verify and keep the dealer's wrapped CKKS context; acknowledge its key id."""
    return provisioning.handle_provision(msg, context)


def _codec(cfg: RunConfig, context: Context, dim: int) -> tuple[ClientCodec, int]:
    """(client codec, key epoch): CKKS with the node's unwrapped secret context, or plaintext."""
    if not cfg.he:
        return make_client_codec(False, dim), 0
    ctx, epoch = provisioning.secret_context(context)
    return make_client_codec(True, dim, packing_for(cfg, dim), ctx), epoch


@app.train("fedkv")
def train(msg: Message, context: Context) -> Message:
    """Catch up to the global model, train, clip/noise, encode, sign, reply with bytes."""
    cfg = RunConfig.from_run_config(context.run_config)
    keys = provisioning.node_keys(context)  # raises if this node was never enrolled
    node, source = node_host.get_node(context)
    try:
        server_round = int(msg.content[protocol.CONFIG]["server-round"])
        codec, epoch = _codec(cfg, context, node.layout.size)
        decrypt_s, writeback_s = _catch_up(node, msg, codec)
        dp = DpConfig(
            mode=cfg.dp_mode,
            clip_norm=cfg.clip_norm,
            noise_multiplier=cfg.noise_multiplier,
            num_sampled=int(msg.content[protocol.CONFIG]["num-sampled"]),
            dp_sgd=cfg.dp_sgd,
            target_delta=cfg.target_delta,
        )
        # Fresh OS entropy on purpose: DP noise must not be reproducible from the seed.
        out = node.train_round(cfg.local_epochs, cfg.lr, dp, np.random.default_rng())
        delta, clipped = out.delta, bool(out.clipped)
        if cfg.he and cfg.dp_mode == "none":
            # Under DP the node clips (before its noise); under HE without DP we clip here:
            # the CKKS encoding needs a bounded range (federation.codec.packing_for).
            from crypto import clip_update

            res = clip_update(delta, cfg.clip_norm)
            delta, clipped = np.asarray(res.clipped, dtype=np.float32), clipped or res.was_clipped
        weight, capped = client_weight(cfg, out.num_examples)
        t0 = time.perf_counter()
        payload = codec.encode(delta, weight)
        encrypt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        blob = provisioning.sign(context, keys, server_round, payload, epoch)
        sign_s = time.perf_counter() - t0
        node_host.save_node(context, node)
    except Exception:
        node_host.discard(context)  # the cached object may be half-updated
        raise
    metrics = {
        "num-examples": out.num_examples,
        "train-loss": out.loss,
        "upload-bytes": len(blob),
        "clipped": int(clipped),
        "delta-norm": out.delta_norm,
        "epsilon-sample": out.epsilon,
        "num-values": int(delta.shape[0]),
        "saturated": int(codec.saturated),
        "weight-capped": int(capped),
        "train-s": out.train_s,
        "encrypt-s": encrypt_s,
        "sign-s": sign_s,
        "decrypt-s": decrypt_s,
        "writeback-s": writeback_s,
        "version": node.version,
        "node-source": source,
        "pid": node_host.pid(),
    }
    content = RecordDict(
        {
            protocol.UPDATE: ArrayRecord({"update": protocol.bytes_to_array(blob)}),
            protocol.METRICS: MetricRecord(metrics),
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate("fedkv")
def evaluate(msg: Message, context: Context) -> Message:
    """Catch up to the newest aggregate, then evaluate on the local held-out share."""
    cfg = RunConfig.from_run_config(context.run_config)
    node, source = node_host.get_node(context)
    try:
        codec, _ = _codec(cfg, context, node.layout.size)
        decrypt_s, writeback_s = _catch_up(node, msg, codec)
        t0 = time.perf_counter()
        loss, acc, n = node.evaluate()
        eval_s = time.perf_counter() - t0
        node_host.save_node(context, node)
    except Exception:
        node_host.discard(context)
        raise
    metrics = {
        "num-examples": n,
        "eval-loss": loss,
        "eval-metric": acc,
        "decrypt-s": decrypt_s,
        "writeback-s": writeback_s,
        "eval-s": eval_s,
        "version": node.version,
        "node-source": source,
        "pid": node_host.pid(),
    }
    return Message(RecordDict({protocol.METRICS: MetricRecord(metrics)}), reply_to=msg)


def _catch_up(node: CacheNode, msg: Message, codec: ClientCodec) -> tuple[float, float]:
    """Apply every aggregate newer than the node's version; returns (decode s, write-back s)."""
    target = int(msg.content[protocol.CONFIG]["target-version"])
    record = msg.content.array_records.get(protocol.AGGREGATES)
    decrypt_s = writeback_s = 0.0
    for version, blob in protocol.unpack_aggregates(record):
        if version <= node.version:
            continue  # already applied (e.g. the server did not see our last reply)
        t0 = time.perf_counter()
        mean = codec.decode_mean(blob)
        t1 = time.perf_counter()
        node.apply_mean_update(mean, version)
        decrypt_s += t1 - t0
        writeback_s += time.perf_counter() - t1
    if node.version != target:
        raise RuntimeError(
            f"node is at global v{node.version} but the server expects v{target}; "
            "aggregates are missing (server will resend the full history)"
        )
    return decrypt_s, writeback_s


# --- Flower's array protocol: the flower-central DP baseline --------------------------


@app.train(mods=[fixedclipping_mod])
def train_arrays(msg: Message, context: Context) -> Message:
    """Load the global weights, train, return weights (Flower's mod clips the update)."""
    cfg = RunConfig.from_run_config(context.run_config)
    node, source = node_host.get_node(context)
    arrays = msg.content.array_records["arrays"]
    node.set_weights(arrays.to_torch_state_dict())
    before = np.concatenate([a.ravel() for a in arrays.to_numpy_ndarrays()])
    loss, n, train_s = node.train_in_place(cfg.local_epochs, cfg.lr)
    reply_arrays = ArrayRecord(node.get_weights())
    after = np.concatenate([a.ravel() for a in reply_arrays.to_numpy_ndarrays()])
    norm = float(np.linalg.norm(after - before))
    clip = float(msg.content.config_records["config"].get("clipping_norm", 0.0))
    metrics = {
        "num-examples": n,
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
def evaluate_arrays(msg: Message, context: Context) -> Message:
    """Evaluate Flower-sent global weights on the local held-out share."""
    node, _ = node_host.get_node(context)
    node.set_weights(msg.content.array_records["arrays"].to_torch_state_dict())
    loss, acc, n = node.evaluate()
    metrics = MetricRecord({"num-examples": n, "eval-loss": loss, "eval-metric": acc})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
