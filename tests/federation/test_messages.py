"""federation.messages: every reply field is checked; a malformed reply is a BadReply, never a crash."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from federation import messages, protocol
from federation.messages import (
    BUNDLES, CTX, KEYGEN, NODE_KEYS, PROVISIONED, PUBLIC_CONTEXT, UNEXPECTED, UPDATE_KEY, BadReply,
    parse_enroll_reply, parse_eval_reply, parse_keygen_reply, parse_noise_reply, parse_provision_ack,
    parse_train_reply, safe_reason,
)
from tests.federation.fakes import set_server_identity

MiB = 1 << 20
NODE = 101
DIM = 1000
KEY_ID = bytes(range(16))
MEMBERS = ["101", "102", "103"]
LONG = "X" * 200
"""A client-supplied string no reason may echo in full."""

set_server_identity()


def reply(records: dict[str, Any], node: int = NODE) -> Message:
    """A reply as a node sends it: ``Message(content, reply_to=<the server's message>)``."""
    orig = Message(RecordDict({}), dst_node_id=node, message_type="query.fedkv_test")
    return Message(RecordDict(records), reply_to=orig)


def arr(blob: bytes) -> Array:
    return protocol.bytes_to_array(blob)


def npy(payload: bytes, descr: str = "|u1", shape: tuple = None) -> Array:
    """An Array with a hand-made .npy header (which may lie about the data)."""
    buf = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": (len(payload),) if shape is None else shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return Array("uint8", (len(payload),), "numpy.ndarray", buf.getvalue() + payload)


# -- valid replies, as specs {record name: (kind, {field: value})} --------------------------------
def enroll_spec() -> dict:
    return {NODE_KEYS: ("config", {
        "node-id": str(NODE), "name": "kit-a.1_B", "kx-public": b"k" * 32, "sign-public": b"s" * 32,
        "epoch": 0, "key-id": KEY_ID, "partition-id": 1, "num-partitions": 3,
    })}


def keygen_spec() -> dict:
    return {
        KEYGEN: ("config", {"epoch": 3, "key-id": KEY_ID, "members": list(MEMBERS)}),
        BUNDLES: ("array", {m: arr(f"bundle-{m}".encode() * 10) for m in MEMBERS}),
        PUBLIC_CONTEXT: ("array", {CTX: arr(b"signed-public-context" * 10)}),
    }


def ack_spec() -> dict:
    return {PROVISIONED: ("config", {"key-id": KEY_ID, "epoch": 0})}


def noise_spec() -> dict:
    return {protocol.UPDATE: ("array", {UPDATE_KEY: arr(b"noise-share" * 20)})}


def train_metrics(dp: bool) -> dict:
    m = {
        "num-examples": 120, "upload-bytes": 4091, "num-values": DIM, "weight-capped": 0,
        "train-s": 0.5, "encrypt-s": 0.01, "sign-s": 0.001, "decrypt-s": 0, "writeback-s": 0.002,
        "restore-s": 0.003, "key-s": 0.001, "save-s": 0.004, "handler-s": 0.6,
        "version": 2, "node-source": 2, "pid": 4242, "kv-on-disk": 12,
    }
    if dp:
        m["epsilon-sample"] = 1.5
    else:
        m.update({"train-loss": 0.7, "clipped": 1, "delta-norm": 2.5, "saturated": 3})
    return m


def train_spec(dp: bool = False) -> dict:
    return {protocol.UPDATE: ("array", {UPDATE_KEY: arr(b"signed-update" * 30)}),
            protocol.METRICS: ("metric", train_metrics(dp))}


def eval_spec() -> dict:
    return {protocol.METRICS: ("metric", {
        "num-examples": 30, "eval-loss": 0.4, "eval-metric": 0.9, "decrypt-s": 0.1, "writeback-s": 0.0,
        "eval-s": 0.2, "restore-s": 0.01, "key-s": 0.0, "serve-s": 0.03, "save-s": 0.02, "handler-s": 0.4,
        "version": 3, "node-source": 0, "pid": 7, "kv-on-disk": 0,
        **SERVE_SPEC,
    })}


SERVE_SPEC = {**{k: i for i, k in enumerate(protocol.SERVE_COUNTS)},
              **{k: 0.5 + i for i, k in enumerate(protocol.SERVE_AMOUNTS)}}
"""A serving pass's counts (ints) and amounts (floats), all distinct."""


KINDS = {"config": ConfigRecord, "metric": MetricRecord, "array": ArrayRecord}


def build(spec: dict, node: int = NODE) -> Message:
    return reply({name: KINDS[kind](dict(fields)) for name, (kind, fields) in spec.items()}, node)


def with_field(spec: dict, record: str, key: str, value: Any) -> Message:
    spec = copy.deepcopy(spec)
    spec[record][1][key] = value
    return build(spec)


def reason_of(parse: Callable[[], Any]) -> str:
    with pytest.raises(BadReply) as info:
        parse()
    reason = info.value.reason
    assert not reason.startswith(UNEXPECTED), reason
    return reason


# -- happy paths ------------------------------------------------------------------------------------
def test_enroll_reply_parses() -> None:
    r = parse_enroll_reply(build(enroll_spec()), str(NODE))
    assert r == messages.EnrollReply(str(NODE), "kit-a.1_B", b"k" * 32, b"s" * 32, 0, KEY_ID, 1, 3)
    spec = enroll_spec()
    spec[NODE_KEYS][1].update({"epoch": -1, "key-id": b"", "name": ""})
    r = parse_enroll_reply(build(spec), str(NODE))
    assert (r.epoch, r.key_id, r.name) == (-1, b"", "")


def test_keygen_reply_parses() -> None:
    r = parse_keygen_reply(build(keygen_spec()), list(reversed(MEMBERS)), 3)
    assert r.epoch == 3 and r.key_id == KEY_ID
    assert r.bundles == {m: f"bundle-{m}".encode() * 10 for m in MEMBERS}
    assert r.signed_public_context == b"signed-public-context" * 10


def test_provision_ack_parses() -> None:
    assert parse_provision_ack(build(ack_spec())) == messages.ProvisionAck(KEY_ID, 0)


def test_noise_reply_parses() -> None:
    assert parse_noise_reply(build(noise_spec())) == b"noise-share" * 20


@pytest.mark.parametrize("dp", [False, True])
def test_train_reply_parses(dp: bool) -> None:
    r = parse_train_reply(build(train_spec(dp)), dp=dp, dim=DIM)
    assert r.blob == b"signed-update" * 30
    m = r.metrics
    assert (m.num_examples, m.upload_bytes, m.num_values, m.weight_capped) == (120, 4091, DIM, False)
    assert (m.version, m.node_source, m.pid) == (2, 2, 4242)
    assert m.decrypt_s == 0.0 and isinstance(m.decrypt_s, float)
    if dp:
        assert m.epsilon_sample == 1.5
        assert (m.train_loss, m.clipped, m.delta_norm, m.saturated) == (None, None, None, None)
    else:
        assert m.epsilon_sample is None
        assert (m.train_loss, m.clipped, m.delta_norm, m.saturated) == (0.7, True, 2.5, 3)


def test_train_reply_accepts_infinite_sample_epsilon_and_numpy_floats() -> None:
    spec = train_spec(dp=True)
    spec[protocol.METRICS][1]["epsilon-sample"] = math.inf
    spec[protocol.METRICS][1]["train-s"] = np.float64(1.25)  # what a node's numpy maths gives
    m = parse_train_reply(build(spec), dp=True, dim=DIM).metrics
    assert m.epsilon_sample == math.inf and type(m.train_s) is float and m.train_s == 1.25


def test_eval_reply_parses() -> None:
    r = parse_eval_reply(build(eval_spec()))
    assert r == messages.EvalMetrics(30, 0.4, 0.9, 0.1, 0.0, 0.2, 3, 0, 7, 0, 0.01, 0.0, 0.03, 0.02, 0.4,
                                    SERVE_SPEC)


def test_eval_reply_refuses_bad_serving_counts() -> None:
    for key, bad in (("serve-turns", -1), ("serve-turns", 2.5), ("serve-nll", math.nan),
                     ("serve-busy-s", -0.1), ("serve-recomputed", 2**31)):
        spec = eval_spec()
        spec[protocol.METRICS][1][key] = bad
        assert key in reason_of(lambda: parse_eval_reply(build(spec)))


def test_a_large_update_parses() -> None:
    blob = bytes(10 * MiB)
    spec = noise_spec()
    spec[protocol.UPDATE][1][UPDATE_KEY] = arr(blob)
    assert parse_noise_reply(build(spec)) == blob


# -- the reported crashes (issue 8, item 4) ---------------------------------------------------------
def test_enroll_kx_public_huge_int_is_a_bad_reply_not_a_memory_error() -> None:
    reason = reason_of(lambda: parse_enroll_reply(with_field(enroll_spec(), NODE_KEYS, "kx-public", 10**15), "101"))
    assert reason == "node-keys.kx-public: expected bytes, got int"


def test_provision_ack_infinite_epoch_is_a_bad_reply_not_an_overflow() -> None:
    reason = reason_of(lambda: parse_provision_ack(with_field(ack_spec(), PROVISIONED, "epoch", math.inf)))
    assert reason == "provisioned.epoch: expected int, got float"


def test_eval_infinite_version_is_a_bad_reply_not_an_overflow() -> None:
    reason = reason_of(lambda: parse_eval_reply(with_field(eval_spec(), protocol.METRICS, "version", math.inf)))
    assert reason == "metrics.version: expected int, got float"


def test_train_list_num_examples_is_a_bad_reply_not_a_type_error() -> None:
    msg = with_field(train_spec(), protocol.METRICS, "num-examples", [1, 2])
    assert reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM)) == "metrics.num-examples: expected int, got list"


