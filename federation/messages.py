"""Every fedkv reply's writer (the node's side) next to its strict reader (the server's side),
and the node-source enum, spelled once.

A node writes a reply with ``enroll_reply`` / ``keygen_reply`` / ``provision_ack`` /
``noise_reply`` / ``train_reply`` / ``eval_reply`` from the same frozen dataclass the server's
reader returns, so the record and field names exist once, here (the field lists of the train
and evaluate metrics are ``protocol.TRAIN_METRICS`` / ``EVAL_METRICS``; a test checks every
writer against its reader).

A node is not trusted to send well-formed replies (a bug, a version skew, a hostile node).
Each reader takes a reply ``Message`` (known not to carry an error) and returns a frozen
dataclass whose fields satisfy the documented types and ranges, or raises ``BadReply`` with a
short reason naming the record and field (the checks: ``federation.wire_checks``). Whatever
the message contains (missing records, other record kinds, wrong types, ``bool`` for ``int``,
floats for ints, huge ints, NaN/inf, lists for scalars, oversized or mis-framed arrays), no
other exception escapes: the caller drops that node from the round and records the reason.
Reasons never echo more than ~40 characters of a client-supplied value.

Strict shape: a reply carries exactly the records listed for its kind, and each record exactly
its listed fields (optional ones may be absent); anything unknown is a ``BadReply``.

Reply formats (``int``: a Python int, never ``bool`` or ``float``; ``float``: a float or an int,
checked before conversion; bytes arrays: 1-D uint8 ``Array`` in .npy framing, whose header is
checked against the data before anything is allocated):

1. Enroll (``parse_enroll_reply``): ConfigRecord ``node-keys`` {``node-id`` str (= the
   expected node id), ``name`` str (0..64 of ``[A-Za-z0-9._-]``; "" = no kit), ``kx-public``
   32 bytes, ``sign-public`` 32 bytes, ``epoch`` int in [-1, 2**31-1] (-1 = holds no CKKS key),
   ``key-id`` bytes, 16 iff epoch >= 0 else empty, ``partition-id`` int in [0, num-partitions),
   ``num-partitions`` int in [1, 2**31-1] (the node's node config)}.
2. Keygen (``parse_keygen_reply``): ConfigRecord ``keygen`` {``epoch`` int [0, 2**31-1]
   (= expected), ``key-id`` 16 bytes, ``members`` list[str] (non-empty, distinct, <= 1024,
   = expected as a set)} + ArrayRecord ``bundles`` {member id: 1..8 MiB, one per member} +
   ArrayRecord ``public-context`` {``ctx``: 1..8 MiB}.
3. Provision ack (``parse_provision_ack``): ConfigRecord ``provisioned`` {``key-id`` 16 bytes,
   ``epoch`` int [0, 2**31-1]}.
4. Noise share (``parse_noise_reply``): ArrayRecord ``update`` {``update``: 1 B .. 256 MiB}.
5. Train (``parse_train_reply``): ArrayRecord ``update`` (as 4) + MetricRecord ``metrics``,
   see ``TRAIN_REQUIRED`` / ``TRAIN_OPTIONAL`` / ``TRAIN_NON_DP`` (required without DP, and
   absent under DP: private values outside the accounting).
6. Evaluate (``parse_eval_reply``): MetricRecord ``metrics``, see ``EVAL_FIELDS`` (optional:
   ``base-metric``, ``gate_report.GATE_FIELDS``), plus, optionally, ConfigRecord ``samples``
   {``questions``, ``replies``: list[str] of equal length <= 8, each <= 2,000 characters} (the
   chat task's greedy replies to held-out questions).

The server's requests that come with a round (7: ``round_request`` / ``read_round_request`` for
train and evaluate, ``noise_request`` / ``read_noise_request``) are read by the node; the key
service's requests are written and read in ``federation.key_service``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from federation import gate_report, protocol
from federation.wire_checks import (
    MAX_SECONDS, UNEXPECTED, BadReply, array_bytes, as_bytes, as_flag, as_float, as_int, as_seconds, as_str,
    exact_fields, exact_records, guard, kind_of, safe_reason, show,
)

__all__ = [
    "BUNDLES", "CTX", "ENROLL_REQUEST", "KEYGEN", "MAX_SECONDS", "NODE_KEYS", "PROVISION_REQUEST", "PROVISIONED",
    "PUBLIC_CONTEXT", "UNEXPECTED",
    "UPDATE_KEY", "BadReply", "EnrollReply", "EvalMetrics", "KeygenReply", "NodeSource", "ProvisionAck",
    "TrainMetrics", "TrainReply", "enroll_reply", "eval_reply", "keygen_reply", "noise_reply",
    "parse_enroll_reply", "parse_eval_reply", "parse_keygen_reply", "parse_noise_reply",
    "parse_provision_ack", "parse_train_reply", "provision_ack", "safe_reason", "serve_fields",
    "train_reply", "NoiseRequest", "RoundRequest", "noise_request", "read_noise_request",
    "read_round_request", "round_request", "metric_fields",
]

# -- record and field names ----------------------------------------------------------------
ENROLL_REQUEST = "enroll"
"""ConfigRecord of a ``query.fedkv_enroll`` request (empty)."""
PROVISION_REQUEST = "provision"
"""ConfigRecord of a ``query.fedkv_provision`` request (``federation.key_service``)."""
NODE_KEYS = "node-keys"
"""ConfigRecord of an enroll reply."""
KEYGEN = "keygen"
"""ConfigRecord of a keygen request and of its reply."""
BUNDLES = "bundles"
"""ArrayRecord of a keygen reply: one wrapped key bundle per member."""
PUBLIC_CONTEXT = "public-context"
"""ArrayRecord of a keygen reply holding the signed public context under ``CTX``."""
CTX = "ctx"
PROVISIONED = "provisioned"
"""ConfigRecord of a provision ack."""
UPDATE_KEY = "update"
"""The Array inside the ``protocol.UPDATE`` ArrayRecord (noise-share and train replies)."""
SAMPLES = "samples"
"""Optional ConfigRecord of an evaluate reply: the chat task's sample replies."""

