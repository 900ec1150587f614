"""Wire format of the fedkv messages (one place, so server and client cannot drift).

Our opaque-bytes protocol uses its own message *actions* (``train.fedkv``,
``evaluate.fedkv``) so the default ``train``/``evaluate`` handlers stay free for
Flower's array strategies (the ``flower-central`` DP baseline).

Bytes travel as 1-D uint8 ``Array``s inside an ``ArrayRecord``: unlike bytes in a
``ConfigRecord``, Flower chunks Arrays (5 MB pieces), so large ciphertexts are fine.

Before a node takes part it is enrolled (and, with he=true, provisioned with the CKKS key):
``query.fedkv_enroll`` / ``query.fedkv_provision``, see ``federation/key_service.py``.

server -> client (train/evaluate):
    ArrayRecord "aggregates": {"v<k>": aggregate bytes that produce global version k,
        "m<k>": its manifest (he=true: ``crypto.Manifest``, the summands' node ids, kinds and
        tags; the node checks the aggregate against it before decrypting, ``crypto.binding``)}
        for every version the node may be missing (it applies them in order)
    ConfigRecord "config": server-round, target-version, num-sampled
server -> client (query.fedkv_noise, he=true + dp-mode distributed, only for rounds with drops):
    ConfigRecord "config": server-round, shares, num-sampled
    reply: ArrayRecord "update" {"update": a signed contribution of kind noise}
client -> server (train):
    ArrayRecord "update": {"update": crypto.SignedUpdate bytes = run id, node id, round, key
        epoch, key id, kind, aggregate tag, payload (CKKS update ciphertext, or the plaintext
        codec's bytes with he=false), Ed25519 signature over all of them (payload by SHA-256)}
    MetricRecord "metrics": see ``TRAIN_METRICS``
client -> server (evaluate):
    MetricRecord "metrics": see ``EVAL_METRICS``
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

TRAIN = "train.fedkv"
EVALUATE = "evaluate.fedkv"
NOISE = "query.fedkv_noise"
"""he=true, distributed DP: a survivor makes noise shares for sampled nodes that left the round."""

AGGREGATE_REJECTED = "aggregate rejected"
"""The whole text of a node's answer to any aggregate it will not apply (no numbers, no detail)."""

AGGREGATES = "aggregates"
CONFIG = "config"
UPDATE = "update"
METRICS = "metrics"

NODE_TRAIN_PHASES = ("restore", "key", "decrypt", "writeback", "train", "encrypt", "sign", "save")
"""Timed phases of a train handler, sent as ``<phase>-s`` with ``handler-s`` (the whole handler):
restore the node, load/unwrap the CKKS key and codec, decode aggregates it lacks, write them back,
train, encode (clip + quantize + encrypt), tag + sign, save the node's state."""
NODE_EVAL_PHASES = ("restore", "key", "decrypt", "writeback", "eval", "serve", "save")
"""Timed phases of an evaluate handler (``serve``: the chat turn through the cache)."""
TRAIN_METRICS = (
    "num-examples", "upload-bytes", "num-values", "weight-capped",
    *(f"{p}-s" for p in NODE_TRAIN_PHASES), "handler-s", "version", "node-source", "pid",
    "kv-on-disk",
)
"""Always sent (``epsilon-sample`` too, with dp-sgd)."""
TRAIN_METRICS_NON_DP = ("train-loss", "clipped", "delta-norm", "saturated")
"""Functions of private data outside the accounting: sent only with dp-mode none."""
SERVE_COUNTS = ("serve-sessions", "serve-turns", "serve-prompt-tokens", "serve-prefix-hit-tokens",
                "serve-lookups", "serve-hit-hot", "serve-hit-warm", "serve-hit-cold",
                "serve-decode-tokens", "serve-recomputed", "serve-invalidated",
                "serve-stale-served", "serve-scored", "serve-trace-shaped")