# -- specific rules ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, says", [
    (2.0, "expected int, got float"), (-1, "not in [0, 1000000000]"),
    (10**9 + 1, "not in [0"), (2**4000, "<4001-bit int> not in"), ([], "got list"),
])
def test_int_fields_reject_bools_floats_and_out_of_range(value: Any, says: str) -> None:
    msg = with_field(train_spec(), protocol.METRICS, "num-examples", value)
    assert says in reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM))


def test_a_bool_is_not_an_int() -> None:
    """MetricRecords refuse bools; ConfigRecords carry them."""
    for value in (True, False):
        msg = with_field(ack_spec(), PROVISIONED, "epoch", value)
        assert reason_of(lambda: parse_provision_ack(msg)) == "provisioned.epoch: expected int, got bool"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.5, 1e6 + 1, 10**400, -1])
def test_seconds_are_finite_and_in_range(value: Any) -> None:
    msg = with_field(eval_spec(), protocol.METRICS, "eval-s", value)
    assert reason_of(lambda: parse_eval_reply(msg)).startswith("metrics.eval-s: ")


@pytest.mark.parametrize("key, value", [("pid", 0), ("pid", 2**31), ("node-source", 3), ("version", -1),
                                        ("weight-capped", 2), ("upload-bytes", 2**40 + 1), ("clipped", -1)])