# -- limits -----------------------------------------------------------------------------------
MiB = 1 << 20
EPOCH_MAX = 2**31 - 1
KEY_ID_BYTES = 16
PUBLIC_KEY_BYTES = 32
NAME_MAX = 64
MAX_MEMBERS = 1024
MAX_BUNDLE_BYTES = 8 * MiB
MAX_CONTEXT_BYTES = 8 * MiB
MAX_UPDATE_BYTES = 256 * MiB
MAX_EXAMPLES = 10**9
MAX_UPLOAD_BYTES = 2**40
VERSION_MAX = 2**31 - 1
PID_MAX = 2**31 - 1
MAX_KV_BLOCKS = 2**31 - 1
PARTITIONS_MAX = 2**31 - 1
MAX_NUM_VALUES = 2**40
MAX_SAMPLES = 8
MAX_SAMPLE_CHARS = 2000


class NodeSource(IntEnum):
    """How a node's handler got its ``CacheNode`` (``node-source`` in train/evaluate replies;
    ``federation.node_host.get_node``); the round record counts them by ``label``."""

    BUILT = 0
    """Built in this process, nothing to restore (a node's first message)."""
    RESTORED = 1
    """Built in this process and restored from the node's directory."""
    REUSED = 2
    """The process still held the node from an earlier message."""

    @property
    def label(self) -> str:
        return self.name.lower()


NODE_SOURCES = tuple(int(s) for s in NodeSource)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]*")


