"""A request body's JSON object, or a clear ``BadJSON`` (a 400) for what ``json.loads`` lets by.

Why not ``json.loads`` alone: it keeps a lone surrogate (``"\\ud800"``) as a ``str`` that no
UTF-8 encoder takes, so the request failed later (encoding the prompt: a 500); and deeply
nested arrays raise ``RecursionError`` (not a ``ValueError``: a 500 too). Both servers
(``node.serving.serve``, ``node.serving.openai_api``) decode their bodies here, so both answer 400 naming
the problem before anything else reads the request.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""Nesting a request may use (OpenAI's deepest field, a message's content part, is 4)."""


class BadJSON(ValueError):
    """The body is not a JSON object a server can take; the message says why."""


def decode_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``: no lone surrogate in any key or string, at most
    ``MAX_DEPTH`` levels deep; else ``BadJSON``."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadJSON(f"the body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise BadJSON(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadJSON("the body must be a JSON object")
    _check(body)
    return body


def _check(body: dict[str, Any]) -> None:
    """Walk ``body`` without recursion (a deep value must not overflow this either)."""
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise BadJSON(f"the body is nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, str):
            _text(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                _text(k)
                todo.append((v, depth + 1))
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)


def _text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadJSON(f"the body holds a lone surrogate ({s[e.start]!a} at offset {e.start} of a "
                      "string): not Unicode text") from None
