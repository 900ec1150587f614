"""OpenAI's sampling fields of a request body, and the ``logprobs`` objects of its reply.

Kept beside ``node.serving.openai_protocol`` (which calls ``parse_sampling`` from its field checks) so
the HTTP layer only passes bodies in and objects out. Ranges are OpenAI's (penalties in
[-2, 2], ``top_logprobs`` 0..20) and vLLM's for its extra fields (``top_k`` -1 or >= 1,
``min_p`` in [0, 1], ``repetition_penalty`` > 0). Replies: chat's
``choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``;
``/v1/completions``' legacy ``{tokens, token_logprobs, top_logprobs, text_offset}``
(``text_offset``: characters into the completion's text). Logprobs are the raw model's
(``node.engine.sampling``), clamped at -9999 as vLLM does so JSON never holds -Infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from node.engine.sampling import MAX_LOGPROBS, SamplingParams
from node.engine.structured_output import FormatError, ResponseFormat, parse_response_format

FIELDS = frozenset({"logprobs", "top_logprobs", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "response_format"})
"""The fields ``parse_sampling`` takes (``top_logprobs`` is chat's only)."""
_RANGES = {"min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
           "frequency_penalty": (-2.0, 2.0), "repetition_penalty": (0.0, math.inf)}
_DEFAULTS = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
             "repetition_penalty": 1.0}
MIN_LOGPROB = -9999.0


def _number(body: dict, name: str) -> float:
    v = body.get(name)
    if v is None:
        return _DEFAULTS[name]
    lo, hi = _RANGES[name]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    open_lo = name == "repetition_penalty"
    if not ok or not (lo < v if open_lo else lo <= v) or v > hi:
        span = f"{'(' if open_lo else '['}{lo:g}, {hi:g}]"
        raise FormatError(name, f"'{name}' must be a finite number in {span}, got {v!r}")
    return float(v)


def _int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise FormatError(name, f"'{name}' must be an integer, got {v!r}")
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, only with it); completions:
    ``logprobs`` (0..20) is the top count."""
    if chat:
        on, top = body.get("logprobs"), _int(body, "top_logprobs")
        if on is not None and not isinstance(on, bool):
            raise FormatError("logprobs", f"'logprobs' must be a boolean, got {on!r}")
        if top is not None and not on:
            raise FormatError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        name, k = "top_logprobs", (top or 0) if on else None
    else:
        name, k = "logprobs", _int(body, "logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise FormatError(name, f"'{name}' must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
    return k


def parse_sampling(body: dict, chat: bool, temperature: float,
                   top_p: float) -> tuple[SamplingParams, ResponseFormat | None]:
    """The request's ``SamplingParams`` (temperature and top_p checked by the caller) and its
    ``response_format``; a ``FormatError`` names the offending field."""
    top_k = _int(body, "top_k")
    if top_k is not None and not (top_k == -1 or top_k >= 1):
        raise FormatError("top_k", f"'top_k' must be -1 (off) or an integer >= 1, got {top_k}")
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=-1 if top_k is None else top_k,
        **{name: _number(body, name) for name in _RANGES}, logprobs=_logprobs(body, chat))
    return params, parse_response_format(body.get("response_format"))


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as in a token."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """A byte-level BPE token's raw bytes (a partial UTF-8 character stays partial); any other
    tokenizer's token as its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(int(token))
    if isinstance(piece, str) and piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return tokenizer.decode([int(token)]).encode("utf-8")


# -- the reply's objects ------------------------------------------------------------------------
def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB)


class LogprobsWriter:
    """One choice's logprobs, a piece per chunk: ``take(ids)`` covers the ids not yet taken."""

    def __init__(self, ids: list[int], k: int | None, chat: bool,
                 token_bytes: Callable[[int], bytes]):
        """``ids``: the choice's token list as it grows (``TextStream.ids``)."""
        self.ids, self.k, self.chat, self.token_bytes = ids, k, chat, token_bytes
        self.taken = 0
        self.offset = 0
        """Characters of text the taken tokens spell (legacy ``text_offset``)."""

    def _text(self, token: int) -> tuple[str, bytes]:
        b = self.token_bytes(int(token))
        return b.decode("utf-8", "replace"), b

    @classmethod
    def for_streams(cls, streams: Sequence[Any], params: SamplingParams, chat: bool,
                    codec: Any) -> list["LogprobsWriter"]:
        """One per choice's ``TextStream``; ``codec``: the server's ``PromptCodec``."""
        return [cls(ts.ids, params.logprobs, chat, codec.token_bytes) for ts in streams]

    def take(self, upto: int) -> dict[str, Any] | None:
        """The object for ``ids[taken:upto]`` (None when the request did not ask for them)."""
        if self.k is None:
            return None
        new, self.taken = list(self.ids[self.taken:upto]), max(self.taken, upto)
        return self._chat(new) if self.chat else self._legacy(new)

    def _chat(self, tokens: list[int]) -> dict[str, Any]:
        content = []
        for t in tokens:
            text, b = self._text(t)
            tops = []
            for i, lp in getattr(t, "top_logprobs", ()):
                ti, tb = self._text(i)
                tops.append({"token": ti, "logprob": _lp(lp), "bytes": list(tb)})
            content.append({"token": text, "logprob": _lp(getattr(t, "logprob", None) or 0.0),
                            "bytes": list(b), "top_logprobs": tops})
        return {"content": content, "refusal": None}

    def _legacy(self, tokens: list[int]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for t in tokens:
            text, _ = self._text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(getattr(t, "logprob", None) or 0.0))
            out["top_logprobs"].append({self._text(i)[0]: _lp(lp)
                                        for i, lp in getattr(t, "top_logprobs", ())})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