# -- reply types --------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnrollReply:
    node_id: str
    name: str
    kx_public: bytes
    sign_public: bytes
    epoch: int
    """CKKS key epoch the node holds; -1 = none."""
    key_id: bytes
    """16 bytes when epoch >= 0, else b""."""
    partition_id: int
    num_partitions: int
    """The node's partition in its node config (0 <= partition_id < num_partitions)."""

    def __repr__(self) -> str:  # keys are public, but keep logs short
        return (f"EnrollReply(node_id={self.node_id!r}, name={self.name!r}, epoch={self.epoch}, "
                f"partition={self.partition_id}/{self.num_partitions})")


@dataclass(frozen=True)
class KeygenReply:
    epoch: int
    key_id: bytes
    bundles: dict[str, bytes]
    """member node id -> wrapped key bundle bytes (exactly the expected members)."""
    signed_public_context: bytes

    def __repr__(self) -> str:
        return f"KeygenReply(epoch={self.epoch}, members={sorted(self.bundles)})"


@dataclass(frozen=True)
class ProvisionAck:
    key_id: bytes
    epoch: int


@dataclass(frozen=True)
class TrainMetrics:
    num_examples: int
    upload_bytes: int
    num_values: int
    weight_capped: bool
    train_s: float
    encrypt_s: float
    sign_s: float
    decrypt_s: float
    writeback_s: float
    version: int
    node_source: int
    pid: int
    kv_on_disk: int
    epsilon_sample: float | None = None
    """Per-sample DP-SGD epsilon (>= 0, may be +inf); None = not applicable."""
    # None under DP (a node must not send them), set otherwise:
    train_loss: float | None = None
    clipped: bool | None = None
    delta_norm: float | None = None
    saturated: int | None = None
    restore_s: float = 0.0
    key_s: float = 0.0
    save_s: float = 0.0
    handler_s: float = 0.0
    """The whole handler; the phases above and ``train_s`` .. ``writeback_s`` lie inside it."""


@dataclass(frozen=True)
class TrainReply:
    blob: bytes
    """The signed update bytes (still to be verified)."""
    metrics: TrainMetrics

    def __repr__(self) -> str:
        return f"TrainReply(blob=<{len(self.blob)} bytes>, metrics={self.metrics!r})"


@dataclass(frozen=True)
class EvalMetrics:
    num_examples: int
    eval_loss: float
    eval_metric: float
    decrypt_s: float
    writeback_s: float
    eval_s: float
    version: int
    node_source: int
    pid: int
    kv_on_disk: int
    restore_s: float = 0.0
    key_s: float = 0.0
    serve_s: float = 0.0
    save_s: float = 0.0
    handler_s: float = 0.0
    serve: dict[str, float] = field(default_factory=dict)
    """``protocol.SERVE_COUNTS`` and ``SERVE_AMOUNTS`` by name (checked: counts are ints in
    range, amounts finite and >= 0)."""
    base_metric: float | None = None
    """The task's metric of the frozen base model on the same held-out data (chat task; None:
    not applicable)."""
    samples: list[tuple[str, str]] = field(default_factory=list)
    """(question, greedy reply) pairs on held-out questions (chat task; empty: none)."""
    gate: dict[str, float] = field(default_factory=dict)
    """The gate before serving on the aggregate applied (``federation.gate_report``; {}: none)."""


# -- 1. enroll -------------------------------------------------------------------------------------
ENROLL_FIELDS = ("node-id", "name", "kx-public", "sign-public", "epoch", "key-id", "partition-id", "num-partitions")


def parse_enroll_reply(msg: Message, expected_node_id: str) -> EnrollReply:
    """ConfigRecord ``node-keys`` of a ``query.fedkv_enroll`` reply."""
    if not isinstance(expected_node_id, str):
        raise TypeError("expected_node_id must be a str")
    return _parse_enroll(msg, expected_node_id)