def test_train_identity_and_flag_ranges(key: str, value: int) -> None:
    msg = with_field(train_spec(), protocol.METRICS, key, value)
    assert reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM)).startswith(f"metrics.{key}: {value} not in [")


def test_update_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "MAX_UPDATE_BYTES", 100)  # 256 MiB arrays are too big for a unit test
    spec = train_spec()
    spec[protocol.UPDATE][1][UPDATE_KEY] = arr(bytes(101))
    assert reason_of(lambda: parse_train_reply(build(spec), dp=False, dim=DIM)) == "update.update: 101 bytes, expected 1..100"
    spec[protocol.UPDATE][1][UPDATE_KEY] = arr(bytes(100))
    assert parse_train_reply(build(spec), dp=False, dim=DIM).blob == bytes(100)


def test_a_float_field_with_a_huge_int_does_not_overflow() -> None:
    msg = with_field(train_spec(), protocol.METRICS, "train-loss", 10**400)
    assert reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM)) == "metrics.train-loss: <1329-bit int> does not fit a float"


def test_sample_epsilon_may_be_infinite_but_not_nan_or_negative() -> None:
    for bad in (math.nan, -1e-9, -math.inf):
        msg = with_field(train_spec(True), protocol.METRICS, "epsilon-sample", bad)
        assert reason_of(lambda: parse_train_reply(msg, dp=True, dim=DIM)).startswith("metrics.epsilon-sample")


@pytest.mark.parametrize("key", messages.TRAIN_NON_DP)
def test_under_dp_private_metrics_must_be_absent(key: str) -> None:
    msg = with_field(train_spec(dp=True), protocol.METRICS, key, 0)
    assert reason_of(lambda: parse_train_reply(msg, dp=True, dim=DIM)) == f"metrics.{key}: must be absent under DP"


@pytest.mark.parametrize("key", messages.TRAIN_NON_DP)
def test_without_dp_training_metrics_are_required(key: str) -> None:
    spec = train_spec(dp=False)
    del spec[protocol.METRICS][1][key]
    assert reason_of(lambda: parse_train_reply(build(spec), dp=False, dim=DIM)) == f"metrics: missing field {key!r}"


def test_train_num_values_and_saturated_are_tied_to_dim() -> None:
    msg = with_field(train_spec(), protocol.METRICS, "num-values", DIM + 1)
    assert reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM)) == f"metrics.num-values: {DIM + 1}, expected {DIM}"
    msg = with_field(train_spec(), protocol.METRICS, "saturated", DIM + 1)
    assert "saturated" in reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM))


def test_unknown_metric_key_is_named_and_truncated() -> None:
    msg = with_field(train_spec(), protocol.METRICS, "k" * 100, 1)
    reason = reason_of(lambda: parse_train_reply(msg, dp=False, dim=DIM))
    assert reason.startswith("metrics: unknown field 'kkkk") and "k" * 45 not in reason


def test_missing_record_wrong_kind_and_extra_record() -> None:
    assert reason_of(lambda: parse_eval_reply(reply({}))) == "reply has no MetricRecord 'metrics'"
    as_config = reply({protocol.METRICS: ConfigRecord(dict(eval_spec()[protocol.METRICS][1]))})
    assert reason_of(lambda: parse_eval_reply(as_config)) == "metrics: expected a MetricRecord, got ConfigRecord"
    spec = eval_spec()
    spec["extra"] = ("config", {})
    assert reason_of(lambda: parse_eval_reply(build(spec))) == "reply has an unexpected record 'extra'"


def test_enroll_rules() -> None:
    def enroll_reason(key: str, value: Any, expected: str = "101") -> str:
        return reason_of(lambda: parse_enroll_reply(with_field(enroll_spec(), NODE_KEYS, key, value), expected))

    assert enroll_reason("node-id", "102") == "node-keys.node-id: reply claims node id '102'"
    assert enroll_reason("node-id", LONG).endswith("at most 64")
    assert "outside" in enroll_reason("name", "kit/../x")
    assert "outside" in enroll_reason("name", "kit\n")
    assert enroll_reason("name", "a" * 65) == "node-keys.name: 65 characters, at most 64"
    assert enroll_reason("sign-public", b"s" * 31) == "node-keys.sign-public: 31 bytes, expected 32"
    assert enroll_reason("epoch", 2**31) == "node-keys.epoch: 2147483648 not in [-1, 2147483647]"
    assert enroll_reason("key-id", b"") == "node-keys.key-id: 0 bytes, expected 16"  # epoch 0 needs a key id
    spec = enroll_spec()
    spec[NODE_KEYS][1]["epoch"] = -1
    assert reason_of(lambda: parse_enroll_reply(build(spec), "101")) == "node-keys.key-id: 16 bytes, expected 0"