"""What a node's serving pass counted (``node.workload_pass.ServeReport``; all 0 when it served
nothing): sums over nodes are exact, rates are derived on the server. ``serve-trace-shaped``
is 1 when the Mooncake trace shaped the node's sessions."""
SERVE_AMOUNTS = ("serve-busy-s", "serve-nll", "serve-nll-fresh")
"""Seconds serving turns (``serve-s``, the phase, also holds the cache-free scoring), and
summed log-loss of the served texts through the cache / cache-free."""
EVAL_METRICS = ("num-examples", "eval-loss", "eval-metric", *(f"{p}-s" for p in NODE_EVAL_PHASES), "handler-s",
                "version", "node-source", "pid", "kv-on-disk", *SERVE_COUNTS, *SERVE_AMOUNTS)
"""``kv-on-disk``: K/V blocks the node's cache found in its directory at warm start."""


def bytes_to_array(blob: bytes) -> Array:
    return Array(np.frombuffer(bytes(blob), dtype=np.uint8))


def array_to_bytes(arr: Array) -> bytes:
    data = arr.numpy()
    if data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError(f"expected a 1-D uint8 array, got {data.dtype} {data.shape}")
    return data.tobytes()


def pack_aggregates(history: list[tuple[bytes, bytes]], from_version: int) -> ArrayRecord:
    """Aggregates (+ manifests) for versions from_version+1 .. len(history)."""
    rec = {}
    for k in range(from_version + 1, len(history) + 1):
        aggregate, manifest = history[k - 1]
        rec[f"v{k}"] = bytes_to_array(aggregate)
        if manifest:
            rec[f"m{k}"] = bytes_to_array(manifest)
    return ArrayRecord(rec)


def unpack_aggregates(record: ArrayRecord | None) -> list[tuple[int, bytes, bytes]]:
    """[(version, aggregate, manifest or b"")] sorted by version."""
    if record is None:
        return []
    aggregates, manifests = {}, {}
    for key, arr in record.items():
        if key[:1] not in ("v", "m") or not key[1:].isdigit() or len(key) > 12:
            raise ValueError("unexpected aggregate key")
        (aggregates if key[0] == "v" else manifests)[int(key[1:])] = array_to_bytes(arr)
    return [(k, aggregates[k], manifests.get(k, b"")) for k in sorted(aggregates)]


def error_text(reply: object, limit: int = 200) -> str:
    """A reply's error reason, shortened (a node must not make the server log megabytes)."""
    try:
        reason = str(reply.error.reason)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a malformed error is still an error
        reason = "unreadable error"
    return reason if len(reason) <= limit else reason[:limit] + "..."


def is_aggregate_refusal(reason: str) -> bool:
    """Whether a dropped reply's reason is a node refusing the aggregate, in each form an error
    reaches the server: Flower writes a ClientApp's exception as ``<class '...'>:<'text'>``
    (SuperNode; the simulation engine after wrapping it in a ClientAppException), the
    in-process grid as ``Name: text``."""
    return reason.removesuffix("'>").endswith(AGGREGATE_REJECTED)


def pack_blobs(blobs: list[bytes]) -> bytes:
    """Several byte strings as one (4-byte big-endian length before each)."""
    return b"".join(len(b).to_bytes(4, "big") + b for b in blobs)


def unpack_blobs(data: bytes, limit: int = 64) -> list[bytes]:
    """Inverse of ``pack_blobs``; ValueError for framing that does not add up."""
    out, pos = [], 0
    while pos < len(data):
        if len(out) >= limit or pos + 4 > len(data):
            raise ValueError("bad blob framing")
        n = int.from_bytes(data[pos : pos + 4], "big")
        if pos + 4 + n > len(data):
            raise ValueError("bad blob framing")
        out.append(bytes(data[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    return out


def reply_sender(reply: object, sent: dict[str, int]) -> int:
    """The node a reply answers for. Flower's own error replies (NODE_UNAVAILABLE for a node that
    died) come from the SuperLink (node id 1); ``sent`` (message id -> destination) maps them back."""
    meta = reply.metadata  # type: ignore[attr-defined]
    if reply.has_error() and meta.reply_to_message_id in sent:  # type: ignore[attr-defined]
        return sent[meta.reply_to_message_id]
    return int(meta.src_node_id)


def destinations(messages: list[object]) -> dict[str, int]:
    """message id -> destination node of messages the grid has sent (ids are set on push)."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}  # type: ignore[attr-defined]