@guard
def _parse_enroll(msg: Message, expected_node_id: str) -> EnrollReply:
    rec = exact_records(msg, {NODE_KEYS: ConfigRecord})[NODE_KEYS]
    exact_fields(NODE_KEYS, rec, ENROLL_FIELDS)
    f = f"{NODE_KEYS}."
    node_id = as_str(f + "node-id", rec["node-id"], NAME_MAX)
    if node_id != expected_node_id:
        raise BadReply(f"{f}node-id: reply claims node id {show(node_id)}")
    name = as_str(f + "name", rec["name"], NAME_MAX)
    if not _NAME_RE.fullmatch(name):
        raise BadReply(f"{f}name: {show(name)} has characters outside [A-Za-z0-9._-]")
    kx = as_bytes(f + "kx-public", rec["kx-public"], PUBLIC_KEY_BYTES)
    sign = as_bytes(f + "sign-public", rec["sign-public"], PUBLIC_KEY_BYTES)
    epoch = as_int(f + "epoch", rec["epoch"], -1, EPOCH_MAX)
    key_id = as_bytes(f + "key-id", rec["key-id"], KEY_ID_BYTES if epoch >= 0 else 0)
    num_partitions = as_int(f + "num-partitions", rec["num-partitions"], 1, PARTITIONS_MAX)
    partition = as_int(f + "partition-id", rec["partition-id"], 0, num_partitions - 1)
    return EnrollReply(node_id, name, kx, sign, epoch, key_id, partition, num_partitions)


def enroll_reply(msg: Message, reply: EnrollReply) -> Message:
    """The node's answer to ``query.fedkv_enroll`` (read by ``parse_enroll_reply``)."""
    rec = ConfigRecord({
        "node-id": reply.node_id, "name": reply.name, "kx-public": reply.kx_public,
        "sign-public": reply.sign_public, "epoch": reply.epoch, "key-id": reply.key_id,
        "partition-id": reply.partition_id, "num-partitions": reply.num_partitions,
    })
    return Message(RecordDict({NODE_KEYS: rec}), reply_to=msg)


# -- 2. keygen -------------------------------------------------------------------------------------
KEYGEN_FIELDS = ("epoch", "key-id", "members")


def parse_keygen_reply(msg: Message, expected_members: list[str], expected_epoch: int) -> KeygenReply:
    """``keygen`` + ``bundles`` + ``public-context`` from the node that made a new CKKS key."""
    members = list(expected_members)
    if not members or not all(isinstance(m, str) for m in members) or len(set(members)) != len(members):
        raise ValueError("expected_members must be distinct node id strings, at least one")
    if isinstance(expected_epoch, bool) or not isinstance(expected_epoch, int):
        raise TypeError("expected_epoch must be an int")
    return _parse_keygen(msg, frozenset(members), expected_epoch)


@guard
def _parse_keygen(msg: Message, expected: frozenset[str], expected_epoch: int) -> KeygenReply:
    recs = exact_records(msg, {KEYGEN: ConfigRecord, BUNDLES: ArrayRecord, PUBLIC_CONTEXT: ArrayRecord})
    rec = recs[KEYGEN]
    exact_fields(KEYGEN, rec, KEYGEN_FIELDS)
    f = f"{KEYGEN}."
    epoch = as_int(f + "epoch", rec["epoch"], 0, EPOCH_MAX)
    if epoch != expected_epoch:
        raise BadReply(f"{f}epoch: {epoch}, expected {expected_epoch}")
    key_id = as_bytes(f + "key-id", rec["key-id"], KEY_ID_BYTES)
    members = rec["members"]
    if not isinstance(members, list):
        raise BadReply(f"{f}members: expected a list of str, got {kind_of(members)}")
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise BadReply(f"{f}members: {len(members)} entries, expected 1..{MAX_MEMBERS}")
    for m in members:
        if not isinstance(m, str):
            raise BadReply(f"{f}members: expected a list of str, got an entry of {kind_of(m)}")
    got = {str(m) for m in members}
    if len(got) != len(members):
        raise BadReply(f"{f}members: repeated entries")
    if got != expected:
        extra, lacking = sorted(got - expected), sorted(expected - got)
        detail = f"unexpected {show(extra[0])}" if extra else f"lacks {show(lacking[0])}"
        raise BadReply(f"{f}members: not the expected members ({detail})")
    bundles_rec = recs[BUNDLES]
    for key in bundles_rec.keys():
        if key not in got:
            raise BadReply(f"{BUNDLES}: entry {show(key)} is not a member")
    bundles: dict[str, bytes] = {}
    for m in sorted(got):
        if m not in bundles_rec:
            raise BadReply(f"{BUNDLES}: no bundle for member {show(m)}")
        bundles[m] = array_bytes(f"{BUNDLES}.{show(m)}", bundles_rec[m], MAX_BUNDLE_BYTES)
    ctx_rec = recs[PUBLIC_CONTEXT]
    exact_fields(PUBLIC_CONTEXT, ctx_rec, (CTX,))
    ctx = array_bytes(f"{PUBLIC_CONTEXT}.{CTX}", ctx_rec[CTX], MAX_CONTEXT_BYTES)
    return KeygenReply(epoch, key_id, bundles, ctx)


