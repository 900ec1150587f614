"""OpenAI's request and reply shapes for ``node.serving.openai_api``: strict parameter checks, the prompt
codec, and incremental detokenization with stop strings.

Kept apart from the HTTP server so each reads at once; nothing here touches a socket or a model.

* ``parse_chat`` / ``parse_completion`` check a request body the way OpenAI documents it and
  raise ``APIError`` (400, OpenAI's error shape, ``param`` naming the field) for an unknown
  or unsupported field, a wrong type, NaN/Infinity or a value out of range.
* ``PromptCodec``: text and chat messages to token ids and back. A chat codec
  (``node.models.chat.ChatCodec``) renders messages with the model's chat template; the byte model has
  no template, so a conversation is rendered ``"<role>: <content>\\n"`` per message followed by
  ``"assistant: "`` (documented in docs/serving.md), its text is UTF-8 bytes as ids.
* ``TextStream``: the reply's text as tokens arrive. Each step decodes a short window of the
  newest ids (the ids since the last settled text and the piece before it, as vLLM's
  incremental detokenizer does) and hands out only the new, settled text: a trailing U+FFFD (a
  UTF-8 sequence the next token may complete) and a tail that could begin a stop string
  (``node.engine.stop_text.StopScan``, at most ``MAX_STOP_CHARS - 1`` characters) are held back, so a
  stop string split across tokens never leaks and the streamed text equals the text of a
  non-streamed reply of the same tokens. Work per token is bounded: a reply costs time linear
  in its length, whatever the stop strings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from node.serving import sampling_fields

from node.engine import structured_output
from node.engine.sampling import SamplingParams
from node.engine.stop_text import MAX_STOP_CHARS, StopScan

MAX_STOP = 4
"""Stop strings a request may give (OpenAI's own limit); each of 1 to ``MAX_STOP_CHARS``."""
MAX_N = 8
MAX_SEED = (1 << 63) - 1
MAX_TEMPERATURE = 2.0
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
"""OpenAI fields that change nothing about the reply: accepted and ignored."""
_NOOP = {"logit_bias": ({}, None), "echo": False, "best_of": 1, "suffix": None,
         "parallel_tool_calls": (True, False, None)}
"""OpenAI fields accepted only at the value that disables them (what we do anyway)."""
_CHAT_FIELDS = {"messages", "model", "max_tokens", "max_completion_tokens", "n", "seed", "stop",
                "stream", "stream_options", "temperature", "top_p"} | sampling_fields.FIELDS
_TEXT_FIELDS = {"prompt", "model", "max_tokens", "n", "seed", "stop", "stream", "stream_options",
                "temperature", "top_p"} | (sampling_fields.FIELDS - {"top_logprobs"})
ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An error reply in OpenAI's shape ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.type = code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


@dataclass(frozen=True)
class Params:
    """A checked request: what the backend and the text stream need."""

    prompt: object
    """The messages (chat) or the prompt (a string or token ids), encoded by ``PromptCodec``."""
    max_tokens: int | None
    """None: as many as the context leaves, at most the server's cap."""
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """All sampling options (``node.serving.sampling_fields``), temperature and top_p included."""
    response_format: structured_output.ResponseFormat | None = None
    model: str = ""
    """The served model the request named (the base or an adapter: ``node.serving.served_models``)."""


# -- field checks -------------------------------------------------------------------------------
def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad(name, f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not (lo < v if lo_open else lo <= v) or v > hi:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(name, f"'{name}' must be a finite number in {span}, got {v!r}")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {v!r}")
    return bool(v)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "'stop' must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"a 'stop' string has at most {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _check_fields(body: dict, supported: set[str]) -> None:
    """400 naming the fields we do not take (OpenAI's own included) unless harmless."""
    refused = []
    for k in sorted(set(body) - supported - IGNORED):
        noop = _NOOP.get(k, object())
        if not (body[k] == noop or (isinstance(noop, tuple) and body[k] in noop)):
            refused.append(k)
    if refused:
        raise APIError(400, f"unsupported parameter(s) {refused}; this server takes "
                            f"{sorted(supported)}", refused[0], "unsupported_parameter")


def _model(body: dict, model_ids: str | Collection[str]) -> str:
    """The served model the body names (404 ``model_not_found`` for another)."""
    ids = (model_ids,) if isinstance(model_ids, str) else tuple(model_ids)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", "'model' must be a string naming the model (GET /v1/models)")
    if model not in ids:
        raise APIError(404, f"the model '{model[:100]}' does not exist; this server serves "
                            f"{', '.join(repr(i) for i in ids)}", "model", "model_not_found")
    return model


def _common(body: dict, model_ids: str | Collection[str], max_cap: int,
            max_tokens_name: str = "max_tokens", chat: bool = True) -> dict:
    model = _model(body, model_ids)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("stream_options", "'stream_options' takes {'include_usage': bool}")
    seed = _int(body, "seed", -MAX_SEED - 1, MAX_SEED)
    temperature = _float(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE, False)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, True)
    try:
        sampling, fmt = sampling_fields.parse_sampling(body, chat, temperature, top_p)
    except structured_output.FormatError as e:
        raise bad(e.param, str(e)) from None
    return dict(max_tokens=_int(body, max_tokens_name, 0, max_cap), temperature=temperature,
                top_p=top_p, n=_int(body, "n", 1, MAX_N) or 1, stop=_stop(body), seed=seed,
                stream=stream, include_usage=_bool(opts or {}, "include_usage"),
                sampling=sampling, response_format=fmt, model=model)


def parse_chat(body: dict, model_id: str | Collection[str], max_cap: int) -> Params:
    """A ``/v1/chat/completions`` body, checked (``APIError`` 400/404 otherwise)."""
    _check_fields(body, _CHAT_FIELDS)
    name = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise bad("max_tokens", "give 'max_tokens' or 'max_completion_tokens', not both")
        name = "max_completion_tokens"
    common = _common(body, model_id, max_cap, name)
    return Params(prompt=_messages(body.get("messages")), **common)


def _messages(v: object) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(p, f"{p} must be an object with 'role' one of {list(ROLES)}")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise APIError(400, f"{p} has unsupported field(s) {sorted(extra)} (no tools)", p,
                           "unsupported_parameter")
        out.append({"role": "system" if m["role"] == "developer" else m["role"],
                    "content": _content(m.get("content"), p)})
    return out


def _content(c: object, p: str) -> str:
    """A string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(x, dict) and set(x) == {"type", "text"}
                                    and x["type"] == "text" and isinstance(x["text"], str)
                                    for x in c):
        return "".join(x["text"] for x in c)
    raise bad(f"{p}.content", f"{p}.content must be a string or a list of text parts "
                              "(this model reads text only)")


def parse_completion(body: dict, model_id: str | Collection[str], max_cap: int) -> Params:
    """A ``/v1/completions`` body, checked; ``max_tokens`` defaults to 16 as OpenAI's does."""
    _check_fields(body, _TEXT_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise bad("prompt", "'prompt' must be a non-empty string or list of token ids (one "
                            "prompt per request)")
    common = _common(body, model_id, max_cap, chat=False)
    if common["max_tokens"] is None:
        common["max_tokens"] = min(16, max_cap)
    return Params(prompt=prompt, **common)


# -- the codec ----------------------------------------------------------------------------------
class PromptCodec:
    """Text, chat messages and token ids for one model (see the module docstring)."""

    def __init__(self, codec: Any = None, vocab_size: int | None = None):
        """``codec``: ``node.models.chat.ChatCodec`` (chat template), or None/``ByteCodec`` (bytes)."""
        self.chat = bool(getattr(codec, "chat", False))
        self.codec = codec
        self.eos_ids: frozenset[int] = frozenset(getattr(codec, "eos_ids", ()))
        self.vocab_size = 256 if not self.chat else vocab_size or len(codec.tokenizer)
        self._grammars = structured_output.CompilerCache(
            lambda: structured_output.GrammarCompiler.for_hf(self.codec.tokenizer, self.vocab_size)
            if self.chat else structured_output.GrammarCompiler.for_bytes(self.vocab_size))

    def sampling(self, p: Params) -> SamplingParams:
        """``p``'s sampling with its ``response_format`` compiled for this vocabulary (400 when
        the schema cannot be used or the grammar library is absent)."""
        if p.response_format is None:
            return p.sampling
        try:
            return replace(p.sampling, grammar=self._grammars.get().compile(p.response_format))
        except structured_output.FormatError as e:
            raise bad(e.param, str(e)) from None
        except structured_output.StructuredOutputUnavailable as e:
            raise APIError(400, str(e), "response_format", "unsupported_parameter") from None

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (``logprobs``' ``bytes``)."""
        if not self.chat:
            return bytes([token])
        return sampling_fields.token_bytes(self.codec.tokenizer, token)

    def messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if self.chat:
            return self.codec.prompt(messages)  # contents as text: no special token typed
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(text.encode("utf-8"))

    def text(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if max(prompt) >= self.vocab_size:
                raise bad("prompt", f"token ids must be below the vocabulary size "
                                    f"{self.vocab_size}")
            return prompt
        return self.codec.encode(prompt) if self.chat else list(prompt.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        if self.chat:
            return self.codec.tokenizer.decode(list(ids), skip_special_tokens=True,
                                               clean_up_tokenization_spaces=False)
        return bytes(ids).decode("utf-8", "replace")


# -- text as it streams -------------------------------------------------------------------------
MAX_HELD_TOKENS = 8
"""Tokens a trailing partial UTF-8 character may stay held back; past it, the replacement
character is released as text (a model emitting invalid bytes cannot grow the window)."""


class TextStream:
    """One choice's text, settled token by token (see the module docstring)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.ids: list[int] = []
        self._scan = StopScan(stops)
        self._prefix = 0
        """``ids[_prefix:_read]`` decode to text already handed on: the window's context."""
        self._read = 0

    @property
    def stopped(self) -> bool:
        """A stop string was met: the text ends before it; feed no more tokens."""
        return self._scan.stopped

    @property
    def searched(self) -> int:
        """Characters searched for stop strings so far (``StopScan.searched``)."""
        return self._scan.searched

    def push(self, token: int) -> str:
        """The new settled text after ``token``."""
        self.ids.append(token)
        return self._scan.feed(self._new_text(final=False))

    def finish(self) -> str:
        """Whatever was held back (no stop string came)."""
        return "" if self.stopped else self._scan.feed(self._new_text(final=True), final=True)

    def _new_text(self, final: bool) -> str:
        """The text the ids after ``_read`` add, decoding only a window from ``_prefix`` (so
        a token that merges with the one before decodes right); '' while it ends in a partial
        UTF-8 character, unless ``final`` or held for ``MAX_HELD_TOKENS``."""
        window = self.ids[self._prefix:]
        done = self.decode(window[:self._read - self._prefix])
        text = self.decode(window)
        if text.endswith("\ufffd") and not final and \
                len(self.ids) - self._read < MAX_HELD_TOKENS:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done):]
