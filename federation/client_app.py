"""fedkv ClientApp: every Flower node hosts one ``CacheNode`` across rounds.

Protocols, routed by message type:

* ``query.fedkv_enroll`` / ``query.fedkv_keygen`` / ``query.fedkv_provision``: key provisioning
  (``federation/key_service.py``): the node's identity keys and CKKS keys live in its kit or
  node-local directory (``federation/node_store.py``), never in ``context.state``; one node
  makes the CKKS key (or the kits hold it) and the server only relays wrapped bundles.
* ``query.fedkv_noise``: distributed-DP noise shares for nodes that left a round (he=true).
* ``train.fedkv`` / ``evaluate.fedkv`` (the product path): the node first applies the
  aggregates it is missing (``federation.catch_up``: manifest checks -> MAC -> decrypt -> the
  public bound on the mean -> write back; any failure is the one ``AggregateRejected``), then
  trains and makes its contribution (``federation.contribution.make_contribution``: clip ->
  noise share -> count coordinate -> weight -> residual/dither -> encode -> tag -> sign) and
  replies with the signed bytes, or evaluates on its held-out share. The server never
  sends or receives plaintext weights on this path. Train and noise requests are answered
  once per round (``NodeStore.answer_once``): a repeat gets the first reply's bytes, never a
  second MAC tag (``crypto.binding``).
* ``train`` / ``evaluate`` (Flower's array protocol): used by the ``flower-central``
  baseline (Flower's FedAvg wrapped in DifferentialPrivacyClientSideFixedClipping);
  ``fixedclipping_mod`` is attached to ``train`` only (on ``ClientApp(mods=...)`` it
  would break the evaluate replies). The node loads the weights it is sent as they come, so
  these handlers check the node policy too: a node that requires HE (every kit, by default)
  refuses them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod

from crypto import CONTRIBUTION_NOISE, CONTRIBUTION_UPDATE
from federation import gate_report, key_service, messages, node_host, protocol
from federation.catch_up import catch_up
from federation.codec import uses_error_feedback, wire_dim, wire_noise
from federation.config import RunConfig
from federation.contribution import Contribution, make_contribution, make_noise_shares, node_codec, sender_for
from federation.logs import configure_logging
from federation.messages import NodeSource
from federation.node_store import NodeStore
from federation.timing import PhaseTimer
from node.cache_node import CacheNode, DpConfig, TrainOutcome
from node.tasks.workload import WorkloadConfig

configure_logging()  # each log line once (Opacus adds a root handler on import)
_log = logging.getLogger("fedkv.client_app")
app = ClientApp()


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
    req = messages.read_round_request(msg)
    with NodeStore.for_context(context).answer_once(req.server_round, CONTRIBUTION_UPDATE) as slot:
        if slot.stored is None:
            blob, metrics = _train(cfg, req, context, timer)
            slot.keep(protocol.pack_blobs([blob, json.dumps(metrics).encode()]))
        assert slot.stored is not None
        blob, metrics_json = protocol.unpack_blobs(slot.stored, limit=2)
    return messages.train_reply(msg, blob, json.loads(metrics_json))


def _train(cfg: RunConfig, req: messages.RoundRequest, context: Context,
           timer: PhaseTimer) -> tuple[bytes, dict[str, Any]]:
    """The train handler's work: catch up, train (the node's raw update), make the contribution
    (``federation.contribution``: the whole update-level mechanism); (signed bytes,
    ``messages.metric_fields``)."""
    with timer.phase("restore"):
        node, source = node_host.get_node(context)
    store, feedback = NodeStore.for_context(context), uses_error_feedback(cfg)
    try:
        clip_norm = catch_up(cfg, node, req, context, timer)
        dim = wire_dim(cfg, node.layout.size)
        with timer.phase("key"):
            codec, epoch, ctx = node_codec(cfg, context, dim)
            sender = sender_for(context, epoch, ctx)
        out = node.train_round(cfg.local_epochs, cfg.lr, _dp_sgd_config(cfg, clip_norm))
        timer.add("train", out.train_s)
        with timer.phase("encrypt"):
            residual = store.load_residual(dim) if feedback else None
        # Fresh OS entropy on purpose: DP noise must not be reproducible from the seed.
        made = make_contribution(cfg, out.delta, num_examples=out.num_examples, clip_norm=clip_norm,
                                 num_sampled=req.num_sampled, rnd=req.server_round, codec=codec, sender=sender,
                                 residual=residual, rng=np.random.default_rng(), timer=timer)
        with timer.phase("save"):
            node_host.save_node(context, node)
            if feedback:
                store.save_residual(made.residual)
    except Exception:
        node_host.discard(context)  # the cached object may be half-updated
        raise
    return made.blob, _train_metrics(cfg, out, made, node, source, timer)


def _dp_sgd_config(cfg: RunConfig, clip_norm: float) -> DpConfig:
    """What DP-SGD inside the node's training (``CacheNode.train_round``) needs."""
    return DpConfig(clip_norm=clip_norm, noise_multiplier=wire_noise(cfg)[1], dp_sgd=cfg.dp_sgd,
                    target_delta=cfg.target_delta, target_epsilon=cfg.dp_sgd_epsilon,
                    planned_rounds=cfg.num_server_rounds, expected_batch=cfg.dp_sgd_batch,
                    example_clip=cfg.dp_sgd_clip)