def keygen_reply(msg: Message, reply: KeygenReply) -> Message:
    """The key-making node's answer to ``query.fedkv_keygen`` (read by ``parse_keygen_reply``):
    the members in ``reply.bundles``' order, each member's bundles packed as one entry."""
    done = ConfigRecord({"epoch": reply.epoch, "key-id": reply.key_id, "members": list(reply.bundles)})
    return Message(RecordDict({
        KEYGEN: done,
        BUNDLES: ArrayRecord({m: protocol.bytes_to_array(b) for m, b in reply.bundles.items()}),
        PUBLIC_CONTEXT: ArrayRecord({CTX: protocol.bytes_to_array(reply.signed_public_context)}),
    }), reply_to=msg)


# -- 3. provision ack ------------------------------------------------------------------------------
PROVISIONED_FIELDS = ("key-id", "epoch")


@guard
def parse_provision_ack(msg: Message) -> ProvisionAck:
    """ConfigRecord ``provisioned`` of a ``query.fedkv_provision`` reply (caller compares)."""
    rec = exact_records(msg, {PROVISIONED: ConfigRecord})[PROVISIONED]
    exact_fields(PROVISIONED, rec, PROVISIONED_FIELDS)
    key_id = as_bytes(f"{PROVISIONED}.key-id", rec["key-id"], KEY_ID_BYTES)
    epoch = as_int(f"{PROVISIONED}.epoch", rec["epoch"], 0, EPOCH_MAX)
    return ProvisionAck(key_id, epoch)


def provision_ack(msg: Message, ack: ProvisionAck) -> Message:
    """The node's answer to ``query.fedkv_provision`` (read by ``parse_provision_ack``)."""
    return Message(RecordDict({PROVISIONED: ConfigRecord({"key-id": ack.key_id, "epoch": ack.epoch})}),
                   reply_to=msg)


# -- 4. noise share ----------------------------------------------------------------------------------
def _update(rec: ArrayRecord) -> bytes:
    exact_fields(protocol.UPDATE, rec, (UPDATE_KEY,))
    return array_bytes(f"{protocol.UPDATE}.{UPDATE_KEY}", rec[UPDATE_KEY], MAX_UPDATE_BYTES)


@guard
def parse_noise_reply(msg: Message) -> bytes:
    """The noise-share bytes (ArrayRecord ``update`` {``update``})."""
    return _update(exact_records(msg, {protocol.UPDATE: ArrayRecord})[protocol.UPDATE])


def _update_record(blob: bytes) -> ArrayRecord:
    return ArrayRecord({UPDATE_KEY: protocol.bytes_to_array(blob)})