def test_keygen_rules() -> None:
    def keygen_reason(spec: dict, members: list[str] = MEMBERS, epoch: int = 3) -> str:
        return reason_of(lambda: parse_keygen_reply(build(spec), members, epoch))

    assert keygen_reason(keygen_spec(), epoch=4) == "keygen.epoch: 3, expected 4"
    assert keygen_reason(keygen_spec(), members=MEMBERS + ["104"]) == "keygen.members: not the expected members (lacks '104')"
    spec = keygen_spec()
    spec[KEYGEN][1]["members"] = MEMBERS + ["101"]
    assert keygen_reason(spec) == "keygen.members: repeated entries"
    spec[KEYGEN][1]["members"] = []
    assert keygen_reason(spec) == "keygen.members: 0 entries, expected 1..1024"
    spec[KEYGEN][1]["members"] = [str(i) for i in range(1025)]
    assert keygen_reason(spec) == "keygen.members: 1025 entries, expected 1..1024"
    spec = keygen_spec()
    del spec[BUNDLES][1]["102"]
    assert keygen_reason(spec) == "bundles: no bundle for member '102'"
    spec = keygen_spec()
    spec[BUNDLES][1]["999"] = arr(b"x")
    assert keygen_reason(spec) == "bundles: entry '999' is not a member"
    spec = keygen_spec()
    spec[BUNDLES][1]["101"] = arr(bytes(8 * MiB + 1))
    assert keygen_reason(spec) == f"bundles.'101': {8 * MiB + 1} bytes, expected 1..{8 * MiB}"
    spec = keygen_spec()
    spec[PUBLIC_CONTEXT][1]["other"] = arr(b"x")
    assert keygen_reason(spec) == "public-context: unknown field 'other'"


def test_array_framing_is_checked_before_anything_is_allocated() -> None:
    def update_reason(a: Array) -> str:
        spec = noise_spec()
        spec[protocol.UPDATE][1][UPDATE_KEY] = a
        return reason_of(lambda: parse_noise_reply(build(spec)))

    # a 100-byte array whose header claims a terabyte: np.load would try to allocate it
    assert update_reason(npy(b"x" * 100, shape=(10**12,))) == "update.update: header says 1000000000000 bytes, data has 100"
    assert update_reason(npy(b"x" * 100, shape=(99,))) == "update.update: header says 99 bytes, data has 100"
    assert update_reason(Array(np.zeros(4, dtype=np.float32))) == "update.update: dtype '<f4' is not uint8"
    assert update_reason(Array(np.zeros((2, 2), dtype=np.uint8))).endswith("is not 1-D")
    assert update_reason(Array(np.array(7, dtype=np.uint8))).endswith("is not 1-D")
    assert update_reason(arr(b"")) == f"update.update: 0 bytes, expected 1..{256 * MiB}"
    assert update_reason(Array("uint8", (3,), "torch", b"abc")).endswith("is not numpy.ndarray")
    assert update_reason(Array("uint8", (3,), "numpy.ndarray", b"abc")) == "update.update: not .npy data"
    assert update_reason(Array("uint8", (3,), "numpy.ndarray", b"\x93NUMPY\x01\x00\xff\x00{'descr'")).startswith(
        "update.update: bad .npy header length")
    assert update_reason(npy(b"x", descr=LONG)) == f"update.update: dtype '{'X' * 40}'... is not uint8"


def test_reasons_never_echo_long_client_values() -> None:
    for key, value in [("name", LONG), ("node-id", LONG), ("kx-public", LONG.encode())]:
        reason = reason_of(lambda: parse_enroll_reply(with_field(enroll_spec(), NODE_KEYS, key, value), LONG))
        assert "X" * 41 not in reason


@pytest.mark.parametrize("dp", [False, True])
def test_a_train_reply_for_the_other_dp_mode_is_refused(dp: bool) -> None:
    reason = reason_of(lambda: parse_train_reply(build(train_spec(not dp)), dp=dp, dim=DIM))
    assert reason == ("metrics.train-loss: must be absent under DP" if dp else "metrics: missing field 'train-loss'")


def test_safe_reason() -> None:
    assert safe_reason(ValueError("x" * 500)) == "ValueError: " + "x" * 120
    assert safe_reason(BadReply("metrics.pid: expected int, got str")) == "BadReply: metrics.pid: expected int, got str"

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert safe_reason(Unprintable()) == "Unprintable: <unprintable>"
    assert safe_reason(ValueError(10**5000)) == "ValueError: <unprintable>"  # int->str digit limit


def test_bad_caller_arguments_are_the_servers_bug_not_a_bad_reply() -> None:
    with pytest.raises(ValueError):
        parse_keygen_reply(build(keygen_spec()), [], 3)
    with pytest.raises(ValueError):
        parse_train_reply(build(train_spec()), dp=False, dim=0)
    with pytest.raises(TypeError):
        parse_enroll_reply(build(enroll_spec()), NODE)  # type: ignore[arg-type]


def test_the_guard_turns_a_missed_check_into_a_bad_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise KeyError("a check this module lacks")

    monkeypatch.setattr(messages, "exact_records", broken)
    with pytest.raises(BadReply, match=r"^malformed reply \(KeyError\)$"):
        parse_eval_reply(build(eval_spec()))


# -- properties: mutate a valid reply; the parser agrees with an independent oracle --------------------
# The oracle below restates the formats with plain type/range checks (and numpy's own .npy header
# reader for arrays). Property: the parser returns exactly what the oracle expects, or raises
# BadReply (short, no echo, not the guard's fallback) exactly when the oracle rejects the reply.

