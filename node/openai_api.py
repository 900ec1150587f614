"""An OpenAI-compatible HTTP server over any ``node.generation.GenerationBackend``.

    python -m node.openai_api [--model byte|smollm2] [--model-dir DIR] [--port 8471]
        [--backend scheduler|serial] [--max-running 16] [--token-budget 256]
        [--preempt-mode swap|recompute] [--cache-dir DIR [--key-file F]] [--ready-file F]
        [--lora-seed N | --adapter PEFT_DIR]
        [--token-file ~/.cache/fedkv/openai-<port>/serve-token] [--pool-mib MiB] [--max-tokens 256]
        [--max-concurrent 4] [--max-queue 16] [--request-timeout 60] [--request-deadline 300]
        [--socket-timeout 10] [--metrics-auth] [--log-level INFO]
        [--host 127.0.0.1 [--tls-cert C --tls-key K]]

Endpoints: ``GET /v1/models`` (and ``/v1/models/<id>``), ``POST /v1/chat/completions``,
``POST /v1/completions`` -- streamed (``"stream": true``: server-sent events ``data: {chunk}``
ending ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the usage) or
not -- and ``GET /v1/stats``, fedkv's own: the caller's tenant's counters and nobody else's.
``GET /health``, ``GET /metrics`` (no token unless ``--metrics-auth``) and one INFO log line per
request: ``node.serve_metrics``.
Parameters: ``temperature`` [0, 2] (0: greedy), ``top_p``, ``max_tokens``, ``stop`` (up to 4
strings, cut on the detokenized text; never leaked while streaming), ``n`` (forks sharing the
prompt's KV blocks copy-on-write), ``seed`` (choice ``i`` samples with ``seed + i``). Checks
and shapes are ``node.openai_protocol``'s; errors are ``{"error": {message, type, param, code}}``.

As ``node.serve`` requires of a serving agent on a shared host (``node.serve_auth``): every
other request needs ``Authorization: Bearer <token>`` (401 otherwise); the token's tenant is the
request's prefix-sharing namespace, so a tenant never hits (nor sees a counter of) another's
cached prompt; each tenant has at most ``max_concurrent`` requests in flight (429) and the
server at most ``max_queue`` (503 with ``Retry-After``); a request that gets no token within
``request_timeout_s``, or still runs ``request_deadline_s`` after its admission (checked by the
backend between steps and here between tokens), is cancelled (503 ``timeout``); sockets time
out; it binds loopback unless TLS.

Backends: ``node.scheduler``'s continuous batching (default) or one request at a time
(``serial``, the baseline). With ``--cache-dir`` the server follows a node's trainer
(``node.openai_follow``): each write-back is loaded between scheduler steps, running requests
restart under the new version, ``/v1/models`` and every chunk's ``system_fingerprint``
(``fedkv-v<version>``) say which version computed it.

The standard library's ``http.server`` (threads, like ``node.serve``), not FastAPI/uvicorn.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import secrets
import signal
import socket
import ssl
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from node import openai_follow
from node.sessions import Sampling
from node.generation import GenerationBackend, GenerationHandle, GenerationRequest
from node.openai_protocol import (MAX_SEED, APIError, Params, PromptCodec, TextStream, bad,
                                  parse_chat, parse_completion)
from node.request_json import BadJSON, decode_object
from node.serve_auth import Tenants
from node.serve_metrics import CONTENT_TYPE, RequestRecord, ServeMetrics, health

_log = logging.getLogger("fedkv.openai_api")


@dataclass(frozen=True)
class APIConfig:
    """The server's limits."""

    max_tokens: int = 256
    """The most tokens one choice may generate (a larger ``max_tokens`` is a 400)."""
    max_concurrent: int = 4
    """Requests one tenant may have in flight; more get 429."""
    max_queue: int = 16
    """Requests the server takes in flight in all; more get 503 with ``Retry-After``."""
    request_timeout_s: float = 60.0
    """Seconds a request may wait for its next token before it is cancelled (503)."""
    request_deadline_s: float = 300.0
    """Seconds a request may take in all, from its admission to its last token: past it the
    backend stops decoding it between steps, the server between tokens, and the reply ends
    with a 503 ``timeout`` (a stream: its last event); its slot and KV blocks are freed."""
    socket_timeout_s: float = 10.0
    """Seconds a connection may stall a read or a write."""
    max_body: int = 1 << 20
    metrics_auth: bool = False
    """``GET /metrics`` needs a tenant's token too (off: as vLLM; it shows no tenant or token)."""