def noise_reply(msg: Message, blob: bytes) -> Message:
    """The node's signed noise shares for ``query.fedkv_noise`` (read by ``parse_noise_reply``)."""
    return Message(RecordDict({protocol.UPDATE: _update_record(blob)}), reply_to=msg)


# -- 5. train ------------------------------------------------------------------------------------------
TRAIN_REQUIRED = protocol.TRAIN_METRICS
TRAIN_OPTIONAL = ("epsilon-sample",)
TRAIN_NON_DP = protocol.TRAIN_METRICS_NON_DP
"""Required when dp is off; under DP these are private values outside the accounting."""


def parse_train_reply(msg: Message, *, dp: bool, dim: int) -> TrainReply:
    """ArrayRecord ``update`` + MetricRecord ``metrics`` of a ``train.fedkv`` reply."""
    if not isinstance(dp, bool):
        raise TypeError("dp must be a bool")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError("dim must be a positive int")
    return _parse_train(msg, dp, dim)


@guard
def _parse_train(msg: Message, dp: bool, dim: int) -> TrainReply:
    recs = exact_records(msg, {protocol.UPDATE: ArrayRecord, protocol.METRICS: MetricRecord})
    m = recs[protocol.METRICS]
    M = protocol.METRICS
    if dp:
        exact_fields(M, m, TRAIN_REQUIRED, TRAIN_OPTIONAL, TRAIN_NON_DP, " under DP")
    else:
        exact_fields(M, m, TRAIN_REQUIRED + TRAIN_NON_DP, TRAIN_OPTIONAL)

    def w(key: str) -> str:
        return f"{M}.{key}"

    num_values = as_int(w("num-values"), m["num-values"], 0, MAX_NUM_VALUES)
    if num_values != dim:
        raise BadReply(f"{w('num-values')}: {num_values}, expected {dim}")
    extra: dict[str, Any] = {}
    if "epsilon-sample" in m:
        extra["epsilon_sample"] = as_float(w("epsilon-sample"), m["epsilon-sample"], 0.0, allow_inf=True)
    if not dp:
        extra["train_loss"] = as_float(w("train-loss"), m["train-loss"])
        extra["clipped"] = as_flag(w("clipped"), m["clipped"])
        extra["delta_norm"] = as_float(w("delta-norm"), m["delta-norm"], 0.0)
        extra["saturated"] = as_int(w("saturated"), m["saturated"], 0, num_values)
    metrics = TrainMetrics(
        num_examples=as_int(w("num-examples"), m["num-examples"], 0, MAX_EXAMPLES),
        upload_bytes=as_int(w("upload-bytes"), m["upload-bytes"], 0, MAX_UPLOAD_BYTES),
        num_values=num_values,
        weight_capped=as_flag(w("weight-capped"), m["weight-capped"]),
        train_s=as_seconds(w("train-s"), m["train-s"]),
        encrypt_s=as_seconds(w("encrypt-s"), m["encrypt-s"]),
        sign_s=as_seconds(w("sign-s"), m["sign-s"]),
        decrypt_s=as_seconds(w("decrypt-s"), m["decrypt-s"]),
        writeback_s=as_seconds(w("writeback-s"), m["writeback-s"]),
        version=as_int(w("version"), m["version"], 0, VERSION_MAX),
        node_source=as_int(w("node-source"), m["node-source"], min(NODE_SOURCES), max(NODE_SOURCES)),
        pid=as_int(w("pid"), m["pid"], 1, PID_MAX),
        kv_on_disk=as_int(w("kv-on-disk"), m["kv-on-disk"], 0, MAX_KV_BLOCKS),
        **{f"{k}_s": as_seconds(w(f"{k}-s"), m[f"{k}-s"]) for k in ("restore", "key", "save", "handler")},
        **extra,
    )
    return TrainReply(_update(recs[protocol.UPDATE]), metrics)


