"""The runtime-settable knobs of a live cache (the article's ``/proc/memos/cache``).

Each tunable is a field of ``CacheConfig`` (its default and meaning are documented there,
once); this module says which fields may change while the engine runs and which values are
allowed. ``CacheConfig`` construction, ``KVCache.set_tunable`` and ``python -m cache set`` all
validate through :func:`validate_tunable`, so a value is accepted or refused the same way
everywhere. Values may arrive as strings (the command line) and are parsed to the field's type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from cache.errors import ConfigError
from cache.policy import POLICIES
from cache.prefetch import PREFETCH_MODES

COHERENCE_PROTOCOLS = {2: "strong MESI", 1: "relaxed"}
"""``coherence_protocol`` values: 2 = a write returns once every holder invalidated."""


class UnknownTunableError(ConfigError, KeyError):
    """A key that is not a runtime tunable; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown tunable"


@dataclass(frozen=True)
class Tunable:
    """One knob: how to parse it and which values it takes (``allowed`` is the message)."""

    parse: Callable[[Any], Any]
    check: Callable[[Any], bool]
    allowed: str


def _as_int(value: Any) -> int:
    """An int from an int or a string of one (bools and floats are refused, not truncated)."""
    if isinstance(value, bool):
        raise ValueError("a bool is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return int(value.strip())
    raise ValueError(f"{type(value).__name__} is not an integer")


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a bool is not a number")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        out = float(value.strip())
    else:
        raise ValueError(f"{type(value).__name__} is not a number")
    if not math.isfinite(out):
        raise ValueError("not a finite number")
    return out


def _as_name(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{type(value).__name__} is not a name")
    return value.strip()


TUNABLES: dict[str, Tunable] = {
    "warmup_ratio": Tunable(_as_float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "evict_batch": Tunable(_as_int, lambda v: 1 <= v <= 1 << 20,
                           "an integer in [1, 1048576]"),
    "prefetch_degree": Tunable(_as_int, lambda v: 0 <= v <= 64,
                               "an integer in [0, 64] (0 = no prefetch)"),
    "prefetch_mode": Tunable(_as_name, lambda v: v in PREFETCH_MODES,
                             "one of " + ", ".join(PREFETCH_MODES)),
    "coherence_protocol": Tunable(_as_int, lambda v: v in COHERENCE_PROTOCOLS,
                                  "2 (strong MESI) or 1 (relaxed)"),
    "low_watermark": Tunable(_as_float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
    "cooldown_s": Tunable(_as_float, lambda v: v >= 0.0, "a finite number of seconds >= 0"),
    "eviction_policy": Tunable(_as_name, lambda v: v in POLICIES,
                               "one of " + ", ".join(sorted(POLICIES))),
}
"""Name -> knob, in the order ``KVCache.tunables()`` lists them."""


def validate_tunable(key: str, value: Any) -> Any:
    """``value`` parsed to the tunable's type; ConfigError naming key, value and what is
    allowed, UnknownTunableError (a ConfigError) for a key that is not a tunable."""
    spec = TUNABLES.get(key)
    if spec is None:
        raise UnknownTunableError(
            f"unknown tunable {key!r}; known: {', '.join(TUNABLES)}")
    try:
        parsed = spec.parse(value)
    except ValueError as e:
        raise ConfigError(f"{key} must be {spec.allowed}, got {value!r} ({e})") from None
    if not spec.check(parsed):
        raise ConfigError(f"{key} must be {spec.allowed}, got {value!r}")
    return parsed
