"""Typed parsers for the replies nodes send the server: check every field before use.

A node is not trusted to send well-formed replies (a bug, a version skew, a hostile node).
Each parser takes a reply ``Message`` (known not to carry an error) and returns a frozen
dataclass whose fields satisfy the documented types and ranges, or raises ``BadReply`` with a
short reason naming the record and field. Whatever the message contains (missing records,
other record kinds, wrong types, ``bool`` for ``int``, floats for ints, huge ints, NaN/inf,
lists for scalars, oversized or mis-framed arrays), no other exception escapes: the caller
drops that node from the round and records the reason. Reasons never echo more than ~40
characters of a client-supplied value.

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
6. Evaluate (``parse_eval_reply``): MetricRecord ``metrics``, see ``EVAL_FIELDS``.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from federation import protocol

__all__ = [
    "BUNDLES", "CTX", "KEYGEN", "NODE_KEYS", "PROVISIONED", "PUBLIC_CONTEXT", "UPDATE_KEY",
    "BadReply", "EnrollReply", "EvalMetrics", "KeygenReply", "ProvisionAck", "TrainMetrics",
    "TrainReply", "parse_enroll_reply", "parse_eval_reply", "parse_keygen_reply",
    "parse_noise_reply", "parse_provision_ack", "parse_train_reply", "safe_reason",
]

# -- record and field names ----------------------------------------------------------------
NODE_KEYS = "node-keys"
"""ConfigRecord of an enroll reply."""
KEYGEN = "keygen"
"""ConfigRecord of a keygen reply."""
BUNDLES = "bundles"
"""ArrayRecord of a keygen reply: one wrapped key bundle per member."""
PUBLIC_CONTEXT = "public-context"
"""ArrayRecord of a keygen reply holding the signed public context under ``CTX``."""
CTX = "ctx"
PROVISIONED = "provisioned"
"""ConfigRecord of a provision ack."""
UPDATE_KEY = "update"
"""The Array inside the ``protocol.UPDATE`` ArrayRecord (noise-share and train replies)."""

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
MAX_SECONDS = 1e6
VERSION_MAX = 2**31 - 1
PID_MAX = 2**31 - 1
MAX_KV_BLOCKS = 2**31 - 1
PARTITIONS_MAX = 2**31 - 1
MAX_NUM_VALUES = 2**40
NODE_SOURCES = (0, 1, 2)
_NPY_HEADER_MAX = 1024
"""Longest .npy header accepted (np.save writes ~118 bytes for a 1-D array)."""
_UINT8_DESCR = ("|u1", "<u1", ">u1", "u1")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]*")
_SHOW = 40
UNEXPECTED = "malformed reply ("
"""Prefix of the reason when a check this module lacks let some other exception through."""


class BadReply(ValueError):
    """A node's reply is malformed: drop the node from the round with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def safe_reason(exc: BaseException) -> str:
    """``"TypeName: first 120 chars of the message"`` for logging a drop reason; never raises."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - e.g. a huge int in the args (int->str limit)
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text[:120]}"


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


# -- showing client values without echoing them --------------------------------------------------
def _show(value: Any) -> str:
    """A short description of a client-supplied value (at most ~40 characters)."""
    try:
        if isinstance(value, bool):
            text = repr(value)
        elif isinstance(value, int):
            text = str(int(value)) if value.bit_length() <= 64 else f"<{value.bit_length()}-bit int>"
        elif isinstance(value, float):
            text = repr(float(value))
        elif isinstance(value, str):
            text = repr(value[:_SHOW]) + ("..." if len(value) > _SHOW else "")
        elif isinstance(value, (bytes, bytearray)):
            text = f"<{len(value)} bytes>"
        elif isinstance(value, list):
            text = f"<list of {len(value)}>"
        else:
            text = f"<{type(value).__name__}>"
    except Exception:  # noqa: BLE001
        text = "<?>"
    return text[: _SHOW + 8]


def _kind(value: Any) -> str:
    return type(value).__name__[:_SHOW]


# -- field checks ---------------------------------------------------------------------------------
def _int(where: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadReply(f"{where}: expected int, got {_kind(value)}")
    value = int(value)
    if not lo <= value <= hi:
        raise BadReply(f"{where}: {_show(value)} not in [{lo}, {hi}]")
    return value


def _flag(where: str, value: Any) -> bool:
    return bool(_int(where, value, 0, 1))


def _float(where: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *, allow_inf: bool = False) -> float:
    """A float (or an int, range-checked before conversion); finite unless allow_inf (NaN never)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadReply(f"{where}: expected float, got {_kind(value)}")
    if isinstance(value, int):
        value = int(value)
        if not lo <= value <= hi:  # exact int/float comparison, no overflow
            raise BadReply(f"{where}: {_show(value)} not in [{lo:g}, {hi:g}]")
        try:
            return float(value)
        except OverflowError:
            raise BadReply(f"{where}: {_show(value)} does not fit a float") from None
    value = float(value)
    if math.isnan(value):
        raise BadReply(f"{where}: NaN")
    if math.isinf(value) and not allow_inf:
        raise BadReply(f"{where}: {value!r} is not finite")
    if not lo <= value <= hi:
        raise BadReply(f"{where}: {_show(value)} not in [{lo:g}, {hi:g}]")
    return value


