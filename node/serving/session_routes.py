"""The session API of a node's serving agent (``node.serving.serve.ServingAgent``): one ``APIRouter``
of the node's app (``node.serving.server_app``).

``POST /v1/sessions`` ``{"system"}``, ``POST /v1/sessions/<id>`` (a turn), ``GET`` and
``DELETE /v1/sessions/<id>``, ``GET /v1/stats``; errors are ``{"error": str}`` (see
``node.serving.serve``'s docstring). The body is read and checked on the event loop before the agent
is touched; the agent (one request at a time, under its lock) runs on a worker thread, so a
slow client never holds the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cache.errors import CacheFullError
from node.serving.serve_auth import NoSuchSession, QuotaExceeded
from node.serving.server_http import BodyError, Unauthorized, read_json, tenant
from node.engine.sessions import UnknownSessionError
from node.serving.turn_options import parse_turn

MAX_BODY = 1 << 16
UNAUTHORIZED = Unauthorized({"error": "unauthorized"}, "fedkv-serve")
CACHE_FULL = ("the KV cache is full: no free block for this request; the session is as it was "
              "before it. Retry later, or close sessions (DELETE /v1/sessions/<id>)")
router = APIRouter()


def _agent(request: Request) -> Any:
    return request.app.state.sessions


async def _body(request: Request) -> dict:
    return await read_json(request, MAX_BODY, request.app.state.body_timeout_s, empty=b"{}")


async def _guarded(fn: Callable[[], Any]) -> JSONResponse:
    """``fn()`` on a worker thread, its errors as the session API's replies."""
    try:
        return JSONResponse(await run_in_threadpool(fn))
    except (NoSuchSession, UnknownSessionError):
        return JSONResponse({"error": str(NoSuchSession())}, 404)
    except QuotaExceeded as e:
        return JSONResponse({"error": str(e)}, 429)
    except CacheFullError:
        return JSONResponse({"error": CACHE_FULL}, 503, {"Retry-After": "1"})
    except (ValueError, TypeError) as e:
        return JSONResponse({"error": f"{type(e).__name__}: {e}"}, 400)


async def _checked(request: Request, parse: Callable[[dict], Any]) -> Any:
    """The body through ``parse``; a ``JSONResponse`` (400/408) when it fails."""
    try:
        return parse(await _body(request))
    except BodyError as e:
        return JSONResponse({"error": f"BadJSON: {e}"}, e.status)
    except (ValueError, TypeError) as e:
        return JSONResponse({"error": f"{type(e).__name__}: {e}"}, 400)


def _text(body: dict, name: str, default: str | None = None) -> bytes:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise TypeError(f"{name!r} must be a string")
    return value.encode("utf-8")


@router.get("/v1/stats")
async def stats(request: Request, who: str = Depends(tenant)) -> JSONResponse:
    return await _guarded(lambda: _agent(request).stats(who))


@router.post("/v1/sessions")
async def create(request: Request, who: str = Depends(tenant)) -> JSONResponse:
    system = await _checked(request, lambda b: _text(b, "system", ""))
    if isinstance(system, JSONResponse):
        return system
    return await _guarded(lambda: {"session": _agent(request).create(who, system)})


@router.post("/v1/sessions/{sid}")
async def turn(sid: str, request: Request, who: str = Depends(tenant)) -> JSONResponse:
    parsed = await _checked(request, parse_turn)  # all checked before the model is taken
    if isinstance(parsed, JSONResponse):
        return parsed
    text, options = parsed
    return await _guarded(lambda: _agent(request).send(who, sid, text, options))


@router.get("/v1/sessions/{sid}")
async def read(sid: str, request: Request, who: str = Depends(tenant)) -> JSONResponse:
    return await _guarded(lambda: _agent(request).read(who, sid))


@router.delete("/v1/sessions/{sid}")
async def close(sid: str, request: Request, who: str = Depends(tenant)) -> JSONResponse:
    def closing() -> dict:
        _agent(request).close_session(who, sid)
        return {"closed": sid}
    return await _guarded(closing)
