"""A node's serving agent: answers chat prompts from the node's parameters while its ClientApp
processes train and write back.

    python -m node.serve --cache-dir DIR [--key-file DIR/../kv-cache.key] [--port 8470]

It is the second agent of the node's cache directory (``cache.coherence_file``): it holds the
``param`` entry shared and keeps its own K/V (in memory: the directory's block store belongs
to one process at a time, the ClientApp's). Each write-back by the trainer invalidates
``param`` (strong MESI by default); the agent polls between tokens, so the write cannot
complete before the agent has dropped its K/V, and every token it returns afterwards is
computed with the new weights over K/V computed by them: a turn interrupted by a write-back is
rolled back and decoded again. Parameters come from the file the trainer publishes
(``node.param_channel``), sealed with the node's cache key.

HTTP (JSON) on loopback by default, without authentication: anyone who can reach the port
can chat with the node's model (never read its parameters or key), so bind another ``--host``
only behind something that authenticates. Endpoints: ``POST /v1/sessions`` ``{"system": str}`` -> ``{"session"}``;
``POST /v1/sessions/<id>`` ``{"text": str, "max_new_tokens": int}`` -> ``{"reply", "reply_hex",
"version", "recomputed"}``; ``DELETE /v1/sessions/<id>``; ``GET /v1/stats``. Bad requests get
400 with ``{"error"}``; the agent goes on. Its cache is live: ``python -m cache stats --dir
<cache-dir>/serve`` (``--dir <cache-dir>`` shows it too while the trainer's engine is not
live) and ``python -m cache set KEY VALUE --dir <cache-dir>/serve``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from cache import KVCache
from cache.coherence import Mode
from cache.coherence_file import FileDirectory
from crypto import PASSPHRASE_ENV, passphrase_from_env, read_secret_file
from node import param_channel
from node.coherence import COHERENCE_DIR, PARAM_ENTRY
from node.model import TinyTransformer
from node.sessions import Sessions, UnknownSessionError
from node.tasks import LM_MODEL

_log = logging.getLogger("fedkv.serve")
LIVE_SUBDIR = "serve"
"""``python -m cache stats --dir <cache-dir>/serve`` reads (and ``set`` changes) this agent's cache."""
MAX_BODY = 1 << 16
MAX_NEW_TOKENS = 128


class ModelChanged(Exception):
    """A write-back invalidated ``param`` in the middle of a turn: roll it back, reload."""


@dataclass
class ServeCounters:
    reloads: int = 0
    invalidations: int = 0
    """``param`` invalidations received (each one a trainer write-back)."""
    turns: int = 0
    tokens: int = 0
    rolled_back_turns: int = 0
    recomputed_tokens: int = 0
    versions_seen: list[int] = field(default_factory=list)


class ServingAgent:
    """The model, its own KVCache and chat sessions, kept coherent with the trainer's writes."""

    def __init__(self, cache_dir: str | os.PathLike, key: bytes | None, *,
                 mode: Mode = Mode.STRONG, timeout_s: float = 30.0, wait_s: float = 60.0):
        self.cache_dir, self.key = Path(cache_dir), key
        self.model = TinyTransformer(LM_MODEL).eval()
        self.cache = KVCache(LM_MODEL.cache_config(pool_bytes=8 << 20))
        self.sessions = Sessions(self.model, self.cache)
        self.sessions.before_token = self.check
        self.cache.go_live(self.cache_dir / LIVE_SUBDIR)  # python -m cache stats|set --dir ...
        self.counters = ServeCounters()
        self.directory = FileDirectory(self.cache_dir / COHERENCE_DIR, mode=mode, timeout_s=timeout_s)
        self.agent = self.directory.join("serve")
        self._wait_s = wait_s
        self._load()

    @property
    def version(self) -> int:
        return self.cache.version

    def _load(self) -> None:
        """Read ``param`` (waits while a writer holds it) and the parameters published. The
        first parameters are waited for *before* taking ``param``: a reader that held it
        while sleeping would hold the trainer's first write up."""
        deadline = time.monotonic() + self._wait_s
        while not param_channel.path_in(self.cache_dir).exists():
            if time.monotonic() > deadline:
                raise param_channel.PublishedParamsError(
                    f"no parameters were published in {self.cache_dir} within {self._wait_s} s")
            time.sleep(0.1)  # the node has not written its parameters yet
        self.agent.acquire_read(PARAM_ENTRY)
        try:
            state, version = param_channel.load(self.cache_dir, self.key, at_least=self.version)
        except param_channel.ParamRollbackError as err:
            _log.error("%s", err)  # keeps serving the version it has
            return
        self.model.load_state_dict(state)
        self.cache.set_version(version)  # K/V of other versions are never served again
        self.counters.reloads += 1
        self.counters.versions_seen.append(version)
        _log.info("serving model version %d", version)

    def check(self) -> None:
        """Between tokens: ACK pending invalidations; a dropped ``param`` means new weights."""
        dropped = self.agent.poll()
        if PARAM_ENTRY in dropped:
            self.counters.invalidations += 1
            raise ModelChanged

    def idle(self) -> None:
        """Between requests: the same check, reloading at once; tunable changes are taken."""
        try:
            self.check()
        except ModelChanged:
            self._load()
        self.cache.idle()

    def create(self, system: bytes) -> str:
        self.idle()  # the system prompt is prefilled under the newest weights
        return self.sessions.create(system)

    def send(self, session_id: str, text: bytes, max_new_tokens: int) -> dict:
        """One turn, decoded again from the turn's start when a write-back interrupts it."""
        chat = self.sessions.session(session_id)
        base = len(self.cache.tokens(chat.sid))
        while True:
            try:
                r = self.sessions.turn(session_id, text, max_new_tokens)
                break
            except ModelChanged:
                self.counters.rolled_back_turns += 1
                self._load()
                self.sessions.rollback(session_id, base)
        self.counters.turns += 1
        self.counters.tokens += len(r.reply)
        self.counters.recomputed_tokens += r.recomputed
        return {"reply": r.reply.decode("utf-8", "replace"), "reply_hex": r.reply.hex(),
                "version": self.version, "recomputed": r.recomputed}

    def stats(self) -> dict:
        s = self.cache.stats()
        return {"version": self.version, "pid": os.getpid(), "sessions": len(self.sessions),
                **vars(self.counters),
                "prefix_hit_rate": s["prefix_hit_rate"], "coherence": self.directory.stats()}

    def close(self) -> None:
        self.agent.leave()