def _seconds(where: str, value: Any) -> float:
    return _float(where, value, 0.0, MAX_SECONDS)


def _bytes(where: str, value: Any, *lengths: int) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise BadReply(f"{where}: expected bytes, got {_kind(value)}")
    if len(value) not in lengths:
        want = " or ".join(str(n) for n in lengths)
        raise BadReply(f"{where}: {len(value)} bytes, expected {want}")
    return bytes(value)


def _str(where: str, value: Any, max_len: int) -> str:
    if not isinstance(value, str):
        raise BadReply(f"{where}: expected str, got {_kind(value)}")
    if len(value) > max_len:
        raise BadReply(f"{where}: {len(value)} characters, at most {max_len}")
    return str(value)


def _array_bytes(where: str, arr: Any, max_len: int) -> bytes:
    """The payload of a 1-D uint8 ``Array`` (1..max_len bytes), from its .npy framing.

    Parsed here rather than with ``Array.numpy()``: ``np.load`` allocates what the header
    claims before reading the data, so a 20-byte header could ask for terabytes.
    """
    if not isinstance(arr, Array):
        raise BadReply(f"{where}: expected an Array, got {_kind(arr)}")
    stype, data = getattr(arr, "stype", None), getattr(arr, "data", None)
    if stype != "numpy.ndarray":
        raise BadReply(f"{where}: array serialization {_show(stype)} is not numpy.ndarray")
    if not isinstance(data, bytes):
        raise BadReply(f"{where}: array data is {_kind(data)}, not bytes")
    if len(data) > max_len + _NPY_HEADER_MAX + 12:
        raise BadReply(f"{where}: {len(data)} bytes, at most {max_len}")
    if len(data) < 10 or data[:6] != b"\x93NUMPY":
        raise BadReply(f"{where}: not .npy data")
    major, minor = data[6], data[7]
    if minor != 0:
        raise BadReply(f"{where}: unsupported .npy version {major}.{minor}")
    if major == 1:
        start, hlen = 10, int.from_bytes(data[8:10], "little")
    elif major in (2, 3) and len(data) >= 12:
        start, hlen = 12, int.from_bytes(data[8:12], "little")
    else:
        raise BadReply(f"{where}: unsupported .npy version {major}")
    if hlen > _NPY_HEADER_MAX or start + hlen > len(data):
        raise BadReply(f"{where}: bad .npy header length {hlen}")
    try:
        header = ast.literal_eval(data[start : start + hlen].decode("utf-8" if major == 3 else "latin1"))
    except Exception:  # noqa: BLE001 - SyntaxError, ValueError, RecursionError, MemoryError...
        raise BadReply(f"{where}: unreadable .npy header") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise BadReply(f"{where}: bad .npy header")
    descr, shape = header["descr"], header["shape"]
    if not isinstance(descr, str) or descr not in _UINT8_DESCR:
        raise BadReply(f"{where}: dtype {_show(descr)} is not uint8")
    if not isinstance(header["fortran_order"], bool):
        raise BadReply(f"{where}: bad .npy header")
    if not isinstance(shape, tuple) or len(shape) != 1 or type(shape[0]) is not int:
        raise BadReply(f"{where}: shape {_show(str(shape))} is not 1-D")
    payload = data[start + hlen :]
    if shape[0] != len(payload):
        raise BadReply(f"{where}: header says {_show(shape[0])} bytes, data has {len(payload)}")
    if not 1 <= len(payload) <= max_len:
        raise BadReply(f"{where}: {len(payload)} bytes, expected 1..{max_len}")
    return payload