def metric_fields(metrics: TrainMetrics | EvalMetrics) -> dict[str, int | float]:
    """A train or evaluate reply's MetricRecord fields: each dataclass field under its wire name
    (``_`` -> ``-``), flags and ``NodeSource`` as plain ints, ``None`` (not sent: private under DP, or not applicable)
    left out, the serving pass's fields (``EvalMetrics.serve``) flat."""
    out: dict[str, int | float] = {}
    for f in fields(metrics):
        value = getattr(metrics, f.name)
        if f.name in ("serve", "gate"):
            out.update(value)
        elif f.name == "samples":
            continue  # strings travel in the ``samples`` ConfigRecord (eval_reply)
        elif value is not None:
            out[f.name.replace("_", "-")] = int(value) if isinstance(value, int) else value  # bool, NodeSource
    return out


def train_reply(msg: Message, blob: bytes, metrics: dict[str, int | float]) -> Message:
    """A ``train.fedkv`` reply (read by ``parse_train_reply``): the signed update and the metrics
    as ``metric_fields`` wrote them (a node keeps that dict to answer a repeated request)."""
    content = RecordDict({protocol.UPDATE: _update_record(blob), protocol.METRICS: MetricRecord(metrics)})
    return Message(content, reply_to=msg)


# -- 6. evaluate ----------------------------------------------------------------------------------------
EVAL_FIELDS = protocol.EVAL_METRICS


@guard
def parse_eval_reply(msg: Message) -> EvalMetrics:
    """MetricRecord ``metrics`` of an ``evaluate.fedkv`` reply."""
    M = protocol.METRICS
    with_samples = isinstance(msg, Message) and SAMPLES in msg.content.keys()
    recs = exact_records(msg, {M: MetricRecord, **({SAMPLES: ConfigRecord} if with_samples else {})})
    m = recs[M]
    exact_fields(M, m, EVAL_FIELDS, optional=("base-metric", *gate_report.GATE_FIELDS))
    return EvalMetrics(gate=gate_report.parse(m, M),
        base_metric=as_float(f"{M}.base-metric", m["base-metric"], 0.0) if "base-metric" in m else None,
        samples=_parse_samples(recs[SAMPLES]) if with_samples else [],
        num_examples=as_int(f"{M}.num-examples", m["num-examples"], 1, MAX_EXAMPLES),
        eval_loss=as_float(f"{M}.eval-loss", m["eval-loss"]),
        eval_metric=as_float(f"{M}.eval-metric", m["eval-metric"], 0.0),
        decrypt_s=as_seconds(f"{M}.decrypt-s", m["decrypt-s"]),
        writeback_s=as_seconds(f"{M}.writeback-s", m["writeback-s"]),
        eval_s=as_seconds(f"{M}.eval-s", m["eval-s"]),
        version=as_int(f"{M}.version", m["version"], 0, VERSION_MAX),
        node_source=as_int(f"{M}.node-source", m["node-source"], min(NODE_SOURCES), max(NODE_SOURCES)),
        pid=as_int(f"{M}.pid", m["pid"], 1, PID_MAX),
        kv_on_disk=as_int(f"{M}.kv-on-disk", m["kv-on-disk"], 0, MAX_KV_BLOCKS),
        **{f"{k}_s": as_seconds(f"{M}.{k}-s", m[f"{k}-s"]) for k in ("restore", "key", "serve", "save", "handler")},
        serve={**{k: as_int(f"{M}.{k}", m[k], 0, MAX_KV_BLOCKS) for k in protocol.SERVE_COUNTS},
               **{k: as_float(f"{M}.{k}", m[k], 0.0) for k in protocol.SERVE_AMOUNTS}},
    )


def eval_reply(msg: Message, metrics: EvalMetrics) -> Message:
    """An ``evaluate.fedkv`` reply (read by ``parse_eval_reply``)."""
    records: dict[str, Any] = {protocol.METRICS: MetricRecord(metric_fields(metrics))}
    if metrics.samples:
        records[SAMPLES] = ConfigRecord({"questions": [q for q, _ in metrics.samples],
                                         "replies": [r for _, r in metrics.samples]})
    return Message(RecordDict(records), reply_to=msg)