@dataclass
class TenantStats:
    """One tenant's own counters (``GET /v1/stats`` shows the caller's only)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens taken from the tenant's own prefix cache."""
    completion_tokens: int = 0
    rate_limited: int = 0
    refused_busy: int = 0


def _unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key (Authorization: Bearer <token>)", None,
                    "invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="fedkv"'})


class OpenAIServer(ThreadingHTTPServer):
    """A thread per connection; the backend decodes, this server checks, admits and shapes."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], backend: GenerationBackend, codec: PromptCodec,
                 tenants: Tenants, config: APIConfig = APIConfig(), *,
                 context_len: int, tls: ssl.SSLContext | None = None):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.backend, self.codec, self.tenants, self.config = backend, codec, tenants, config
        self.context_len, self.created = context_len, int(time.time())
        self.stats: defaultdict[str, TenantStats] = defaultdict(TenantStats)
        self.history: Callable[[], dict] | None = None
        """The followed node's model history (``WeightFollower.history``), shown to all."""
        self.metrics = ServeMetrics(backend)  # this server's own registry; the request log
        self._active: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        if tls is not None:  # the handshake happens on the connection's thread
            self.socket = tls.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)

    @contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        """Hold one of ``tenant``'s in-flight slots, or refuse: 429 over its quota, 503 when
        the server holds ``max_queue`` requests."""
        with self._lock:
            if self._active[tenant] >= self.config.max_concurrent:
                self.stats[tenant].rate_limited += 1
                raise APIError(429, f"too many requests in flight for this API key (at most "
                                    f"{self.config.max_concurrent})", None, "rate_limit_exceeded",
                               "rate_limit_error", {"Retry-After": "1"})
            if sum(self._active.values()) >= self.config.max_queue:
                self.stats[tenant].refused_busy += 1
                raise APIError(503, "the server is at capacity; retry later", None, "overloaded",
                               "server_error", {"Retry-After": "1"})
            self._active[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._active[tenant] -= 1

    def models(self) -> list[dict[str, Any]]:
        return [{"id": self.backend.model_id, "object": "model", "created": self.created,
                 "owned_by": "fedkv", "version": self.backend.version}]

    def handle_error(self, request, client_address) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, (OSError, ssl.SSLError)):  # a client that hung up or timed out
            _log.debug("connection from %s: %s: %s", client_address, type(e).__name__, e)
        else:
            _log.exception("error serving %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    server: OpenAIServer
    server_version, sys_version = "fedkv-openai", ""

    record: RequestRecord | None = None  # None: http.server answers (501, a bad request line)

    def log_message(self, fmt: str, *args) -> None:
        _log.debug(fmt, *args)

    def send_response(self, code: int, message: str | None = None) -> None:
        if self.record is not None:
            self.record.status = code
        super().send_response(code, message)

    def setup(self) -> None:
        self.timeout = self.server.config.socket_timeout_s
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    # -- replies ---------------------------------------------------------------------------
    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers)

    def _send(self, status: int, data: bytes, kind: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _event(self, data: dict | str) -> None:
        payload = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(f"data: {payload}\n\n".encode())

    def _guarded(self, fn) -> None:
        """``fn(tenant)`` after authentication; an ``APIError`` becomes its JSON reply."""
        try:
            tenant = self.server.tenants.authenticate(self.headers.get("Authorization"))
            if tenant is None:
                self.close_connection = True  # the body is not read
                raise _unauthorized()
            self.record.tenant = tenant
            fn(tenant)
        except APIError as e:
            self.record.error = e.code
            self._json(e.status, e.body(), e.headers)
        except OSError:
            raise  # the connection itself: nothing to answer on
        except Exception:
            _log.exception("%s %s failed", self.command, self.path)
            self._json(500, APIError(500, "internal error", type="server_error").body())

    def _body(self) -> dict:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise bad(None, "Content-Length must be an integer") from None
        if not 0 < n <= self.server.config.max_body:
            raise bad(None, "the body must be a JSON object of 1 to "
                            f"{self.server.config.max_body} bytes")
        try:
            return decode_object(self.rfile.read(n))
        except BadJSON as e:
            raise bad(None, str(e)) from None

    # -- routes ------------------------------------------------------------------------------
    def do_GET(self) -> None:
        with self.server.metrics.request(RequestRecord(self.command, self.path)) as self.record:
            if self.path == "/health":  # a probe: no token, nothing secret
                self._json(*health(self.server.backend))
            elif self.path == "/metrics" and not self.server.config.metrics_auth:
                self._send(200, self.server.metrics.render(), CONTENT_TYPE)
            else:
                self._guarded(self._get)

    def _get(self, tenant: str) -> None:
        models = self.server.models()
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": models})
        elif self.path.startswith("/v1/models/"):
            found = [m for m in models if m["id"] == self.path.removeprefix("/v1/models/")]
            if not found:
                raise APIError(404, "no such model", "model", "model_not_found")
            self._json(200, found[0])
        elif self.path == "/v1/stats":
            with self.server._lock:
                own = asdict(self.server.stats[tenant])
            history = self.server.history() if self.server.history else {}
            self._json(200, {"tenant": tenant, "model": self.server.backend.model_id,
                             "version": self.server.backend.version, **history, **own})
        elif self.path == "/metrics":  # --metrics-auth: any tenant's token
            self._send(200, self.server.metrics.render(), CONTENT_TYPE)
        else:
            raise APIError(404, f"no such path {self.path}", None, "not_found")

    def do_POST(self) -> None:
        def post(tenant: str) -> None:
            s = self.server
            if self.path == "/v1/chat/completions":
                p = parse_chat(self._body(), s.backend.model_id, s.config.max_tokens)
                _Completion(self, tenant, p, chat=True).run(s.codec.messages(p.prompt))
            elif self.path == "/v1/completions":
                p = parse_completion(self._body(), s.backend.model_id, s.config.max_tokens)
                _Completion(self, tenant, p, chat=False).run(s.codec.text(p.prompt))
            else:
                raise APIError(404, f"no such path {self.path}", None, "not_found")
        with self.server.metrics.request(RequestRecord(self.command, self.path)) as self.record:
            self._guarded(post)


class _Completion:
    """One request from its prompt ids to its reply (streamed or whole)."""

    def __init__(self, handler: _Handler, tenant: str, params: Params, chat: bool):
        self.h, self.tenant, self.p, self.chat = handler, tenant, params, chat
        self.server = handler.server
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._used: list[int] = []
        """Tokens each choice consumed (the usage's completion tokens)."""
        self.deadline = time.monotonic() + self.server.config.request_deadline_s

    def _request(self, prompt: list[int]) -> GenerationRequest:
        """The backend's request; 400 when the prompt and ``max_tokens`` overflow the context."""
        room, asked = self.server.context_len - len(prompt), self.p.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise APIError(400, f"this model's maximum context length is {self.server.context_len} "
                                f"tokens; the prompt has {len(prompt)} and max_tokens asks for "
                                f"{asked or 1}", "messages" if self.chat else "prompt",
                           "context_length_exceeded")
        n, seed = self.p.n, self.p.seed
        seeds = None if seed is None else tuple((seed + i) & MAX_SEED for i in range(n))
        return GenerationRequest(
            tuple(prompt), min(room, self.server.config.max_tokens) if asked is None else asked,
            Sampling(self.p.temperature, self.p.top_p), stop_token_ids=self.server.codec.eos_ids,
            tenant=self.tenant, n=n, seeds=seeds, deadline=self.deadline)

    def run(self, prompt: list[int]) -> None:
        request = self._request(prompt)
        with self.server.admit(self.tenant):
            try:
                handles = self.server.backend.submit(request)
            except ValueError as e:
                raise bad("messages" if self.chat else "prompt", str(e)) from None
            except RuntimeError as e:  # closing
                raise APIError(503, str(e), None, "unavailable", "server_error") from None
            try:
                (self._stream if self.p.stream else self._whole)(handles)
            finally:
                for h in handles:
                    h.cancel()  # a no-op once finished; frees a client's abandoned forks
                self._account(handles, self._used)

    def _choice(self, h: GenerationHandle, ts: TextStream) -> Iterator[str]:
        """The choice's text deltas; afterwards ``_reason`` says why it ended."""
        try:
            for token in h.tokens(timeout=self.server.config.request_timeout_s):
                self.h.record.token()
                if time.monotonic() >= self.deadline:  # tokens keep coming, but time is up
                    raise self._past_deadline()
                if delta := ts.push(token):
                    yield delta
                if ts.stopped:
                    h.cancel()  # the text ended at a stop string: its fork need not go on
                    return
        except TimeoutError:
            raise APIError(503, "generation timed out", None, "timeout", "server_error") from None
        if h.finish_reason == "timeout":
            raise self._past_deadline()
        if h.finish_reason not in ("stop", "length"):
            raise APIError(503, f"generation failed: {h.error or h.finish_reason}", None,
                           "generation_failed", "server_error", {"Retry-After": "1"})
        if tail := ts.finish():
            yield tail

    def _past_deadline(self) -> APIError:
        return APIError(503, f"the request ran past its deadline "
                             f"({self.server.config.request_deadline_s:g} s)", None, "timeout",
                        "server_error")

    @staticmethod
    def _reason(h: GenerationHandle, ts: TextStream) -> str:
        return "stop" if ts.stopped or h.finish_reason == "stop" else "length"

    def _streams(self, handles: list[GenerationHandle]) -> list[TextStream]:
        streams = [TextStream(self.server.codec.decode, self.p.stop) for _ in handles]
        self._used = [0] * len(handles)
        return streams

    def _whole(self, handles: list[GenerationHandle]) -> None:
        streams, choices = self._streams(handles), []
        for i, (h, ts) in enumerate(zip(handles, streams)):
            text = "".join(self._choice(h, ts))
            self._used[i] = len(ts.ids)
            body = {"message": {"role": "assistant", "content": text}} if self.chat else \
                {"text": text, "logprobs": None}
            choices.append({"index": i, **body, "finish_reason": self._reason(h, ts)})
            if self.chat:
                choices[-1]["logprobs"] = None
        self.h._json(200, {**self._head(self._newest(handles), chunk=False), "choices": choices,
                           "usage": self._usage(handles)})

    def _stream(self, handles: list[GenerationHandle]) -> None:
        streams = self._streams(handles)
        self.h.send_response(200)
        self.h.send_header("Content-Type", "text/event-stream")
        self.h.send_header("Cache-Control", "no-cache")
        self.h.end_headers()
        self.h.close_connection = True  # the stream ends when the connection does
        usage = {"usage": None} if self.p.include_usage else {}
        try:
            for i, (h, ts) in enumerate(zip(handles, streams)):
                if self.chat:
                    self._chunk(handles, i, {"role": "assistant", "content": ""}, None, usage)
                for delta in self._choice(h, ts):
                    self._used[i] = len(ts.ids)
                    self._chunk(handles, i, {"content": delta} if self.chat else delta, None, usage)
                self._used[i] = len(ts.ids)
                self._chunk(handles, i, {} if self.chat else "", self._reason(h, ts), usage)
        except APIError as e:  # headers are sent: the error is the stream's last event
            self.h.record.error = e.code
            for h in handles:  # freed before the client learns: its slots are free when it retries
                h.cancel()
            self.h._event(e.body())
            return
        if self.p.include_usage:
            self.h._event({**self._head(self._newest(handles), chunk=True), "choices": [],
                           "usage": self._usage(handles)})
        self.h._event("[DONE]")

    def _chunk(self, handles, i: int, delta: dict | str, reason: str | None, usage: dict) -> None:
        body = {"delta" if self.chat else "text": delta, "logprobs": None}
        self.h._event({**self._head(_version_at(handles[i], self._used[i]), chunk=True), **usage,
                       "choices": [{"index": i, **body, "finish_reason": reason}]})

    def _newest(self, handles: list[GenerationHandle]) -> int | None:
        """The newest version among the tokens sent (the whole reply's fingerprint)."""
        return max((v for h, n in zip(handles, self._used) if (v := _version_at(h, n)) is not None),
                   default=None)

    def _head(self, version: int | None, chunk: bool) -> dict[str, Any]:
        """``version``: the model version of the tokens in the object (None: none yet)."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        if version is None:
            version = self.server.backend.version
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.server.backend.model_id,
                "system_fingerprint": f"fedkv-v{version}"}

    def _usage(self, handles: list[GenerationHandle]) -> dict[str, Any]:
        prompt, done = handles[0].prompt_tokens, sum(self._used)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": handles[0].cached_prompt_tokens}}

    def _account(self, handles: list[GenerationHandle], used: list[int]) -> None:
        with self.server._lock:
            st = self.server.stats[self.tenant]
            st.requests += 1
            st.prompt_tokens += handles[0].prompt_tokens
            st.cached_prompt_tokens += handles[0].cached_prompt_tokens
            st.completion_tokens += sum(used)
        self.h.record.prompt_tokens = handles[0].prompt_tokens
        self.h.record.generated_tokens = sum(used)


def _version_at(h: GenerationHandle, n: int) -> int | None:
    """The version of ``h``'s ``n``-th token (the last one a chunk holds): a backend that
    restarts running requests under new weights lists each token's (``token_versions``,
    appended before the token is queued); the serial one has one per request."""
    versions = getattr(h, "token_versions", None)
    return versions[n - 1] if versions and 0 < n <= len(versions) else h.model_version


# -- the command line -----------------------------------------------------------------------------
MODEL_IDS = {"byte": "fedkv-byte", "smollm2": "smollm2-135m-instruct"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_PORT = 8471


def _args(argv: list[str] | None) -> argparse.Namespace:
    from node.served_model import DTYPE_ARGUMENT, MODELS, POOL_MIB, SMOLLM2_POOL_MIB
    d = APIConfig()
    p = argparse.ArgumentParser(prog="python -m node.openai_api",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="byte",
                   help="byte: the node's byte-level model (random weights, seed --seed: for "
                        "plumbing); smollm2: SmolLM2-135M-Instruct from --model-dir")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the converted SmolLM2 directory (default: node.models.default_dir())")
    p.add_argument("--dtype", **DTYPE_ARGUMENT)
    p.add_argument("--seed", type=int, default=0, help="the byte model's initial weights")
    p.add_argument("--lora-seed", type=int, default=None,
                   help="smollm2: serve it with a chat task's FFA-LoRA adapters (node.lora), A "
                        "drawn from this public seed -- the federated run's seed (run-config "
                        "seed, 42 by default); B is zero until --cache-dir's node publishes its "
                        "fine-tuned adapters")
    p.add_argument("--adapter", type=Path, default=None,
                   help="smollm2: serve the LoRA adapters of this PEFT adapter directory "
                        "(node.adapters export writes one) instead of a seed and a node's")
    p.add_argument("--host", default="127.0.0.1",
                   help="loopback by default; another address only with --tls-cert and --tls-key")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = any free port")
    p.add_argument("--tls-cert", type=Path, default=None)
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--token-file", type=Path, default=None,
                   help="'tenant:token' lines (a bare token: tenant 'default'), mode 0600; "
                        "written with one fresh token when missing (default: serve-token beside "
                        "--cache-dir, else this server's own ~/.cache/fedkv/openai-<port>/"
                        "serve-token, <port> the bound one)")
    p.add_argument("--pool-mib", type=float, default=None,
                   help=f"KV pool (default {POOL_MIB:g}; {SMOLLM2_POOL_MIB:g} for smollm2)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent)
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds a request may wait for its next token")
    p.add_argument("--request-deadline", type=float, default=d.request_deadline_s,
                   help="seconds a request may take in all (then 503 timeout, its slot freed)")
    p.add_argument("--socket-timeout", type=float, default=d.socket_timeout_s)
    p.add_argument("--metrics-auth", action="store_true",
                   help="GET /metrics needs a tenant's token (default: none, as vLLM)")
    p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                   help="the server's log level (INFO: one line per request)")
    openai_follow.add_arguments(p)
    args = p.parse_args(argv)
    openai_follow.check_arguments(p, args)
    from node.serve_auth import check_bind
    try:
        check_bind(args.host, args.tls_cert, args.tls_key)
    except ValueError as e:
        p.error(str(e))
    if args.pool_mib is None:
        args.pool_mib = SMOLLM2_POOL_MIB if args.model == "smollm2" else POOL_MIB
    if min(args.max_tokens, args.max_concurrent, args.max_queue) < 1 or \
            min(args.pool_mib, args.request_timeout, args.request_deadline,
                args.socket_timeout) <= 0:
        p.error("--max-tokens, --max-concurrent, --max-queue, --pool-mib and the timeouts must "
                "be positive")
    return args


def _token_file(args: argparse.Namespace, port: int) -> Path:
    """``--token-file``, else ``serve-token`` beside ``--cache-dir`` (the node's), else the
    server's own on ``port`` (the bound one): never one file shared by every server."""
    from node.serve_auth import default_token_file, server_token_file
    if args.token_file is not None:
        return args.token_file
    if args.cache_dir is not None:
        return default_token_file(args.cache_dir)
    return server_token_file(f"openai-{port}")


def _adapted(args: argparse.Namespace, model):
    """The model with ``--lora-seed``'s adapters (B from ``--cache-dir``'s node) or
    ``--adapter``'s (a PEFT directory, ``node.adapters``), else as it is."""
    if args.lora_seed is not None:
        from node.lora import LoraConfig, adapt
        return adapt(model, LoraConfig(seed=args.lora_seed))
    if args.adapter is not None:
        from node.adapters import AdapterError, load_into, read_adapter
        try:
            return load_into(model, read_adapter(args.adapter, model.cfg))
        except AdapterError as e:
            raise SystemExit(f"--adapter {args.adapter}: {e}") from None
    return model


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s openai_api %(message)s")
    import torch

    from cache import KVCache
    from node.models import ModelError
    from node.served_model import load_model
    from node.serve_auth import Tenants, load_tenants, tls_context
    tls = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    announce = functools.partial(print, flush=True)
    known = args.port or args.token_file or args.cache_dir  # else: the port bound below
    token_file = _token_file(args, args.port) if known else None
    tenants = load_tenants(token_file, announce) if token_file else Tenants(())
    torch.manual_seed(args.seed)
    try:
        model, codec = load_model(args.model, args.model_dir, args.dtype)
    except ModelError as e:
        raise SystemExit(f"--model {args.model}: {e}") from None
    model = _adapted(args, model)
    cache = KVCache(model.cache_config(pool_bytes=int(args.pool_mib * (1 << 20))))
    backend, hook = openai_follow.build_backend(args, model.eval(), cache, MODEL_IDS[args.model],
                                                own_weights=args.model != "byte")
    config = APIConfig(args.max_tokens, args.max_concurrent, args.max_queue,
                       args.request_timeout, args.request_deadline, args.socket_timeout,
                       metrics_auth=args.metrics_auth)
    server: OpenAIServer | None = None
    try:
        server = OpenAIServer((args.host, args.port), backend, PromptCodec(codec), tenants,
                              config, context_len=model.context_len, tls=tls)
        if token_file is None:  # --port 0: this server's own file, named by the bound port
            token_file = _token_file(args, server.server_address[1])
            server.tenants = load_tenants(token_file, announce)
    except BaseException:
        if server is not None:
            server.server_close()
        openai_follow.close(backend, hook)
        raise
    server.history = hook.history if hook else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds serve_forever: finally below
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = server.server_address[1]
    if args.ready_file:
        openai_follow.write_ready(args.ready_file, port, backend.version)
    print(f"serving {backend.model_id} ({args.backend}, version {backend.version}) at "
          f"{'https' if tls else 'http'}://{host}:{port}/v1 (token file {token_file})", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        openai_follow.close(backend, hook)
        print("stopped: server and backend closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