# -- records ---------------------------------------------------------------------------------------
R = TypeVar("R")


def _records(msg: Any, expected: Mapping[str, type[R]]) -> dict[str, Any]:
    """The reply's records, exactly ``expected`` (name -> record class), nothing else."""
    if not isinstance(msg, Message):
        raise BadReply(f"not a Message: {_kind(msg)}")
    if msg.has_error():
        raise BadReply("reply carries an error")
    content = msg.content
    out: dict[str, Any] = {}
    for name, kind in expected.items():
        rec = content.get(name)
        if rec is None:
            raise BadReply(f"reply has no {kind.__name__} {name!r}")
        if type(rec) is not kind:
            raise BadReply(f"{name}: expected a {kind.__name__}, got {_kind(rec)}")
        out[name] = rec
    for name in content.keys():
        if name not in expected:
            raise BadReply(f"reply has an unexpected record {_show(name)}")
    return out


def _fields(name: str, rec: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = (),
            forbidden: tuple[str, ...] = (), why_forbidden: str = "") -> None:
    """Every key of ``rec`` is known (and not forbidden); every required key is present."""
    for key in rec.keys():
        if key in forbidden:
            raise BadReply(f"{name}.{key}: must be absent{why_forbidden}")
        if key not in required and key not in optional:
            raise BadReply(f"{name}: unknown field {_show(key)}")
    for key in required:
        if key not in rec:
            raise BadReply(f"{name}: missing field {key!r}")


def _guard(fn: Callable[..., R]) -> Callable[..., R]:
    """Belt and braces: an exception a check missed still becomes a ``BadReply``."""

    @functools.wraps(fn)
    def parse(*args: Any, **kwargs: Any) -> R:
        try:
            return fn(*args, **kwargs)
        except BadReply:
            raise
        except Exception as err:  # noqa: BLE001 - the contract: BadReply only
            raise BadReply(f"{UNEXPECTED}{type(err).__name__})") from None

    return parse


# -- 1. enroll -------------------------------------------------------------------------------------
ENROLL_FIELDS = ("node-id", "name", "kx-public", "sign-public", "epoch", "key-id", "partition-id", "num-partitions")


def parse_enroll_reply(msg: Message, expected_node_id: str) -> EnrollReply:
    """ConfigRecord ``node-keys`` of a ``query.fedkv_enroll`` reply."""
    if not isinstance(expected_node_id, str):
        raise TypeError("expected_node_id must be a str")
    return _parse_enroll(msg, expected_node_id)


@_guard
def _parse_enroll(msg: Message, expected_node_id: str) -> EnrollReply:
    rec = _records(msg, {NODE_KEYS: ConfigRecord})[NODE_KEYS]
    _fields(NODE_KEYS, rec, ENROLL_FIELDS)
    f = f"{NODE_KEYS}."
    node_id = _str(f + "node-id", rec["node-id"], NAME_MAX)
    if node_id != expected_node_id:
        raise BadReply(f"{f}node-id: reply claims node id {_show(node_id)}")
    name = _str(f + "name", rec["name"], NAME_MAX)
    if not _NAME_RE.fullmatch(name):
        raise BadReply(f"{f}name: {_show(name)} has characters outside [A-Za-z0-9._-]")
    kx = _bytes(f + "kx-public", rec["kx-public"], PUBLIC_KEY_BYTES)
    sign = _bytes(f + "sign-public", rec["sign-public"], PUBLIC_KEY_BYTES)
    epoch = _int(f + "epoch", rec["epoch"], -1, EPOCH_MAX)
    key_id = _bytes(f + "key-id", rec["key-id"], KEY_ID_BYTES if epoch >= 0 else 0)
    num_partitions = _int(f + "num-partitions", rec["num-partitions"], 1, PARTITIONS_MAX)
    partition = _int(f + "partition-id", rec["partition-id"], 0, num_partitions - 1)
    return EnrollReply(node_id, name, kx, sign, epoch, key_id, partition, num_partitions)


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