HOSTILE_SCALARS = [
    math.nan, math.inf, -math.inf, 2**62, -(2**62), 2**63 - 1, -(2**63), 2**31, 2**31 - 1, 10**15,
    10**400, -(10**400), -1, 0, 1, 2, 3, 2.5, 1.0, 0.0, -0.0, 1e300, -1e-300,
]
EDGES: dict[str, list] = {
    "node-id": ["101", "102", "", " 101", "101\n"],
    "name": ["", "a" * 64, "a" * 65, "a b", "a/b", "é", "kit.1_-", "A-Z.0"],
    "kx-public": [b"\1" * 31, b"\1" * 32, b"\1" * 33, b""],
    "sign-public": [b"\1" * 31, b"\1" * 32, b"\1" * 33],
    "epoch": [-2, -1, 0, 1, 3, 4, 2**31 - 1, 2**31, True, False, 3.0],
    "key-id": [b"", b"\1" * 15, b"\1" * 16, b"\1" * 17],
    "partition-id": [-1, 0, 1, 2, 3, 2**31 - 1, True, 1.0],
    "num-partitions": [-1, 0, 1, 2, 3, 2**31 - 1, 2**31, False, 3.0],
    "members": [list(MEMBERS), MEMBERS[::-1], MEMBERS[:2], MEMBERS + ["104"], MEMBERS + ["101"], [],
                ["101", "102", "104"], [b"101", b"102", b"103"]],
    "num-examples": [-1, 0, 1, 10**9, 10**9 + 1, 1.0],
    "upload-bytes": [-1, 0, 2**40, 2**40 + 1],
    "num-values": [DIM - 1, DIM, DIM + 1, 0],
    "weight-capped": [-1, 0, 1, 2], "clipped": [-1, 0, 1, 2],
    "version": [-1, 0, 2**31 - 1, 2**31], "node-source": [-1, 0, 1, 2, 3], "pid": [-1, 0, 1, 2**31 - 1, 2**31, 7.0],
    "kv-on-disk": [-1, 0, 5, 2**31 - 1, 2**31, 3.0],
    **{k: [-1, 0, 5, 2**31 - 1, 2**31, 3.0] for k in protocol.SERVE_COUNTS},
    **{k: [-1e-300, 0, 0.0, 1e300, math.inf, math.nan] for k in protocol.SERVE_AMOUNTS},
    "epsilon-sample": [0, 0.0, math.inf, -math.inf, math.nan, -1e-300, 10**400],
    "train-loss": [-1e300, 1e300, 0, -5, math.nan, math.inf, 10**400],
    "eval-loss": [-1e300, 1e300, 0, -5, math.nan, -math.inf],
    "delta-norm": [-1e-300, 0, 0.0, 1e300, math.inf], "eval-metric": [-1e-300, 0, 0.0, 1e300, math.inf],
    "saturated": [-1, 0, DIM, DIM + 1],
    **{k: [-1e-9, 0, 0.0, 1e6, 1e6 + 1, 1.0000001e6, 10**400, math.inf]
       for k in ("train-s", "encrypt-s", "sign-s", "decrypt-s", "writeback-s", "eval-s", "restore-s", "key-s",
                 "serve-s", "save-s", "handler-s")},
}
"""Per-field values at and just past the documented limits, so mutated replies are often valid."""
METRIC_VALUES = st.one_of(
    st.sampled_from(HOSTILE_SCALARS),
    st.integers(),
    st.floats(),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4),
    st.lists(st.floats(), max_size=4),
)
"""What a MetricRecord can carry (int / float and same-typed lists)."""
CONFIG_VALUES = st.one_of(
    METRIC_VALUES,
    st.booleans(),
    st.text(max_size=70),
    st.just(LONG),
    st.sampled_from([b"", b"\0" * 16, b"\0" * 32, bytes(10 * MiB)]),
    st.binary(max_size=40),
    st.lists(st.text(max_size=8), max_size=5),
    st.lists(st.binary(max_size=8), max_size=3),
    st.lists(st.booleans(), max_size=3),
)
"""What a ConfigRecord can carry (adds bool, str, bytes and their lists)."""
BIG = arr(bytes(9 * MiB))
"""Over the 8 MiB bundle/context limit, within the 256 MiB update limit."""
FIXED_ARRAYS = [
    arr(b""), arr(b"x"), BIG, npy(b"x" * 10, shape=(10**12,)), npy(b"x" * 10, shape=(5, 2)), npy(b"x" * 10, shape=()),
    npy(b"x" * 10, descr="<f4"), npy(b"x" * 10, descr=LONG), npy(b"x" * 10, descr="<u1"), Array(np.zeros(3)),
    Array(np.zeros((2, 2), dtype=np.uint8)), Array(np.array(1, dtype=np.uint8)),
    Array("uint8", (3,), "torch", b"abc"), Array("uint8", (3,), "numpy.ndarray", b""),
]


@st.composite
def hostile_arrays(draw: st.DrawFn, original: Any = None) -> Array:
    choice = draw(st.integers(0, 9))
    if isinstance(original, Array) and original.data and choice < 5:
        data = bytearray(original.data)
        if choice < 2:  # flip a bit anywhere (header or payload)
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif choice == 2:  # truncate
            del data[draw(st.integers(0, len(data) - 1)):]
        elif choice == 3:  # extend
            data += draw(st.binary(min_size=1, max_size=64))
        else:  # a well-framed array with other payload bytes
            return arr(draw(st.binary(max_size=64)))
        return Array("uint8", (len(data),), "numpy.ndarray", bytes(data))
    return draw(st.sampled_from(FIXED_ARRAYS))


OPS = ["replace"] * 6 + ["del_key", "add_key", "drop_record", "swap_kind", "add_record"]


