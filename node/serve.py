"""A node's serving agent: answers chat prompts from the node's parameters while its ClientApp
processes train and write back.

    python -m node.serve --cache-dir DIR [--key-file DIR/../kv-cache.key] [--port 8470]
        [--token-file DIR/../serve-token] [--max-sessions 16] [--idle-expiry-s 600]
        [--socket-timeout 10] [--pool-mib 8] [--host 127.0.0.1 [--tls-cert C --tls-key K]]
        [--model byte|smollm2 [--model-dir DIR]]

``--model smollm2`` serves SmolLM2-135M-Instruct (``node.llama.LlamaModel`` and
``node.chat.ChatCodec`` read from ``--model-dir``, default ``node.models.default_dir()``; absent:
an error naming ``python -m node.models fetch``) with its chat template: the system prompt is
the templated system message, a turn the templated user message, a reply ends at EOS, a stop
string or max tokens. Its weights are its own (it still ACKs the trainer's write-backs and takes
published parameters only if they fit it). The default ``byte`` model is unchanged.

It is the second agent of the node's cache directory (``cache.coherence_file``): it holds the
``param`` entry shared and keeps its own K/V (in memory: the directory's block store belongs
to one process at a time, the ClientApp's). Each write-back by the trainer invalidates
``param`` (strong MESI by default); the agent polls between tokens, so the write cannot
complete before the agent has dropped its K/V, and every token it returns afterwards is
computed with the new weights over K/V computed by them: a turn interrupted by a write-back is
rolled back and decoded again. Parameters come from the file the trainer publishes
(``node.param_channel``), sealed with the node's cache key.

Fit for a shared host (``node.serve_auth``). Every request needs ``Authorization: Bearer
<token>`` (the default and only mode); without a valid one it gets 401 ``{"error":
"unauthorized"}`` whatever the path. On first start the agent writes ``--token-file`` (default
``<cache-dir>/../serve-token``): one random token, mode 0600, its directory 0700 if it made
it; more tenants are more ``tenant:token`` lines (a bare token is the tenant ``default``).
Session ids are 128 random bits (32 hex digits) bound to the tenant that made them: another
tenant's id, a closed, expired or never-issued one all get the same 404 ``{"error": "no such
session"}``. Each tenant holds at most ``--max-sessions`` open sessions (then 429); a session
idle for ``--idle-expiry-s`` is closed and its blocks freed. A full KV pool answers 503 with
``{"error"}`` and leaves the session as it was before the request. Each tenant's sessions
share system-prompt blocks only with each other (the tenant is the prefix namespace of the
block hashes), so a tenant sees no prefix hit -- counter or latency -- on another's prompt.
Connections are served on threads with a socket timeout (``--socket-timeout``): an idle or
slow client never blocks another; the model and cache are used by one request at a time, never
while a request body is being read. The agent binds loopback; another ``--host`` is refused
unless ``--tls-cert`` and ``--tls-key`` are given (TLS 1.2 or newer).

Endpoints (JSON): ``POST /v1/sessions`` ``{"system": str}`` -> ``{"session"}``;
``POST /v1/sessions/<id>`` ``{"text": str, "max_tokens" (or "max_new_tokens"): int in [0, 128]
(16), "temperature": [0, 10] (0: greedy), "top_p": (0, 1] (1), "stop": [str, ...] (at most 8, 1-64
characters each), "seed": int in [0, 2**63-1]}`` -> ``{"reply", "reply_hex" (byte model) or
"reply_tokens" (smollm2), "stop_reason" ("length", "eos" or "stop"), "version", "recomputed"}``
(``reply`` is cut before a stop string; the session keeps every token decoded). Options are
checked strictly before the session is touched: an unknown field, a wrong type, NaN or a value
out of range is a 400 naming the field. Sampling draws from a ``torch.Generator`` of the
request's own, seeded from ``secrets`` unless ``seed`` is given (then the reply repeats);
``GET /v1/sessions/<id>`` -> ``{"session", "tokens", "history_hex"}`` (smollm2: ``"history"``,
the templated conversation); ``DELETE /v1/sessions/<id>``; ``GET /v1/stats``: the model version and
write-backs seen, and the caller's tenant's own counters only (sessions, turns, tokens, prefix
hits of its own sessions; never the engine-wide hit rate). Bad requests get 400 with
``{"error"}``; the agent goes on. Its cache is live to the node's owner: ``python -m cache stats
--dir <cache-dir>/serve`` (``--dir <cache-dir>`` shows it too while the trainer's engine is not
live) and ``python -m cache set KEY VALUE --dir <cache-dir>/serve``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import socket
import ssl
import sys
import threading
from collections import defaultdict
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cache import KVCache
from cache.coherence import Mode
from cache.errors import CacheFullError
from crypto import PASSPHRASE_ENV
from node.model_interface import CachedLM
from node.models import ModelError
from node.param_follower import ParamFollower
from node.request_json import decode_object
from node.serve_auth import (NoSuchSession, QuotaExceeded, SessionRegistry, Tenants, check_bind,
                             default_token_file, load_tenants, tls_context)
from node.served_model import (DTYPE_ARGUMENT, MODELS, POOL_MIB, SMOLLM2_POOL_MIB, load_model,
                                node_key)
from node.turn_options import TurnOptions, parse_turn
from node.sessions import Sessions, UnknownSessionError
from node.tasks import lm_model, parameter_layout

_log = logging.getLogger("fedkv.serve")
LIVE_SUBDIR = "serve"
"""``python -m cache stats --dir <cache-dir>/serve`` reads (and ``set`` changes) this agent's cache."""
MAX_BODY = 1 << 16
MAX_SESSIONS = 16
"""Open sessions per tenant (``--max-sessions``)."""
IDLE_EXPIRY_S = 600.0
SOCKET_TIMEOUT_S = 10.0
_PREFIX_COUNTERS = ("prefix_lookups", "prefix_hit_blocks", "prefix_hit_tokens")