class _Handler(BaseHTTPRequestHandler):
    agent: ServingAgent  # set on the server class

    def log_message(self, fmt: str, *args) -> None:  # requests go to the logger, not stderr
        _log.debug(fmt, *args)

    def _reply(self, status: HTTPStatus, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if not 0 <= n <= MAX_BODY:
            raise ValueError(f"body of {n} bytes (at most {MAX_BODY})")
        body = json.loads(self.rfile.read(n) or b"{}")
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        return body

    def _guarded(self, fn) -> None:
        try:
            self._reply(HTTPStatus.OK, fn())
        except UnknownSessionError as e:
            self._reply(HTTPStatus.NOT_FOUND, {"error": str(e)})
        except (ValueError, TypeError) as e:  # json errors are ValueErrors
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"{type(e).__name__}: {e}"})

    def do_GET(self) -> None:
        if self.path == "/v1/stats":
            self._guarded(self.server.agent.stats)
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

    def do_POST(self) -> None:
        a: ServingAgent = self.server.agent
        if self.path == "/v1/sessions":
            self._guarded(lambda: {"session": a.create(_text(self._body(), "system", ""))})
        elif self.path.startswith("/v1/sessions/"):
            sid = self.path.removeprefix("/v1/sessions/")

            def turn() -> dict:
                body = self._body()
                n = body.get("max_new_tokens", 16)
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_NEW_TOKENS:
                    raise ValueError(f"max_new_tokens must be an int in [0, {MAX_NEW_TOKENS}]")
                return a.send(sid, _text(body, "text"), n)
            self._guarded(turn)
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

    def do_DELETE(self) -> None:
        sid = self.path.removeprefix("/v1/sessions/")

        def close() -> dict:
            self.server.agent.sessions.close(sid)
            return {"closed": sid}
        self._guarded(close)


def _text(body: dict, name: str, default: str | None = None) -> bytes:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise TypeError(f"{name!r} must be a string")
    return value.encode("utf-8")


class ServeHTTPServer(HTTPServer):
    """One request at a time (the model and cache are single-threaded); between requests,
    ``timeout`` bounds how long an invalidation waits for its ACK."""

    timeout = 0.02

    def __init__(self, address: tuple[str, int], agent: ServingAgent):
        super().__init__(address, _Handler)
        self.agent = agent

    def handle_timeout(self) -> None:
        self.agent.idle()

    def service_actions(self) -> None:
        self.agent.idle()


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m node.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", required=True, type=Path, help="the node's cache directory")
    p.add_argument("--key-file", type=Path, default=None,
                   help="the node's sealed cache key (default: kv-cache.key beside --cache-dir; "
                        f"passphrase in ${PASSPHRASE_ENV})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8470, help="0 = any free port")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write {pid, port, version} here once serving")
    p.add_argument("--coherence", type=int, choices=[1, 2], default=2,
                   help="coherence_protocol: 2 strong (default), 1 relaxed")
    p.add_argument("--no-key", action="store_true", help="the cache is not encrypted (tests)")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="how long to wait for the node's key and first parameters")
    return p.parse_args(argv)


def _key(args: argparse.Namespace) -> bytes | None:
    """The node's cache key; waits for it (the node's first ClientApp message makes it)."""
    if args.no_key:
        return None
    path = args.key_file or args.cache_dir.parent / "kv-cache.key"
    deadline = time.monotonic() + args.wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"key file {path} did not appear within {args.wait_s} s "
                             "(is the node running? --no-key for an unencrypted cache)")
        time.sleep(0.2)
    return read_secret_file(path, passphrase_from_env())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(message)s")
    args = _args(argv)
    agent = ServingAgent(args.cache_dir, _key(args), mode=Mode(args.coherence), wait_s=args.wait_s)
    server = ServeHTTPServer((args.host, args.port), agent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    port = server.server_address[1]
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "port": port, "version": agent.version}))
        tmp.replace(args.ready_file)
    _log.info("pid %d serving %s on %s:%d", os.getpid(), args.cache_dir, args.host, port)
    try:
        server.serve_forever(poll_interval=0.02)
    finally:
        server.server_close()
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