@st.composite
def mutated(draw: st.DrawFn, spec: dict) -> dict:
    spec = {name: (kind, dict(fields)) for name, (kind, fields) in spec.items()}
    known_keys = sorted(EDGES)
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(OPS))
        if op == "add_record" or not spec:
            name = draw(st.sampled_from([*spec, "extra", protocol.METRICS, protocol.UPDATE, KEYGEN, LONG]))
            spec[name] = (draw(st.sampled_from(sorted(KINDS))), {})
            continue
        name = draw(st.sampled_from(sorted(spec)))
        kind, fields = spec[name]

        def value(key: str, original: Any = None) -> Any:
            if kind == "array":
                return draw(hostile_arrays(original))
            pool = METRIC_VALUES if kind == "metric" else CONFIG_VALUES
            if key in EDGES and draw(st.integers(0, 3)):
                return copy.copy(draw(st.sampled_from(EDGES[key])))
            return draw(pool)

        if op == "drop_record":
            del spec[name]
        elif op == "swap_kind":
            new = draw(st.sampled_from(sorted(set(KINDS) - {kind})))
            if new == "array" or kind == "array":
                fields = {k: arr(b"x") for k in fields} if new == "array" else {k: 1 for k in fields}
            spec[name] = (new, fields)
        elif op == "del_key" and fields:
            del fields[draw(st.sampled_from(sorted(fields)))]
        elif op == "add_key":
            key = draw(st.one_of(st.sampled_from(known_keys), st.text(min_size=1, max_size=60), st.just("k" * 100)))
            fields[key] = value(key)
        elif fields:
            key = draw(st.sampled_from(sorted(fields)))
            fields[key] = value(key, fields[key])
    return spec


def build_or_skip(spec: dict) -> Message:
    try:
        return build(spec)
    except (TypeError, ValueError):  # a value the records refuse: no client can send it
        assume(False)
        raise


def outcome(parse: Callable[[], Any]) -> Any:
    """The parsed value, or None for a BadReply (checked: short, no echo, not the guard)."""
    try:
        value = parse()
    except BadReply as err:
        assert not err.reason.startswith(UNEXPECTED), err.reason
        assert len(err.reason) < 160, err.reason
        assert "X" * 41 not in err.reason and "k" * 41 not in err.reason, err.reason
        event("refused")
        return None
    event("accepted")
    return value


# -- the oracle ---------------------------------------------------------------------------------------------
class Invalid(Exception):
    pass


def need(ok: bool) -> None:
    if not ok:
        raise Invalid


def o_int(v: Any, lo: int, hi: int) -> int:
    need(type(v) is int and lo <= v <= hi)
    return v


def o_float(v: Any, lo: float = -math.inf, hi: float = math.inf, inf_ok: bool = False) -> float:
    need(type(v) in (int, float))
    try:
        x = float(v)
    except OverflowError:
        raise Invalid from None
    need(not math.isnan(x) and (inf_ok or math.isfinite(x)) and lo <= x <= hi)
    return x


def o_bytes(v: Any, *lengths: int) -> bytes:
    need(type(v) is bytes and len(v) in lengths)
    return v


def o_array(a: Any, max_len: int) -> bytes:
    """numpy's own reading of the Array, size-checked before np.load allocates."""
    need(type(a) is Array and a.stype == "numpy.ndarray" and type(a.data) is bytes)
    f = io.BytesIO(a.data)
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, _, dtype = read(f)
    except Exception:  # noqa: BLE001
        raise Invalid from None
    need(dtype == np.uint8 and dtype.names is None and len(shape) == 1 and shape[0] == len(a.data) - f.tell())
    out = np.load(io.BytesIO(a.data), allow_pickle=False)
    need(out.dtype == np.uint8 and out.ndim == 1 and 1 <= out.size <= max_len)
    return out.tobytes()


def o_layout(spec: dict, layout: dict[str, str]) -> None:
    need({n: k for n, (k, _) in spec.items()} == layout)


def o_keys(fields: dict, required: tuple, optional: tuple = ()) -> None:
    need(set(required) <= set(fields) <= set(required) | set(optional))


def oracle(parse_kind: Callable[[], Any]) -> Any:
    try:
        return parse_kind()
    except Invalid:
        return None


def o_enroll(spec: dict) -> messages.EnrollReply:
    o_layout(spec, {NODE_KEYS: "config"})
    f = spec[NODE_KEYS][1]
    o_keys(f, ("node-id", "name", "kx-public", "sign-public", "epoch", "key-id", "partition-id", "num-partitions"))
    need(type(f["node-id"]) is str and f["node-id"] == str(NODE))
    name = f["name"]
    need(type(name) is str and len(name) <= 64 and all(c in "._-" or (c.isascii() and c.isalnum()) for c in name))
    epoch = o_int(f["epoch"], -1, 2**31 - 1)
    key_id = o_bytes(f["key-id"], 16 if epoch >= 0 else 0)
    n = o_int(f["num-partitions"], 1, 2**31 - 1)
    return messages.EnrollReply(f["node-id"], name, o_bytes(f["kx-public"], 32), o_bytes(f["sign-public"], 32),
                               epoch, key_id, o_int(f["partition-id"], 0, n - 1), n)


def o_keygen(spec: dict) -> messages.KeygenReply:
    o_layout(spec, {KEYGEN: "config", BUNDLES: "array", PUBLIC_CONTEXT: "array"})
    f, bundles, ctx = spec[KEYGEN][1], spec[BUNDLES][1], spec[PUBLIC_CONTEXT][1]
    o_keys(f, ("epoch", "key-id", "members"))
    need(o_int(f["epoch"], 0, 2**31 - 1) == 3)
    members = f["members"]
    need(type(members) is list and all(type(m) is str for m in members))
    need(len(members) == len(set(members)) and set(members) == set(MEMBERS) and set(bundles) == set(MEMBERS))
    o_keys(ctx, ("ctx",))
    return messages.KeygenReply(3, o_bytes(f["key-id"], 16), {m: o_array(bundles[m], 8 * MiB) for m in MEMBERS},
                               o_array(ctx["ctx"], 8 * MiB))