@_guard
def _parse_keygen(msg: Message, expected: frozenset[str], expected_epoch: int) -> KeygenReply:
    recs = _records(msg, {KEYGEN: ConfigRecord, BUNDLES: ArrayRecord, PUBLIC_CONTEXT: ArrayRecord})
    rec = recs[KEYGEN]
    _fields(KEYGEN, rec, KEYGEN_FIELDS)
    f = f"{KEYGEN}."
    epoch = _int(f + "epoch", rec["epoch"], 0, EPOCH_MAX)
    if epoch != expected_epoch:
        raise BadReply(f"{f}epoch: {epoch}, expected {expected_epoch}")
    key_id = _bytes(f + "key-id", rec["key-id"], KEY_ID_BYTES)
    members = rec["members"]
    if not isinstance(members, list):
        raise BadReply(f"{f}members: expected a list of str, got {_kind(members)}")
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise BadReply(f"{f}members: {len(members)} entries, expected 1..{MAX_MEMBERS}")
    for m in members:
        if not isinstance(m, str):
            raise BadReply(f"{f}members: expected a list of str, got an entry of {_kind(m)}")
    got = {str(m) for m in members}
    if len(got) != len(members):
        raise BadReply(f"{f}members: repeated entries")
    if got != expected:
        extra, lacking = sorted(got - expected), sorted(expected - got)
        detail = f"unexpected {_show(extra[0])}" if extra else f"lacks {_show(lacking[0])}"
        raise BadReply(f"{f}members: not the expected members ({detail})")
    bundles_rec = recs[BUNDLES]
    for key in bundles_rec.keys():
        if key not in got:
            raise BadReply(f"{BUNDLES}: entry {_show(key)} is not a member")
    bundles: dict[str, bytes] = {}
    for m in sorted(got):
        if m not in bundles_rec:
            raise BadReply(f"{BUNDLES}: no bundle for member {_show(m)}")
        bundles[m] = _array_bytes(f"{BUNDLES}.{_show(m)}", bundles_rec[m], MAX_BUNDLE_BYTES)
    ctx_rec = recs[PUBLIC_CONTEXT]
    _fields(PUBLIC_CONTEXT, ctx_rec, (CTX,))
    ctx = _array_bytes(f"{PUBLIC_CONTEXT}.{CTX}", ctx_rec[CTX], MAX_CONTEXT_BYTES)
    return KeygenReply(epoch, key_id, bundles, ctx)


# -- 3. provision ack ------------------------------------------------------------------------------
PROVISIONED_FIELDS = ("key-id", "epoch")


@_guard
def parse_provision_ack(msg: Message) -> ProvisionAck:
    """ConfigRecord ``provisioned`` of a ``query.fedkv_provision`` reply (caller compares)."""
    rec = _records(msg, {PROVISIONED: ConfigRecord})[PROVISIONED]
    _fields(PROVISIONED, rec, PROVISIONED_FIELDS)
    key_id = _bytes(f"{PROVISIONED}.key-id", rec["key-id"], KEY_ID_BYTES)
    epoch = _int(f"{PROVISIONED}.epoch", rec["epoch"], 0, EPOCH_MAX)
    return ProvisionAck(key_id, epoch)


# -- 4. noise share ----------------------------------------------------------------------------------
def _update(rec: ArrayRecord) -> bytes:
    _fields(protocol.UPDATE, rec, (UPDATE_KEY,))
    return _array_bytes(f"{protocol.UPDATE}.{UPDATE_KEY}", rec[UPDATE_KEY], MAX_UPDATE_BYTES)


@_guard
def parse_noise_reply(msg: Message) -> bytes:
    """The noise-share bytes (ArrayRecord ``update`` {``update``})."""
    return _update(_records(msg, {protocol.UPDATE: ArrayRecord})[protocol.UPDATE])


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


