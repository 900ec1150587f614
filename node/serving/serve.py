"""A node's serving agent: answers chat prompts from the node's parameters while its ClientApp
processes train and write back.

    python -m node.serving.serve --cache-dir DIR [--key-file DIR/../kv-cache.key] [--port 8470]
        [--token-file DIR/../serve-token] [--max-sessions 16] [--idle-expiry-s 600]
        [--socket-timeout 10] [--pool-mib MiB] [--max-context N] [--log-level INFO]
        [--host 127.0.0.1 [--tls-cert C --tls-key K]] [--model byte|smollm2 [--model-dir DIR]]

``--model smollm2`` serves SmolLM2-135M-Instruct (``node.models.llama.LlamaModel`` and
``node.models.chat.ChatCodec`` read from ``--model-dir``, default ``node.models.smollm2.default_dir()``; absent:
an error naming ``python -m node.models.smollm2 fetch``) with its chat template: the system prompt is
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
(``node.serving.param_channel``), sealed with the node's cache key.

Fit for a shared host (``node.serving.serve_auth``). Every request needs ``Authorization: Bearer
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
The HTTP side is the session router of the node's one ASGI app (``node.serving.session_routes``,
``node.serving.server_app``; this module's ``main`` is ``node.serving.server_cli``'s): one event loop holds
every connection, a request head or body not sent within ``--socket-timeout`` is cut, so an idle
or slow client never blocks another; the model and cache are used by one request at a time, on
a worker thread, never while a request body is being read. The agent binds loopback; another ``--host`` is refused
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
import logging
import os
import secrets
import sys
import threading
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cache import KVCache
from cache.coherence import Mode
from cache.errors import CacheFullError
from crypto import PASSPHRASE_ENV
from node.models.interface import CachedLM
from node.serving import server_cli
from node.serving.param_follower import ParamFollower
from node.serving.serve_auth import SessionRegistry, default_token_file, load_tenants
from node.serving.served_model import POOL_MIB, node_key
from node.serving.server_app import build_app
from node.serving.turn_options import TurnOptions
from node.engine.sessions import Sessions
from node.tasks.tasks import lm_model, parameter_layout

_log = logging.getLogger("fedkv.serve")
LIVE_SUBDIR = "serve"
"""``python -m cache stats --dir <cache-dir>/serve`` reads (and ``set`` changes) this agent's cache."""
MAX_SESSIONS = 16
"""Open sessions per tenant (``--max-sessions``)."""
IDLE_EXPIRY_S = 600.0
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
        """``model``: the node's language model family (default ``node.tasks.tasks.lm_model``);
        its parameters come from the trainer's published file. ``own_weights``: the model
        arrives with its weights (SmolLM2 from its directory): the agent serves them without
        waiting for published parameters, and takes published ones only if they fit it.
        ``codec``: ``node.models.chat.ChatCodec`` for a model with a chat template (None: bytes)."""
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


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m node.serving.serve", description=__doc__.split("\n\n")[0])
    server_cli.common_arguments(p, 8470)
    p.add_argument("--cache-dir", required=True, type=Path, help="the node's cache directory")
    p.add_argument("--key-file", type=Path, default=None,
                   help="the node's sealed cache key (default: kv-cache.key beside --cache-dir; "
                        f"passphrase in ${PASSPHRASE_ENV})")
    p.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                   help="open sessions per tenant; more get 429")
    p.add_argument("--idle-expiry-s", type=float, default=IDLE_EXPIRY_S,
                   help="a session idle this long is closed and its blocks freed")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write {pid, port, version} here once serving")
    p.add_argument("--coherence", type=int, choices=[1, 2], default=2,
                   help="coherence_protocol: 2 strong (default), 1 relaxed")
    p.add_argument("--no-key", action="store_true", help="the cache is not encrypted (tests)")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="how long to wait for the node's key and first parameters")
    args = p.parse_args(argv)
    server_cli.check_common(p, args)
    if args.max_sessions < 1 or args.idle_expiry_s <= 0:
        p.error("--max-sessions and --idle-expiry-s must be positive")
    return args


def _key(args: argparse.Namespace) -> bytes | None:
    return None if args.no_key else node_key(args.cache_dir, args.key_file, args.wait_s)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    server_cli.setup_logging(args.log_level, "serve")
    tenants = load_tenants(args.token_file or default_token_file(args.cache_dir), _log.info)
    model, codec = server_cli.load_served(args)
    agent = ServingAgent(args.cache_dir, _key(args), mode=Mode(args.coherence), wait_s=args.wait_s,
                         pool_bytes=server_cli.pool_bytes(args, model),
                         max_sessions=args.max_sessions, idle_expiry_s=args.idle_expiry_s,
                         model=model, codec=codec, own_weights=args.model != "byte")
    app = build_app(sessions=agent, tenants=tenants, body_timeout_s=args.socket_timeout)

    def ready(port: int, tls: bool) -> None:
        if args.ready_file:
            server_cli.write_ready(args.ready_file, port, agent.version)
        _log.info("pid %d serving %s (%s) on %s://%s:%d for %d tenant(s)", os.getpid(),
                  args.cache_dir, args.model, "https" if tls else "http", args.host, port,
                  len(tenants.names))
    server_cli.serve(app, args, ready, agent.close)
    return 0


if __name__ == "__main__":
    sys.exit(main())