def o_ack(spec: dict) -> messages.ProvisionAck:
    o_layout(spec, {PROVISIONED: "config"})
    f = spec[PROVISIONED][1]
    o_keys(f, ("key-id", "epoch"))
    return messages.ProvisionAck(o_bytes(f["key-id"], 16), o_int(f["epoch"], 0, 2**31 - 1))


def o_update(spec: dict) -> bytes:
    f = spec[protocol.UPDATE][1]
    o_keys(f, ("update",))
    return o_array(f["update"], 256 * MiB)


def o_noise(spec: dict) -> bytes:
    o_layout(spec, {protocol.UPDATE: "array"})
    return o_update(spec)


SECONDS = ("train-s", "encrypt-s", "sign-s", "decrypt-s", "writeback-s", "restore-s", "key-s", "save-s", "handler-s")
EVAL_SECONDS = ("restore-s", "key-s", "serve-s", "save-s", "handler-s")
PRIVATE = ("train-loss", "clipped", "delta-norm", "saturated")


def o_train(spec: dict, dp: bool) -> messages.TrainReply:
    o_layout(spec, {protocol.UPDATE: "array", protocol.METRICS: "metric"})
    m = spec[protocol.METRICS][1]
    always = ("num-examples", "upload-bytes", "num-values", "weight-capped", *SECONDS, "version", "node-source", "pid",
              "kv-on-disk")
    o_keys(m, always if dp else always + PRIVATE, ("epsilon-sample",))
    n = o_int(m["num-values"], DIM, DIM)
    private = {} if dp else {
        "train_loss": o_float(m["train-loss"]), "clipped": o_int(m["clipped"], 0, 1) == 1,
        "delta_norm": o_float(m["delta-norm"], 0), "saturated": o_int(m["saturated"], 0, n),
    }
    metrics = messages.TrainMetrics(
        num_examples=o_int(m["num-examples"], 0, 10**9), upload_bytes=o_int(m["upload-bytes"], 0, 2**40),
        num_values=n, weight_capped=o_int(m["weight-capped"], 0, 1) == 1,
        **{k.replace("-", "_"): o_float(m[k], 0, 1e6) for k in SECONDS},
        version=o_int(m["version"], 0, 2**31 - 1), node_source=o_int(m["node-source"], 0, 2),
        pid=o_int(m["pid"], 1, 2**31 - 1), kv_on_disk=o_int(m["kv-on-disk"], 0, 2**31 - 1),
        epsilon_sample=o_float(m["epsilon-sample"], 0, inf_ok=True) if "epsilon-sample" in m else None,
        **private,
    )
    return messages.TrainReply(o_update(spec), metrics)


def o_eval(spec: dict) -> messages.EvalMetrics:
    o_layout(spec, {protocol.METRICS: "metric"})
    m = spec[protocol.METRICS][1]
    o_keys(m, messages.EVAL_FIELDS)
    return messages.EvalMetrics(
        o_int(m["num-examples"], 1, 10**9), o_float(m["eval-loss"]), o_float(m["eval-metric"], 0),
        o_float(m["decrypt-s"], 0, 1e6), o_float(m["writeback-s"], 0, 1e6), o_float(m["eval-s"], 0, 1e6),
        o_int(m["version"], 0, 2**31 - 1), o_int(m["node-source"], 0, 2), o_int(m["pid"], 1, 2**31 - 1),
        o_int(m["kv-on-disk"], 0, 2**31 - 1), *(o_float(m[k], 0, 1e6) for k in EVAL_SECONDS),
        {**{k: o_int(m[k], 0, 2**31 - 1) for k in protocol.SERVE_COUNTS},
         **{k: o_float(m[k], 0) for k in protocol.SERVE_AMOUNTS}},
    )


def same(got: Any, want: Any) -> None:
    """Equal, with exact Python types for every field (bool is not int, float is float)."""
    assert got == want, (got, want)
    if got is not None and hasattr(got, "__dataclass_fields__"):
        for name in got.__dataclass_fields__:
            a, b = getattr(got, name), getattr(want, name)
            if hasattr(a, "__dataclass_fields__"):
                same(a, b)
            else:
                assert type(a) is type(b), (name, a, b)


def test_the_oracle_accepts_the_valid_replies() -> None:
    assert oracle(lambda: o_enroll(enroll_spec())) == parse_enroll_reply(build(enroll_spec()), str(NODE))
    assert oracle(lambda: o_keygen(keygen_spec())) == parse_keygen_reply(build(keygen_spec()), MEMBERS, 3)
    assert oracle(lambda: o_ack(ack_spec())) is not None and oracle(lambda: o_noise(noise_spec())) is not None
    for dp in (False, True):
        same(parse_train_reply(build(train_spec(dp)), dp=dp, dim=DIM), oracle(lambda: o_train(train_spec(dp), dp)))
    same(parse_eval_reply(build(eval_spec())), oracle(lambda: o_eval(eval_spec())))


PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(st.data())
def test_property_enroll(data: st.DataObject) -> None:
    spec = data.draw(mutated(enroll_spec()))
    same(outcome(lambda: parse_enroll_reply(build_or_skip(spec), str(NODE))), oracle(lambda: o_enroll(spec)))


@PROPERTY
@given(st.data())
def test_property_keygen(data: st.DataObject) -> None:
    spec = data.draw(mutated(keygen_spec()))
    same(outcome(lambda: parse_keygen_reply(build_or_skip(spec), MEMBERS, 3)), oracle(lambda: o_keygen(spec)))