class ModelChanged(Exception):
    """A write-back invalidated ``param`` in the middle of a turn: roll it back, reload."""


@dataclass
class TenantCounters:
    """One tenant's own activity: ``GET /v1/stats`` shows the caller's and nobody else's."""

    sessions_created: int = 0
    sessions_closed: int = 0
    expired: int = 0
    """Sessions closed by the agent after ``idle_expiry_s`` without a request."""
    turns: int = 0
    tokens: int = 0
    rolled_back_turns: int = 0
    recomputed_tokens: int = 0
    cache_full: int = 0
    """Requests answered 503 because the KV pool had no free block."""
    prefix_lookups: int = 0
    prefix_hit_blocks: int = 0
    """System-prompt blocks reused from the tenant's own earlier sessions (never another's)."""
    prefix_hit_tokens: int = 0


class ServingAgent:
    """The model, its own KVCache and chat sessions, kept coherent with the trainer's writes.

    Safe to call from many threads: every method takes ``lock`` (the engine is not
    thread-safe), so requests use the model one at a time."""

    def __init__(self, cache_dir: str | os.PathLike, key: bytes | None, *,
                 mode: Mode = Mode.STRONG, timeout_s: float = 30.0, wait_s: float = 60.0,
                 pool_bytes: int = int(POOL_MIB * (1 << 20)), max_sessions: int = MAX_SESSIONS,
                 idle_expiry_s: float = IDLE_EXPIRY_S, model: CachedLM | None = None,
                 codec: Any = None, own_weights: bool = False):
        """``model``: the node's language model family (default ``node.tasks.lm_model``);
        its parameters come from the trainer's published file. ``own_weights``: the model
        arrives with its weights (SmolLM2 from its directory): the agent serves them without
        waiting for published parameters, and takes published ones only if they fit it.
        ``codec``: ``node.chat.ChatCodec`` for a model with a chat template (None: bytes)."""
        self.cache_dir, self.key = Path(cache_dir), key
        self.lock = threading.Lock()
        self.model = (model if model is not None else lm_model()).eval()
        self.codec, self.own_weights = codec, own_weights
        self.layout = parameter_layout(self.model)
        self.cache = KVCache(self.model.cache_config(pool_bytes=pool_bytes))
        self.sessions = Sessions(self.model, self.cache, codec)
        self.sessions.before_token = self.check
        self.registry = SessionRegistry(max_sessions, idle_expiry_s)
        self.tenants: defaultdict[str, TenantCounters] = defaultdict(TenantCounters)
        self.cache.go_live(self.cache_dir / LIVE_SUBDIR)  # python -m cache stats|set --dir ...
        self.follower = ParamFollower(self.cache_dir, key, self.model, self.layout, mode=mode,
                                      timeout_s=timeout_s, wait_s=wait_s, own_weights=own_weights)
        self.counters = self.follower.counters
        self._load()

    @property
    def version(self) -> int:
        return self.cache.version

    def _load(self) -> None:
        """The published parameters (``ParamFollower.load``); K/V of other versions are never
        served again."""
        version = self.follower.load(self.version)
        if version is not None:
            self.cache.set_version(version)

    def check(self) -> None:
        """Between tokens: ACK pending invalidations; a dropped ``param`` means new weights."""
        if self.follower.poll():
            raise ModelChanged

    def idle(self, blocking: bool = True) -> None:
        """Between requests: the same check, reloading at once; tunable changes are taken;
        idle sessions expire. ``blocking=False``: skipped while a request holds the model
        (its turn polls between tokens)."""
        if not self.lock.acquire(blocking=blocking):
            return
        try:
            self._idle()
        finally:
            self.lock.release()

    def _idle(self) -> None:
        try:
            self.check()
        except ModelChanged:
            self._load()
        self._expire()
        self.cache.idle()

    def _expire(self) -> None:
        for sid in self.registry.idle():
            tenant = self.registry.owner(sid)
            self._close(sid)
            self.tenants[tenant].expired += 1
            _log.info("session of tenant %s expired", tenant)

    def _close(self, sid: str) -> None:
        self.registry.remove(sid)
        self.sessions.close(sid)

    def _counted(self, tenant: str, fn):
        """``fn()`` with the engine's prefix counters it moved put on ``tenant``'s account
        (exact: no other request runs meanwhile), and a full pool counted."""
        c = self.cache.blocks.counters
        before = [c[k] for k in _PREFIX_COUNTERS]
        try:
            return fn()
        except CacheFullError:
            self.tenants[tenant].cache_full += 1
            raise
        finally:
            t = self.tenants[tenant]
            for k, b in zip(_PREFIX_COUNTERS, before):
                setattr(t, k, getattr(t, k) + c[k] - b)

    def _as_text(self, text: str | bytes) -> str | bytes:
        """A chat codec templates ``str`` (bytes are read as UTF-8); the byte model takes either."""
        if self.codec is not None and isinstance(text, (bytes, bytearray)):
            return bytes(text).decode("utf-8")
        return text

    def create(self, tenant: str, system: str | bytes) -> str:
        """A new session of ``tenant``: QuotaExceeded past its quota, CacheFullError (nothing
        left behind) when the pool cannot hold the system prompt."""
        with self.lock:
            self._idle()  # the system prompt is prefilled under the newest weights
            sid = self.registry.new_id(tenant)
            system = self._as_text(system)
            self._counted(tenant, lambda: self.sessions.create(system, sid, namespace=tenant))
            self.registry.add(tenant, sid)
            self.tenants[tenant].sessions_created += 1
            return sid

    def send(self, tenant: str, session_id: str, text: str | bytes,
             options: TurnOptions | int = TurnOptions()) -> dict:
        """One turn, decoded again from the turn's start when a write-back interrupts it (with
        the same sampling seed); a turn the pool cannot hold is rolled back whole
        (CacheFullError, session as before). ``options``: a ``TurnOptions`` (an int is
        ``max_new_tokens``, greedy)."""
        if isinstance(options, int):
            options = TurnOptions(max_new_tokens=options)
        seed = options.seed if options.seed is not None else secrets.randbits(63)
        text = self._as_text(text)
        with self.lock:
            self._expire()  # an idle session is gone even between the main loop's passes
            self.registry.use(tenant, session_id)
            session = self.sessions.session(session_id)
            history = self.sessions.tokens(session_id)
            messages = list(session.messages)
            t = self.tenants[tenant]

            def turn():
                return self.sessions.turn(session_id, text, options.max_new_tokens,
                                          sampling=options.sampling(seed), stop=options.stop)
            while True:
                try:
                    r = self._counted(tenant, turn)
                    break
                except ModelChanged:
                    t.rolled_back_turns += 1
                    self._load()
                    self.sessions.rollback(session_id, len(history))
                    session.messages = list(messages)
                except CacheFullError:  # the turn's text or part of its reply is in: undo it
                    if self.sessions.tokens(session_id) != history:
                        self.sessions.rollback(session_id, len(history))
                    session.messages = list(messages)
                    raise
            t.turns += 1
            t.tokens += len(r.tokens)
            t.recomputed_tokens += r.recomputed
            out: dict[str, Any] = {"reply": r.text if r.text is not None else
                                   r.reply.decode("utf-8", "replace")}
            if self.codec is None:  # the byte model: the reply's bytes as the session holds them
                out["reply_hex"] = r.reply.hex()
            else:
                out["reply_tokens"] = list(r.tokens)
            return {**out, "stop_reason": r.stop_reason, "version": self.version,
                    "recomputed": r.recomputed}

    def read(self, tenant: str, session_id: str) -> dict:
        with self.lock:
            self._expire()
            self.registry.use(tenant, session_id)
            if self.codec is not None:  # token ids: the templated conversation as text
                ids = self.sessions.tokens(session_id)
                return {"session": session_id, "tokens": len(ids),
                        "history": self.codec.tokenizer.decode(ids)}
            history = self.sessions.history(session_id)
            return {"session": session_id, "tokens": len(history), "history_hex": history.hex()}

    def close_session(self, tenant: str, session_id: str) -> None:
        with self.lock:
            self._expire()
            self.registry.use(tenant, session_id)
            self._close(session_id)
            self.tenants[tenant].sessions_closed += 1

    def stats(self, tenant: str) -> dict:
        """The model's version and write-backs seen, and ``tenant``'s own counters: nothing
        about other tenants, nor the engine-wide prefix hit rate."""
        with self.lock:
            self._expire()
            return {"tenant": tenant, "version": self.version, **asdict(self.counters),
                    "sessions": self.registry.count(tenant), **asdict(self.tenants[tenant])}

    def close(self) -> None:
        self.follower.leave()