@_guard
def _parse_train(msg: Message, dp: bool, dim: int) -> TrainReply:
    recs = _records(msg, {protocol.UPDATE: ArrayRecord, protocol.METRICS: MetricRecord})
    m = recs[protocol.METRICS]
    M = protocol.METRICS
    if dp:
        _fields(M, m, TRAIN_REQUIRED, TRAIN_OPTIONAL, TRAIN_NON_DP, " under DP")
    else:
        _fields(M, m, TRAIN_REQUIRED + TRAIN_NON_DP, TRAIN_OPTIONAL)

    def w(key: str) -> str:
        return f"{M}.{key}"

    num_values = _int(w("num-values"), m["num-values"], 0, MAX_NUM_VALUES)
    if num_values != dim:
        raise BadReply(f"{w('num-values')}: {num_values}, expected {dim}")
    extra: dict[str, Any] = {}
    if "epsilon-sample" in m:
        extra["epsilon_sample"] = _float(w("epsilon-sample"), m["epsilon-sample"], 0.0, allow_inf=True)
    if not dp:
        extra["train_loss"] = _float(w("train-loss"), m["train-loss"])
        extra["clipped"] = _flag(w("clipped"), m["clipped"])
        extra["delta_norm"] = _float(w("delta-norm"), m["delta-norm"], 0.0)
        extra["saturated"] = _int(w("saturated"), m["saturated"], 0, num_values)
    metrics = TrainMetrics(
        num_examples=_int(w("num-examples"), m["num-examples"], 0, MAX_EXAMPLES),
        upload_bytes=_int(w("upload-bytes"), m["upload-bytes"], 0, MAX_UPLOAD_BYTES),
        num_values=num_values,
        weight_capped=_flag(w("weight-capped"), m["weight-capped"]),
        train_s=_seconds(w("train-s"), m["train-s"]),
        encrypt_s=_seconds(w("encrypt-s"), m["encrypt-s"]),
        sign_s=_seconds(w("sign-s"), m["sign-s"]),
        decrypt_s=_seconds(w("decrypt-s"), m["decrypt-s"]),
        writeback_s=_seconds(w("writeback-s"), m["writeback-s"]),
        version=_int(w("version"), m["version"], 0, VERSION_MAX),
        node_source=_int(w("node-source"), m["node-source"], min(NODE_SOURCES), max(NODE_SOURCES)),
        pid=_int(w("pid"), m["pid"], 1, PID_MAX),
        kv_on_disk=_int(w("kv-on-disk"), m["kv-on-disk"], 0, MAX_KV_BLOCKS),
        **{f"{k}_s": _seconds(w(f"{k}-s"), m[f"{k}-s"]) for k in ("restore", "key", "save", "handler")},
        **extra,
    )
    return TrainReply(_update(recs[protocol.UPDATE]), metrics)


# -- 6. evaluate ----------------------------------------------------------------------------------------
EVAL_FIELDS = protocol.EVAL_METRICS


@_guard
def parse_eval_reply(msg: Message) -> EvalMetrics:
    """MetricRecord ``metrics`` of an ``evaluate.fedkv`` reply."""
    M = protocol.METRICS
    m = _records(msg, {M: MetricRecord})[M]
    _fields(M, m, EVAL_FIELDS)
    return EvalMetrics(
        num_examples=_int(f"{M}.num-examples", m["num-examples"], 1, MAX_EXAMPLES),
        eval_loss=_float(f"{M}.eval-loss", m["eval-loss"]),
        eval_metric=_float(f"{M}.eval-metric", m["eval-metric"], 0.0),
        decrypt_s=_seconds(f"{M}.decrypt-s", m["decrypt-s"]),
        writeback_s=_seconds(f"{M}.writeback-s", m["writeback-s"]),
        eval_s=_seconds(f"{M}.eval-s", m["eval-s"]),
        version=_int(f"{M}.version", m["version"], 0, VERSION_MAX),
        node_source=_int(f"{M}.node-source", m["node-source"], min(NODE_SOURCES), max(NODE_SOURCES)),
        pid=_int(f"{M}.pid", m["pid"], 1, PID_MAX),
        kv_on_disk=_int(f"{M}.kv-on-disk", m["kv-on-disk"], 0, MAX_KV_BLOCKS),
        **{f"{k}_s": _seconds(f"{M}.{k}-s", m[f"{k}-s"]) for k in ("restore", "key", "serve", "save", "handler")},
        serve={**{k: _int(f"{M}.{k}", m[k], 0, MAX_KV_BLOCKS) for k in protocol.SERVE_COUNTS},
               **{k: _float(f"{M}.{k}", m[k], 0.0) for k in protocol.SERVE_AMOUNTS}},
    )