@PROPERTY
@given(st.data())
def test_property_provision_ack(data: st.DataObject) -> None:
    spec = data.draw(mutated(ack_spec()))
    same(outcome(lambda: parse_provision_ack(build_or_skip(spec))), oracle(lambda: o_ack(spec)))


@PROPERTY
@given(st.data())
def test_property_noise(data: st.DataObject) -> None:
    spec = data.draw(mutated(noise_spec()))
    same(outcome(lambda: parse_noise_reply(build_or_skip(spec))), oracle(lambda: o_noise(spec)))


@PROPERTY
@given(st.data(), st.booleans())
def test_property_train(data: st.DataObject, dp: bool) -> None:
    spec = data.draw(mutated(train_spec(dp)))
    same(outcome(lambda: parse_train_reply(build_or_skip(spec), dp=dp, dim=DIM)), oracle(lambda: o_train(spec, dp)))


@PROPERTY
@given(st.data())
def test_property_eval(data: st.DataObject) -> None:
    spec = data.draw(mutated(eval_spec()))
    same(outcome(lambda: parse_eval_reply(build_or_skip(spec))), oracle(lambda: o_eval(spec)))


@PROPERTY
@given(st.sampled_from(["enroll", "keygen", "ack", "noise", "train", "eval"]),
       st.dictionaries(st.sampled_from([protocol.METRICS, protocol.UPDATE, NODE_KEYS, KEYGEN, BUNDLES,
                                        PUBLIC_CONTEXT, PROVISIONED, "x"]),
                       st.tuples(st.sampled_from(sorted(KINDS)), st.dictionaries(st.text(max_size=12), st.just(1), max_size=3)),
                       max_size=3))
def test_property_any_reply_to_any_parser(kind: str, spec: dict) -> None:
    """Replies of the wrong kind, or of no kind at all, are refused."""
    spec = {n: (k, {f: arr(b"x") for f in fields} if k == "array" else fields) for n, (k, fields) in spec.items()}
    msg = build_or_skip(spec)
    parse = {
        "enroll": lambda: parse_enroll_reply(msg, "101"), "keygen": lambda: parse_keygen_reply(msg, MEMBERS, 3),
        "ack": lambda: parse_provision_ack(msg), "noise": lambda: parse_noise_reply(msg),
        "train": lambda: parse_train_reply(msg, dp=False, dim=DIM), "eval": lambda: parse_eval_reply(msg),
    }[kind]
    assert outcome(parse) is None


# -- writers: every reply a node writes reads back as the same value -------------------------------------
def _server_message(message_type: str = "query.fedkv_test") -> Message:
    return Message(RecordDict({}), dst_node_id=NODE, message_type=message_type)


@pytest.mark.parametrize("dp", [False, True])
def test_each_writer_reads_back_as_what_it_wrote(dp: bool) -> None:
    """``messages`` keeps each reply's writer beside its reader: writing the value a valid reply
    parses to and reading it again gives the same value, field for field and type for type."""
    enroll = parse_enroll_reply(build(enroll_spec()), str(NODE))
    same(parse_enroll_reply(messages.enroll_reply(_server_message(), enroll), str(NODE)), enroll)
    keygen = parse_keygen_reply(build(keygen_spec()), MEMBERS, 3)
    same(parse_keygen_reply(messages.keygen_reply(_server_message(), keygen), MEMBERS, 3), keygen)
    ack = parse_provision_ack(build(ack_spec()))
    same(parse_provision_ack(messages.provision_ack(_server_message(), ack)), ack)
    noise = parse_noise_reply(build(noise_spec()))
    assert parse_noise_reply(messages.noise_reply(_server_message(), noise)) == noise
    train = parse_train_reply(build(train_spec(dp)), dp=dp, dim=DIM)
    written = messages.train_reply(_server_message(), train.blob, messages.metric_fields(train.metrics))
    same(parse_train_reply(written, dp=dp, dim=DIM), train)
    evaluated = parse_eval_reply(build(eval_spec()))
    same(parse_eval_reply(messages.eval_reply(_server_message(), evaluated)), evaluated)


def test_the_node_source_is_spelled_once() -> None:
    """``NodeSource`` is what a node reports, what the reader accepts and what a round counts."""
    assert messages.NODE_SOURCES == tuple(int(s) for s in messages.NodeSource) == (0, 1, 2)
    assert [s.label for s in messages.NodeSource] == ["built", "restored", "reused"]
    metrics = parse_eval_reply(build(eval_spec()))
    for source in messages.NodeSource:
        fields = messages.metric_fields(dataclasses.replace(metrics, node_source=source))
        assert type(fields["node-source"]) is int and fields["node-source"] == source


def test_round_and_noise_requests_read_back() -> None:
    history = [(b"a1", b"m1"), (b"a2", b"")]
    msg = messages.round_request(protocol.TRAIN, NODE, 3, history, 0, 2)
    req = messages.read_round_request(msg)
    assert (req.server_round, req.target_version, req.num_sampled) == (3, 2, 2)
    assert req.aggregates() == [(1, b"a1", b"m1"), (2, b"a2", b"")]
    caught_up = messages.round_request(protocol.EVALUATE, NODE, 3, history, 2, 1)
    assert messages.read_round_request(caught_up).aggregates() == []
    noise = messages.NoiseRequest(4, 2, 5)
    assert messages.read_noise_request(messages.noise_request(NODE, noise)) == noise