def _parse_samples(rec: ConfigRecord) -> list[tuple[str, str]]:
    exact_fields(SAMPLES, rec, ("questions", "replies"))
    qs, rs = rec["questions"], rec["replies"]
    if not isinstance(qs, list) or not isinstance(rs, list) or len(qs) != len(rs) or len(qs) > MAX_SAMPLES:
        raise BadReply(f"{SAMPLES}: questions and replies must be lists of equal length <= {MAX_SAMPLES}")
    return [(as_str(f"{SAMPLES}.questions", q, MAX_SAMPLE_CHARS), as_str(f"{SAMPLES}.replies", r, MAX_SAMPLE_CHARS))
            for q, r in zip(qs, rs)]


def serve_fields(report: Any) -> dict[str, int | float]:
    """A node's serving pass (``node.workload_pass.ServeReport``, or None: nothing served) as
    ``EvalMetrics.serve``: ``protocol.SERVE_COUNTS`` / ``SERVE_AMOUNTS`` by name (zeros: none)."""
    r = report
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


# -- 7. requests the server sends with a round: train / evaluate / noise -----------------------------
@dataclass(frozen=True)
class RoundRequest:
    """A ``train.fedkv`` / ``evaluate.fedkv`` request as a node reads it (``read_round_request``)."""

    server_round: int
    target_version: int
    """The global version the node must reach before it trains or evaluates."""
    num_sampled: int
    record: ArrayRecord | None
    """``protocol.AGGREGATES``: read on demand (``aggregates``), only by a node that catches up."""

    def aggregates(self) -> list[tuple[int, bytes, bytes]]:
        """[(version, aggregate, manifest or b"")] sorted by version (``protocol.unpack_aggregates``)."""
        return protocol.unpack_aggregates(self.record)


def round_request(message_type: str, node_id: int, server_round: int, history: list[tuple[bytes, bytes]],
                  have: int, num_sampled: int) -> Message:
    """The server's train/evaluate message to one node: the aggregates (and manifests) for the
    versions after ``have`` up to ``len(history)`` (the target) and the round's config."""
    target = len(history)
    content = RecordDict({
        protocol.AGGREGATES: protocol.pack_aggregates(history, have),
        protocol.CONFIG: ConfigRecord({"server-round": server_round, "target-version": target,
                                       "num-sampled": num_sampled}),
    })
    return Message(content, dst_node_id=node_id, message_type=message_type)


def read_round_request(msg: Message) -> RoundRequest:
    """The node's reading of ``round_request`` (the server is trusted with this message's shape:
    a field that is missing or not an int raises, which the node answers with an error)."""
    cfg = msg.content[protocol.CONFIG]
    return RoundRequest(int(cfg["server-round"]), int(cfg["target-version"]), int(cfg["num-sampled"]),
                        msg.content.array_records.get(protocol.AGGREGATES))


@dataclass(frozen=True)
class NoiseRequest:
    """A ``query.fedkv_noise`` request: make ``shares`` noise shares for a round of ``num_sampled``."""

    server_round: int
    shares: int
    num_sampled: int


def noise_request(node_id: int, request: NoiseRequest) -> Message:
    """The server asks a survivor for the noise shares of nodes that left the round."""
    rec = ConfigRecord({"server-round": request.server_round, "shares": request.shares,
                        "num-sampled": request.num_sampled})
    return Message(RecordDict({protocol.CONFIG: rec}), dst_node_id=node_id, message_type=protocol.NOISE)


def read_noise_request(msg: Message) -> NoiseRequest:
    """The node's reading of ``noise_request`` (range checks are the node's: ``client_app.noise``)."""
    req = msg.content[protocol.CONFIG]
    return NoiseRequest(int(req["server-round"]), int(req["shares"]), int(req["num-sampled"]))
