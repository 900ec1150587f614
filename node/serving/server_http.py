"""The HTTP plumbing every router of the node's app (``node.serving.server_app``) shares: FastAPI on uvicorn.

The OpenAI routes (``node.serving.openai_routes``) and the session API (``node.serving.session_routes``) are
two ``APIRouter``s of the app ``build_app`` makes; everything they share lives here, once:

* **Auth** (``BearerAuth``): every request needs ``Authorization: Bearer <token>`` of a tenant
  (``node.serving.serve_auth.Tenants``) before any route is even matched -- a caller without a token
  cannot tell which paths exist -- except the public paths an app names (``/health``,
  ``/metrics``). The 401's body is the router's own shape (``Unauthorized``); the tenant is
  ``request.state.tenant`` (``tenant`` is the routes' dependency).
* **Limits** (``ServerLimits``): the body's size and read deadline (``read_body``: a client that
  announces a body and never sends it gets 408 and holds nothing), the header deadline
  (``HeaderDeadline``: uvicorn has none, so a client trickling its request line and headers
  is dropped after ``socket_timeout_s``), keep-alive and connection limits (uvicorn's
  ``timeout_keep_alive``, ``limit_concurrency``). One event loop serves every connection: an
  idle, slow or stuck client holds a few KiB, never a thread.
* **TLS**: uvicorn's ``ssl_certfile``/``ssl_keyfile``, TLS 1.2 or newer.
* ``LiveServer``: uvicorn on a socket bound at construction (``server_address`` is known at
  once; port 0 picks a free one), served from any thread (``serve_forever``/``shutdown``/
  ``server_close``, as ``socketserver`` servers, so tests and CLIs start it alike).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from node.serving.request_json import BadJSON, decode_object

_log = logging.getLogger("fedkv.server")


@dataclass(frozen=True)
class ServerLimits:
    """What any one connection may hold of the server."""

    socket_timeout_s: float = 10.0
    """Seconds a client may take to send its request line and headers, and then its body;
    also the keep-alive idle time between requests."""
    max_body: int = 1 << 20
    """Bytes a request body may have (more: 400 before the rest is read)."""
    limit_concurrency: int = 512
    """Connections and tasks at once (uvicorn's ``limit_concurrency``: more get 503)."""


class BodyError(ValueError):
    """The body is too large, came too slowly, or is not a JSON object (a 400 or 408)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def read_body(request: Request, max_body: int, timeout_s: float) -> bytes:
    """The whole body, at most ``max_body`` bytes, within ``timeout_s`` of the first read."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_body):
        raise BodyError(f"the body must be at most {max_body} bytes (Content-Length "
                        f"{declared[:20]!r})")

    async def collect() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise BodyError(f"the body must be at most {max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)
    try:
        return await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyError(f"the body did not arrive within {timeout_s:g} s", 408) from None


async def read_json(request: Request, max_body: int, timeout_s: float,
                    empty: bytes | None = None) -> dict[str, Any]:
    """``read_body`` decoded by ``node.serving.request_json.decode_object`` (no lone surrogate, at
    most 64 levels deep, invalid UTF-8 named): ``BodyError`` otherwise. ``empty``: what an
    empty body means (None: an error)."""
    raw = await read_body(request, max_body, timeout_s)
    if not raw and empty is not None:
        raw = empty
    if not raw:
        raise BodyError(f"the body must be a JSON object of 1 to {max_body} bytes")
    try:
        return decode_object(raw)
    except BadJSON as e:
        raise BodyError(str(e)) from None


# -- auth -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unauthorized:
    """A router's 401: its body and realm (the session API and OpenAI's shapes differ)."""

    body: dict[str, Any]
    realm: str


class BearerAuth:
    """ASGI middleware: the tenant of the bearer token, or the 401 of the path's router."""

    def __init__(self, app: ASGIApp, tenants: Callable[[], Any],
                 refusal: Callable[[str], Unauthorized], public: Callable[[str], bool]):
        self.app, self.tenants, self.refusal, self.public = app, tenants, refusal, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.public(scope["path"]):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization")
        tenant = self.tenants().authenticate(header.decode("latin-1") if header else None)
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            return await self.app(scope, receive, send)
        no = self.refusal(scope["path"])
        record = scope.get("state", {}).get("record")
        if record is not None and isinstance(no.body.get("error"), dict):
            record.error = no.body["error"].get("code")
        data = json.dumps(no.body).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (b"www-authenticate", f'Bearer realm="{no.realm}"'.encode()),
            (b"connection", b"close")]})  # its body is not read: the connection ends
        await send({"type": "http.response.body", "body": data})


def tenant(request: Request) -> str:
    """The routes' dependency: the tenant ``BearerAuth`` authenticated."""
    return request.state.tenant


# -- the header deadline --------------------------------------------------------------------------
class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's HTTP protocol with a deadline on the request line and headers: armed when a
    connection opens and when a request begins, disarmed once its headers are complete; a
    client still trickling them when it fires is disconnected (uvicorn has no such timeout:
    its keep-alive timer stops at the first byte)."""

    _deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        seconds = getattr(self.config, "header_timeout_s", 10.0)
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        _log.debug("a client sent no complete request head in time: disconnected")
        self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


# -- a live server ---------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class LiveServer:
    """``app`` on uvicorn, on a socket bound now (see the module docstring)."""

    def __init__(self, app: FastAPI, address: tuple[str, int],
                 limits: ServerLimits = ServerLimits(), *, tls_cert: Path | None = None,
                 tls_key: Path | None = None, log_level: str = "warning"):
        self.app = app
        self.socket = _bind(*address)
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app, http=HeaderDeadline, ws="none", lifespan="on", timeout_graceful_shutdown=2, log_level=log_level.lower(),
            access_log=False, timeout_keep_alive=max(1, round(limits.socket_timeout_s)),
            limit_concurrency=limits.limit_concurrency, server_header=False,
            ssl_certfile=str(tls_cert) if tls_cert else None,
            ssl_keyfile=str(tls_key) if tls_key else None)
        config.header_timeout_s = limits.socket_timeout_s  # read by HeaderDeadline
        config.load()
        if config.ssl is not None:
            config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        self.tls = config.ssl is not None
        self.uvicorn = uvicorn.Server(config)
        self._stopped = threading.Event()
        self._stopped.set()

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve until ``shutdown`` (or SIGINT/SIGTERM on the main thread)."""
        self._stopped.clear()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving; returns once ``serve_forever`` has (open streams are cut)."""
        self.uvicorn.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
