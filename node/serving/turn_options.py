"""A session agent's turn options (``POST /v1/sessions/<id>``): what a request may ask for
and the strict parsing of its JSON body -- checked whole before the session is touched."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from node.engine.sessions import Sampling
from node.engine.stop_text import MAX_STOP_CHARS

MAX_NEW_TOKENS = 128
DEFAULT_NEW_TOKENS = 16
MAX_TEMPERATURE = 10.0
MAX_STOP_STRINGS = 8
MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True)
class TurnOptions:
    """A turn's per-request options (``parse_turn`` validates them from the JSON body)."""

    max_new_tokens: int = DEFAULT_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    """None: the request's sampling generator is seeded from ``secrets`` (not repeatable)."""

    def sampling(self, seed: int) -> Sampling:
        """A fresh generator per attempt: a turn rolled back by a write-back and decoded
        again draws the same numbers."""
        g = torch.Generator()
        g.manual_seed(seed)
        return Sampling(self.temperature, self.top_p, g)


TURN_FIELDS = ("text", "max_new_tokens", "max_tokens", "temperature", "top_p", "stop", "seed")


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None and name not in body:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    if name not in body:
        return default
    v = body[name]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
            or not (lo < v if lo_open else lo <= v) or not v <= hi:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be a finite number in {span}, got {v!r}")
    return float(v)


def parse_turn(body: dict) -> tuple[str, TurnOptions]:
    """A turn's text and options from its JSON body, strictly: an unknown field, a wrong
    type, NaN/Infinity or a value out of range is a ValueError/TypeError (400) naming the
    field, raised before the session is touched."""
    unknown = sorted(set(body) - set(TURN_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; a turn takes {list(TURN_FIELDS)}")
    text = body.get("text")
    if not isinstance(text, str):
        raise TypeError("'text' must be a string")
    n = _int(body, "max_new_tokens", 0, MAX_NEW_TOKENS)
    m = _int(body, "max_tokens", 0, MAX_NEW_TOKENS)
    if n is not None and m is not None and n != m:
        raise ValueError(f"max_tokens ({m}) and max_new_tokens ({n}) disagree; give one")
    stop = body.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to "
                         f"{MAX_STOP_CHARS} characters")
    seed = _int(body, "seed", 0, MAX_SEED)
    return text, TurnOptions(
        max_new_tokens=m if m is not None else n if n is not None else DEFAULT_NEW_TOKENS,
        temperature=_number(body, "temperature", 0.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        stop=tuple(stop), seed=seed)