def _train_metrics(cfg: RunConfig, out: TrainOutcome, made: Contribution, node: CacheNode, source: NodeSource,
                   timer: PhaseTimer) -> dict[str, Any]:
    """A train reply's metrics (``messages.metric_fields``): under DP, loss, clipping, the update's
    norm and saturation are private values outside the accounting and are not sent."""
    public = cfg.dp_mode not in ("local", "distributed")
    return messages.metric_fields(messages.TrainMetrics(
        num_examples=out.num_examples, upload_bytes=len(made.blob), num_values=made.num_values,
        weight_capped=made.weight_capped, **_phase_seconds(timer, protocol.NODE_TRAIN_PHASES),
        version=node.version, node_source=source, pid=node_host.pid(), kv_on_disk=node_host.kv_on_disk(node, source),
        epsilon_sample=out.epsilon if cfg.dp_sgd else None,
        train_loss=out.loss if public else None, clipped=made.clipped if public else None,
        delta_norm=out.delta_norm if public else None, saturated=made.saturated if public else None,
    ))


def _phase_seconds(timer: PhaseTimer, phases: tuple[str, ...]) -> dict[str, float]:
    """``<phase>_s`` for every phase (0 when it did not happen) plus ``handler_s`` (the whole
    handler up to here; what the phases leave out is ``handler_s`` minus their sum), as the
    ``messages.TrainMetrics`` / ``EvalMetrics`` fields."""
    out = {f"{p}_s": float(timer.seconds.get(p, 0.0)) for p in phases}
    out["handler_s"] = timer.total
    return out


@app.query("fedkv_noise")
@node_host.releasing
def noise(msg: Message, context: Context) -> Message:
    """Distributed DP under HE: noise shares for sampled nodes that left the round (tagged, signed;
    once per round, a repeated request gets the same bytes: ``NodeStore.answer_once``)."""
    cfg = _run_config(context)
    if not cfg.he or cfg.dp_mode != "distributed":
        raise RuntimeError("noise shares are made only with he=true and dp-mode=distributed")
    req = messages.read_noise_request(msg)
    if not (1 <= req.shares < req.num_sampled <= cfg.max_clients):
        raise RuntimeError("noise request out of range")
    with NodeStore.for_context(context).answer_once(req.server_round, CONTRIBUTION_NOISE) as slot:  # as train
        if slot.stored is None:
            node, _ = node_host.get_node(context)
            dim = wire_dim(cfg, node.layout.size)
            codec, epoch, ctx = node_codec(cfg, context, dim)
            slot.keep(make_noise_shares(cfg, rnd=req.server_round, shares=req.shares, sampled=req.num_sampled,
                                        dim=dim, codec=codec, sender=sender_for(context, epoch, ctx),
                                        rng=np.random.default_rng()))  # fresh OS entropy
        blob = slot.stored
    return messages.noise_reply(msg, blob)


@app.evaluate("fedkv")
@node_host.releasing
def evaluate(msg: Message, context: Context) -> Message:
    """Catch up to the newest aggregate, evaluate on the local held-out share, then serve a
    chat turn through the cache (the K/V the next process finds on disk)."""
    timer = PhaseTimer()
    cfg = _run_config(context)
    req = messages.read_round_request(msg)
    with timer.phase("restore"):
        node, source = node_host.get_node(context)
    try:
        catch_up(cfg, node, req, context, timer)
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
    _mark_if_last(cfg, req.server_round, context, node)
    return messages.eval_reply(msg, messages.EvalMetrics(
        num_examples=n, eval_loss=loss, eval_metric=acc, **_phase_seconds(timer, protocol.NODE_EVAL_PHASES),
        version=node.version, node_source=source, pid=node_host.pid(), kv_on_disk=node_host.kv_on_disk(node, source),
        serve=messages.serve_fields(serving), base_metric=getattr(node.task, "base_metric", None),
        samples=[(s["question"], s["reply"]) for s in getattr(node.task, "samples", [])],
        gate=gate_report.node_fields(node.last_gate, node.version)))


