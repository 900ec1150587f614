"""The node's one ASGI app: the OpenAI routes and the session API as two routers.

``build_app(openai=..., sessions=...)`` mounts either or both (``node.serving.openai_routes``,
``node.serving.session_routes``) behind one ``BearerAuth`` (``node.serving.server_http``), with one set of
error handlers: an ``APIError`` is OpenAI's ``{"error": {message, type, param, code}}``, a
session-API error its ``{"error": str}``, an unknown path a 404 and an unexpected exception a
500 "internal error" in the shape of the path's router. With the OpenAI routes, every request
is a ``RequestRecord`` (``node.serving.serve_metrics``: ``/metrics`` and one log line) from its first
byte to its reply's last.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from node.serving.openai_protocol import APIError
from node.serving.serve_metrics import RequestRecord, ServeMetrics
from node.serving.server_http import BearerAuth, Unauthorized

_log = logging.getLogger("fedkv.server")
THREADS = 256
"""Worker threads for blocking work (token reads, the session agent): more than the requests
the server admits, so a waiting request never holds up another's next token."""


class RecordRequests:
    """ASGI middleware: a ``RequestRecord`` per request, observed once its reply has ended."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rec = RequestRecord(scope["method"], scope["path"])
        scope.setdefault("state", {})["record"] = rec

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
            await send(message)
        with self.metrics.request(rec):
            await self.app(scope, receive, sending)


def _is_session_path(path: str) -> bool:
    return path.startswith("/v1/sessions")


def _error(request: Request, status: int, message: str, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the path's router."""
    st = request.app.state
    if st.sessions is not None and (st.openai is None or _is_session_path(request.url.path)):
        return JSONResponse({"error": message}, status, headers)
    err = APIError(status, message, None, code,
                   "server_error" if status >= 500 else "invalid_request_error")
    rec = request.scope.get("state", {}).get("record")
    if rec is not None:
        rec.error = code
    return JSONResponse(err.body(), status, headers)


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        rec = request.scope.get("state", {}).get("record")
        if rec is not None:
            rec.error = e.code
        return JSONResponse(e.body(), e.status, e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            return _error(request, 404, f"no such path {request.url.path}", "not_found")
        return _error(request, e.status_code, str(e.detail), None, e.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        _log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return _error(request, 500, "internal error")


def _lifespan(sessions: Any):
    """Threads for blocking work; with a session agent, its between-requests duties
    (``ServingAgent.idle``: ACK write-backs, expire idle sessions) every 20 ms."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        task = None
        if sessions is not None:
            async def tend() -> None:
                while True:
                    await run_in_threadpool(sessions.idle, False)
                    await asyncio.sleep(0.02)
            task = asyncio.create_task(tend())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
    return lifespan


def build_app(openai: Any = None, sessions: Any = None, tenants: Any = None,
              body_timeout_s: float = 10.0) -> FastAPI:
    """The app: ``openai`` an ``OpenAIState``, ``sessions`` a ``ServingAgent``; ``tenants``
    defaults to ``openai.tenants`` (reassigning ``app.state.tenants`` takes effect at once);
    ``body_timeout_s``: the session API's body deadline (the OpenAI routes' is their
    config's ``socket_timeout_s``)."""
    from node.serving import openai_routes, session_routes
    if openai is None and sessions is None:
        raise ValueError("an app serves the OpenAI routes, the session API, or both")
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None,
                  lifespan=_lifespan(sessions))
    app.state.openai, app.state.sessions = openai, sessions
    app.state.body_timeout_s = body_timeout_s
    app.state.tenants = tenants if tenants is not None else openai.tenants
    public = openai_routes.public(openai.config.metrics_auth) if openai else (lambda p: False)

    def refusal(path: str) -> Unauthorized:
        if sessions is not None and (openai is None or _is_session_path(path)):
            return session_routes.UNAUTHORIZED
        return openai_routes.UNAUTHORIZED
    app.add_middleware(BearerAuth, tenants=lambda: app.state.tenants, refusal=refusal,
                       public=public)
    if openai is not None:
        app.include_router(openai_routes.router)
        app.add_middleware(RecordRequests, metrics=openai.metrics)  # outermost: sees the 401s
    if sessions is not None:
        app.include_router(session_routes.router)
    _handlers(app)
    return app