_UNAUTHORIZED = {"error": "unauthorized"}


class _Handler(BaseHTTPRequestHandler):
    server: ServeHTTPServer
    server_version, sys_version = "fedkv-serve", ""  # the Server header names no versions

    def log_message(self, fmt: str, *args) -> None:  # requests go to the logger, not stderr
        _log.debug(fmt, *args)

    def setup(self) -> None:
        self.timeout = self.server.socket_timeout  # every read and write of this connection
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, on this thread, under the timeout

    def _reply(self, status: HTTPStatus, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _tenant(self) -> str | None:
        """The caller's tenant; None after answering 401 (nothing read, nothing revealed)."""
        tenant = self.server.tenants.authenticate(self.headers.get("Authorization"))
        if tenant is None:
            self.close_connection = True  # an unread body is not read: the connection ends
            self._reply(HTTPStatus.UNAUTHORIZED, _UNAUTHORIZED,
                        {"WWW-Authenticate": 'Bearer realm="fedkv-serve"'})
        return tenant

    def _body(self) -> dict:
        """The JSON body, read before the model is taken (a slow sender holds only its thread)."""
        n = int(self.headers.get("Content-Length") or 0)
        if not 0 <= n <= MAX_BODY:
            raise ValueError(f"body of {n} bytes (at most {MAX_BODY})")
        return decode_object(self.rfile.read(n) or b"{}")  # BadJSON: a ValueError, so a 400

    def _guarded(self, fn) -> None:
        try:
            self._reply(HTTPStatus.OK, fn())
        except (NoSuchSession, UnknownSessionError):
            self._reply(HTTPStatus.NOT_FOUND, {"error": str(NoSuchSession())})
        except QuotaExceeded as e:
            self._reply(HTTPStatus.TOO_MANY_REQUESTS, {"error": str(e)})
        except CacheFullError:
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE,
                        {"error": "the KV cache is full: no free block for this request; the "
                                  "session is as it was before it. Retry later, or close "
                                  "sessions (DELETE /v1/sessions/<id>)"},
                        {"Retry-After": "1"})
        except (ValueError, TypeError) as e:  # json errors are ValueErrors
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"{type(e).__name__}: {e}"})
        except OSError:
            raise  # the connection itself (a timeout reading the body): nothing to answer on
        except Exception:
            _log.exception("request %s %s failed", self.command, self.path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error"})

    def _session_id(self) -> str | None:
        sid = self.path.removeprefix("/v1/sessions/")
        return sid if sid != self.path and sid and "/" not in sid else None

    def _no_path(self) -> None:
        self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

    def do_GET(self) -> None:
        if (tenant := self._tenant()) is None:
            return
        a = self.server.agent
        if self.path == "/v1/stats":
            self._guarded(lambda: a.stats(tenant))
        elif (sid := self._session_id()) is not None:
            self._guarded(lambda: a.read(tenant, sid))
        else:
            self._no_path()

    def do_POST(self) -> None:
        if (tenant := self._tenant()) is None:
            return
        a = self.server.agent
        if self.path == "/v1/sessions":
            self._guarded(lambda: {"session": a.create(tenant, _text(self._body(), "system", ""))})
        elif (sid := self._session_id()) is not None:
            def turn() -> dict:
                text, options = parse_turn(self._body())  # all checked before the model is taken
                return a.send(tenant, sid, text, options)
            self._guarded(turn)
        else:
            self._no_path()

    def do_DELETE(self) -> None:
        if (tenant := self._tenant()) is None:
            return
        if (sid := self._session_id()) is None:
            return self._no_path()

        def close() -> dict:
            self.server.agent.close_session(tenant, sid)
            return {"closed": sid}
        self._guarded(close)


def _text(body: dict, name: str, default: str | None = None) -> bytes:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise TypeError(f"{name!r} must be a string")
    return value.encode("utf-8")


class ServeHTTPServer(ThreadingHTTPServer):
    """A thread per connection (daemon threads; each socket read and write bounded by
    ``socket_timeout``), the agent used by one request at a time; between requests the main
    loop lets the agent ACK invalidations and expire idle sessions."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], agent: ServingAgent, tenants: Tenants, *,
                 socket_timeout: float = SOCKET_TIMEOUT_S, tls: ssl.SSLContext | None = None):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.agent, self.tenants, self.socket_timeout = agent, tenants, socket_timeout
        if tls is not None:  # the handshake happens on the connection's thread (_Handler.setup)
            self.socket = tls.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)

    def service_actions(self) -> None:
        self.agent.idle(blocking=False)

    def handle_error(self, request, client_address) -> None:
        """A client that timed out, hung up or failed the TLS handshake: logged, not printed."""
        e = sys.exc_info()[1]
        if isinstance(e, (OSError, ssl.SSLError)):
            _log.debug("connection from %s: %s: %s", client_address, type(e).__name__, e)
        else:
            _log.exception("error serving %s", client_address)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m node.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", required=True, type=Path, help="the node's cache directory")
    p.add_argument("--key-file", type=Path, default=None,
                   help="the node's sealed cache key (default: kv-cache.key beside --cache-dir; "
                        f"passphrase in ${PASSPHRASE_ENV})")
    p.add_argument("--token-file", type=Path, default=None,
                   help="bearer tokens, one 'tenant:token' (or bare token: tenant 'default') a line, "
                        "mode 0600; written with one fresh token on first start (default: "
                        "serve-token beside --cache-dir)")
    p.add_argument("--host", default="127.0.0.1",
                   help="loopback by default; another address only with --tls-cert and --tls-key")
    p.add_argument("--port", type=int, default=8470, help="0 = any free port")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (chain): serve TLS")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                   help="open sessions per tenant; more get 429")
    p.add_argument("--idle-expiry-s", type=float, default=IDLE_EXPIRY_S,
                   help="a session idle this long is closed and its blocks freed")
    p.add_argument("--socket-timeout", type=float, default=SOCKET_TIMEOUT_S,
                   help="seconds a connection may stay silent (or stall a read) before it is dropped")
    p.add_argument("--pool-mib", type=float, default=None,
                   help=f"the agent's KV pool (MiB; default {POOL_MIB:g}, {SMOLLM2_POOL_MIB:g} "
                        "for smollm2)")
    p.add_argument("--model", choices=MODELS, default="byte",
                   help="byte: the node's byte-level model, parameters published by the trainer "
                        "(default); smollm2: SmolLM2-135M-Instruct from --model-dir with its chat "
                        "template, EOS and stop strings")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the converted SmolLM2 directory (default: $FEDKV_MODEL_DIR, else "
                        "~/.cache/fedkv/models/smollm2-135m-instruct; python -m node.models fetch)")
    p.add_argument("--dtype", **DTYPE_ARGUMENT)
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write {pid, port, version} here once serving")
    p.add_argument("--coherence", type=int, choices=[1, 2], default=2,
                   help="coherence_protocol: 2 strong (default), 1 relaxed")
    p.add_argument("--no-key", action="store_true", help="the cache is not encrypted (tests)")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="how long to wait for the node's key and first parameters")
    args = p.parse_args(argv)
    try:
        check_bind(args.host, args.tls_cert, args.tls_key)
    except ValueError as e:
        p.error(str(e))
    if args.model_dir is not None and args.model != "smollm2":
        p.error("--model-dir is for --model smollm2")
    if args.pool_mib is None:
        args.pool_mib = SMOLLM2_POOL_MIB if args.model == "smollm2" else POOL_MIB
    if args.max_sessions < 1 or args.idle_expiry_s <= 0 or args.socket_timeout <= 0 or args.pool_mib <= 0:
        p.error("--max-sessions, --idle-expiry-s, --socket-timeout and --pool-mib must be positive")
    return args


def _key(args: argparse.Namespace) -> bytes | None:
    return None if args.no_key else node_key(args.cache_dir, args.key_file, args.wait_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(message)s")
    args = _args(argv)
    tls = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    tenants = load_tenants(args.token_file or default_token_file(args.cache_dir), _log.info)
    try:
        model, codec = load_model(args.model, args.model_dir, args.dtype)
    except ImportError as e:
        raise SystemExit(f"--model {args.model} needs the llm extra (pip install -e '.[llm]'): {e}")
    except ModelError as e:  # names the fix: python -m node.models fetch (--force)
        raise SystemExit(f"--model {args.model}: {e}") from None
    agent = ServingAgent(args.cache_dir, _key(args), mode=Mode(args.coherence), wait_s=args.wait_s,
                         pool_bytes=int(args.pool_mib * (1 << 20)), max_sessions=args.max_sessions,
                         idle_expiry_s=args.idle_expiry_s, model=model, codec=codec,
                         own_weights=args.model != "byte")
    server = ServeHTTPServer((args.host, args.port), agent, tenants,
                             socket_timeout=args.socket_timeout, tls=tls)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    port = server.server_address[1]
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "port": port, "version": agent.version}))
        tmp.replace(args.ready_file)
    _log.info("pid %d serving %s (%s) on %s://%s:%d for %d tenant(s)", os.getpid(), args.cache_dir,
              args.model, "https" if tls else "http", args.host, port, len(tenants.names))
    try:
        server.serve_forever(poll_interval=0.02)
    finally:
        server.server_close()
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
