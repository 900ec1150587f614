"""Strict checks of client-supplied wire values: each returns the value in its documented type
and range or raises ``BadReply`` with a short reason naming the field (``federation.messages``
uses them to read every reply a node sends).

Whatever a value is (``bool`` for ``int``, floats for ints, huge ints, NaN/inf, lists for
scalars, oversized or mis-framed arrays), nothing but ``BadReply`` escapes a check, and no
reason echoes more than ~40 characters of a client-supplied value.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from flwr.app import Array, Message

__all__ = [
    "MAX_SECONDS", "UNEXPECTED", "BadReply", "array_bytes", "as_bytes", "as_flag", "as_float", "as_int",
    "as_seconds", "as_str", "exact_fields", "exact_records", "guard", "kind_of", "safe_reason", "show",
]

MAX_SECONDS = 1e6
_NPY_HEADER_MAX = 1024
"""Longest .npy header accepted (np.save writes ~118 bytes for a 1-D array)."""
_UINT8_DESCR = ("|u1", "<u1", ">u1", "u1")
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


# -- showing client values without echoing them --------------------------------------------------
def show(value: Any) -> str:
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


def kind_of(value: Any) -> str:
    return type(value).__name__[:_SHOW]


# -- field checks ---------------------------------------------------------------------------------
def as_int(where: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadReply(f"{where}: expected int, got {kind_of(value)}")
    value = int(value)
    if not lo <= value <= hi:
        raise BadReply(f"{where}: {show(value)} not in [{lo}, {hi}]")
    return value


def as_flag(where: str, value: Any) -> bool:
    return bool(as_int(where, value, 0, 1))


def as_float(where: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *, allow_inf: bool = False) -> float:
    """A float (or an int, range-checked before conversion); finite unless allow_inf (NaN never)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadReply(f"{where}: expected float, got {kind_of(value)}")
    if isinstance(value, int):
        value = int(value)
        if not lo <= value <= hi:  # exact int/float comparison, no overflow
            raise BadReply(f"{where}: {show(value)} not in [{lo:g}, {hi:g}]")
        try:
            return float(value)
        except OverflowError:
            raise BadReply(f"{where}: {show(value)} does not fit a float") from None
    value = float(value)
    if math.isnan(value):
        raise BadReply(f"{where}: NaN")
    if math.isinf(value) and not allow_inf:
        raise BadReply(f"{where}: {value!r} is not finite")
    if not lo <= value <= hi:
        raise BadReply(f"{where}: {show(value)} not in [{lo:g}, {hi:g}]")
    return value


def as_seconds(where: str, value: Any) -> float:
    return as_float(where, value, 0.0, MAX_SECONDS)


def as_bytes(where: str, value: Any, *lengths: int) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise BadReply(f"{where}: expected bytes, got {kind_of(value)}")
    if len(value) not in lengths:
        want = " or ".join(str(n) for n in lengths)
        raise BadReply(f"{where}: {len(value)} bytes, expected {want}")
    return bytes(value)


def as_str(where: str, value: Any, max_len: int) -> str:
    if not isinstance(value, str):
        raise BadReply(f"{where}: expected str, got {kind_of(value)}")
    if len(value) > max_len:
        raise BadReply(f"{where}: {len(value)} characters, at most {max_len}")
    return str(value)


def array_bytes(where: str, arr: Any, max_len: int) -> bytes:
    """The payload of a 1-D uint8 ``Array`` (1..max_len bytes), from its .npy framing.

    Parsed here rather than with ``Array.numpy()``: ``np.load`` allocates what the header
    claims before reading the data, so a 20-byte header could ask for terabytes.
    """
    if not isinstance(arr, Array):
        raise BadReply(f"{where}: expected an Array, got {kind_of(arr)}")
    stype, data = getattr(arr, "stype", None), getattr(arr, "data", None)
    if stype != "numpy.ndarray":
        raise BadReply(f"{where}: array serialization {show(stype)} is not numpy.ndarray")
    if not isinstance(data, bytes):
        raise BadReply(f"{where}: array data is {kind_of(data)}, not bytes")
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
        raise BadReply(f"{where}: dtype {show(descr)} is not uint8")
    if not isinstance(header["fortran_order"], bool):
        raise BadReply(f"{where}: bad .npy header")
    if not isinstance(shape, tuple) or len(shape) != 1 or type(shape[0]) is not int:
        raise BadReply(f"{where}: shape {show(str(shape))} is not 1-D")
    payload = data[start + hlen :]
    if shape[0] != len(payload):
        raise BadReply(f"{where}: header says {show(shape[0])} bytes, data has {len(payload)}")
    if not 1 <= len(payload) <= max_len:
        raise BadReply(f"{where}: {len(payload)} bytes, expected 1..{max_len}")
    return payload


# -- records ---------------------------------------------------------------------------------------
R = TypeVar("R")


def exact_records(msg: Any, expected: Mapping[str, type[R]]) -> dict[str, Any]:
    """The reply's records, exactly ``expected`` (name -> record class), nothing else."""
    if not isinstance(msg, Message):
        raise BadReply(f"not a Message: {kind_of(msg)}")
    if msg.has_error():
        raise BadReply("reply carries an error")
    content = msg.content
    out: dict[str, Any] = {}
    for name, kind in expected.items():
        rec = content.get(name)
        if rec is None:
            raise BadReply(f"reply has no {kind.__name__} {name!r}")
        if type(rec) is not kind:
            raise BadReply(f"{name}: expected a {kind.__name__}, got {kind_of(rec)}")
        out[name] = rec
    for name in content.keys():
        if name not in expected:
            raise BadReply(f"reply has an unexpected record {show(name)}")
    return out


def exact_fields(name: str, rec: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = (),
            forbidden: tuple[str, ...] = (), why_forbidden: str = "") -> None:
    """Every key of ``rec`` is known (and not forbidden); every required key is present."""
    for key in rec.keys():
        if key in forbidden:
            raise BadReply(f"{name}.{key}: must be absent{why_forbidden}")
        if key not in required and key not in optional:
            raise BadReply(f"{name}: unknown field {show(key)}")
    for key in required:
        if key not in rec:
            raise BadReply(f"{name}: missing field {key!r}")


def guard(fn: Callable[..., R]) -> Callable[..., R]:
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