def _mark_if_last(cfg: RunConfig, server_round: int, context: Context, node: Any) -> None:
    """After the last round's evaluation (the final aggregate applied), mark the run completed:
    retention then counts it among the completed runs (``federation.run_retention``); a LoRA
    model's adapters are kept outside the run directories (``_keep_adapters``)."""
    if server_round >= cfg.num_server_rounds:
        store = NodeStore.for_context(context)
        store.mark_completed()
        _keep_adapters(store, node)


def _keep_adapters(store: NodeStore, node: Any) -> None:
    """The node's final adapters as a PEFT adapter in ``store.adapters_dir``: retention removes
    old runs' state, never the model a run fine-tuned. Writing them never fails the round
    (the run is complete; the adapters stay in the node's cache until retention)."""
    from node.serving import adapters
    from node.models.lora import LoraLlamaModel
    if not isinstance(node.model, LoraLlamaModel):
        return
    chat_model = getattr(node.task, "chat_model", "")
    base = "fedkv-chat-tiny" if chat_model == "tiny" else _smollm2_dir()
    try:
        out = adapters.write_adapter(adapters.from_model(node.model, node.version, base),
                                     store.adapters_dir, force=True)  # this run's own folder
    except (OSError, adapters.AdapterError) as err:
        _log.warning("final adapters not kept in %s: %s", store.adapters_dir, err)
        return
    _log.info("final adapters (model version %d) kept in %s", node.version, out)


def _smollm2_dir() -> str:
    from node.models.smollm2 import default_dir
    return str(default_dir().resolve())


# --- Flower's array protocol: the flower-central DP baseline --------------------------


def clipping_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's fixed or adaptive clipping mod, as the run's ``adaptive-clipping`` says (one train
    handler serves both: mods are bound per handler)."""
    adaptive = RunConfig.from_run_config(context.run_config).adaptive_clipping
    return (adaptiveclipping_mod if adaptive else fixedclipping_mod)(msg, context, call_next)


@app.train(mods=[clipping_mod])
@node_host.releasing
def train_arrays(msg: Message, context: Context) -> Message:
    """Load the global weights, train, return weights (Flower's mod clips the update); only a
    run the node's policy allows (``require-he`` refuses this he=false path)."""
    cfg = _run_config(context)
    node, source = node_host.get_node(context)
    arrays = msg.content.array_records["arrays"]
    node.set_weights(arrays.to_torch_state_dict())
    before = np.concatenate([a.ravel() for a in arrays.to_numpy_ndarrays()])
    server_round = int(msg.content.config_records["config"]["server-round"])
    clip = float(msg.content.config_records["config"].get("clipping_norm", 0.0))
    loss, n, train_s, eps = node.train_in_place(cfg.local_epochs, cfg.lr, server_round, _dp_sgd_config(cfg, clip))
    reply_arrays = ArrayRecord(node.get_weights())
    after = np.concatenate([a.ravel() for a in reply_arrays.to_numpy_ndarrays()])
    norm = float(np.linalg.norm(after - before))
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
        **({"epsilon-sample": eps} if cfg.dp_sgd else {}),
    }
    content = RecordDict({"arrays": reply_arrays, "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
@node_host.releasing
def evaluate_arrays(msg: Message, context: Context) -> Message:
    """Evaluate Flower-sent global weights on the local held-out share (as ``train_arrays``,
    only a run the node's policy allows)."""
    _run_config(context)
    node, _ = node_host.get_node(context)
    node.set_weights(msg.content.array_records["arrays"].to_torch_state_dict())
    loss, acc, n = node.evaluate()
    # unit-weight: Flower's FedAvg checks its weight key in evaluate replies too
    metrics = MetricRecord({"num-examples": n, "unit-weight": 1, "eval-loss": loss, "eval-metric": acc})
    config = msg.content.config_records.get("config")
    if config is not None and "server-round" in config:
        _mark_if_last(RunConfig.from_run_config(context.run_config), int(config["server-round"]), context, node)
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
