"""An OpenAI-compatible HTTP server over any ``node.engine.generation.GenerationBackend``.

    python -m node.serving.openai_api [--model byte|smollm2] [--model-dir DIR] [--port 8471]
        [--backend scheduler|serial] [--max-running 16] [--token-budget 2048]
        [--preempt-mode swap|recompute] [--cache-dir DIR [--key-file F]] [--ready-file F]
        [--lora-seed N | --adapter PEFT_DIR]
        [--token-file ~/.cache/fedkv/openai-<port>/serve-token] [--pool-mib MiB] [--max-tokens N]
        [--max-concurrent 16] [--max-queue 64] [--request-timeout 60] [--request-deadline 300]
        [--max-context 4096] [--lora-modules NAME=PEFT_DIR ...]
        [--socket-timeout 10] [--metrics-auth] [--log-level INFO]
        [--host 127.0.0.1 [--tls-cert C --tls-key K]]

Endpoints: ``GET /v1/models`` (and ``/v1/models/<id>``), ``POST /v1/chat/completions``,
``POST /v1/completions`` -- streamed (``"stream": true``: server-sent events ``data: {chunk}``
ending ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the usage) or
not -- and ``GET /v1/stats``, fedkv's own: the caller's tenant's counters and nobody else's.
``GET /health``, ``GET /metrics`` (no token unless ``--metrics-auth``) and one INFO log line per
request: ``node.serving.serve_metrics``.
Parameters: ``temperature`` [0, 2] (0: greedy), ``top_p``, ``max_tokens``, ``stop`` (up to 4
strings, cut on the detokenized text; never leaked while streaming), ``n`` (forks sharing the
prompt's KV blocks copy-on-write), ``seed`` (choice ``i`` samples with ``seed + i``),
``node.serving.sampling_fields``' (logprobs, top_k, min_p, penalties, response_format). Checks and
shapes are ``node.serving.openai_protocol``'s; errors are ``{"error": {message, type, param, code}}``.

As ``node.serving.serve`` requires of a serving agent on a shared host (``node.serving.serve_auth``): every
other request needs ``Authorization: Bearer <token>`` (401 otherwise); the token's tenant is the
request's prefix-sharing namespace, so a tenant never hits (nor sees a counter of) another's
cached prompt; each tenant has at most ``max_concurrent`` requests in flight (429) and the
server at most ``max_queue`` (503 with ``Retry-After``), the backend's slots going to tenants
fairly (``node.serving.fair_gate``); a request that gets no token within
``request_timeout_s``, or still runs ``request_deadline_s`` after its admission (checked by the
backend between steps and here between tokens), is cancelled (503 ``timeout``); sockets time
out; it binds loopback unless TLS. ``--lora-modules name=PEFT_DIR`` serves adapters beside
the base, each picked by a request's ``model`` (``node.serving.served_models``).

Backends: ``node.engine.scheduler``'s continuous batching (default) or one request at a time
(``serial``, the baseline). With ``--cache-dir`` the server follows a node's trainer
(``node.serving.openai_follow``): each write-back is loaded between scheduler steps, running requests
restart under the new version, ``/v1/models`` and every chunk's ``system_fingerprint``
(``fedkv-v<version>``) say which version computed it.

One ASGI app (``node.serving.server_app``: FastAPI on uvicorn) serves the routes
(``node.serving.openai_routes``; a request's life: ``node.serving.openai_completion``); this module is the
command line (``node.serving.server_cli``) and ``OpenAIServer``, the app on a live socket.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from node.serving import openai_follow, server_cli, serving_cache
from node.engine.generation import GenerationBackend
from node.serving.openai_protocol import PromptCodec
from node.serving.openai_state import APIConfig, OpenAIState, TenantStats
from node.serving.serve_auth import Tenants
from node.serving.served_models import ServedModels, parse_lora_module
from node.serving.server_app import build_app
from node.serving.server_http import LiveServer, ServerLimits

__all__ = ["APIConfig", "OpenAIServer", "TenantStats", "main"]
_log = logging.getLogger("fedkv.openai_api")
MODEL_IDS = {"byte": "fedkv-byte", "smollm2": "smollm2-135m-instruct"}
LOG_LEVELS = server_cli.LOG_LEVELS
DEFAULT_PORT = 8471


class OpenAIServer(LiveServer):
    """The OpenAI routes on a live socket: ``backend`` (and ``models``' adapters) behind
    ``build_app``; ``serve_forever``/``shutdown``/``server_close`` as a ``socketserver``."""

    def __init__(self, address: tuple[str, int], backend: GenerationBackend, codec: PromptCodec,
                 tenants: Tenants, config: APIConfig = APIConfig(), *, context_len: int,
                 tls_cert: Path | None = None, tls_key: Path | None = None,
                 models: ServedModels | None = None):
        models = models or ServedModels(backend.model_id, backend)
        self.state = OpenAIState(models, codec, tenants, config, context_len)
        super().__init__(build_app(self.state), address,
                         ServerLimits(config.socket_timeout_s, config.max_body),
                         tls_cert=tls_cert, tls_key=tls_key)
        self.backend, self.codec, self.config = backend, codec, config

    @property
    def tenants(self) -> Tenants:
        return self.app.state.tenants

    @tenants.setter
    def tenants(self, tenants: Tenants) -> None:
        self.app.state.tenants = self.state.tenants = tenants

    @property
    def history(self):
        return self.state.history

    @history.setter
    def history(self, fn) -> None:
        self.state.history = fn

    @property
    def stats(self):
        return self.state.stats

    @property
    def _active(self):
        """Requests in flight per tenant (``node.serving.fair_gate``)."""
        return self.state.gate.active


# -- the command line -----------------------------------------------------------------------------
def _args(argv: list[str] | None) -> argparse.Namespace:
    d = APIConfig()
    p = argparse.ArgumentParser(prog="python -m node.serving.openai_api",
                                description=__doc__.split("\n\n")[0])
    server_cli.common_arguments(p, DEFAULT_PORT)
    p.add_argument("--seed", type=int, default=0, help="the byte model's initial weights")
    p.add_argument("--lora-seed", type=int, default=None,
                   help="smollm2: serve it with a chat task's FFA-LoRA adapters (node.models.lora), A "
                        "drawn from this public seed -- the federated run's seed (run-config "
                        "seed, 42 by default); B is zero until --cache-dir's node publishes its "
                        "fine-tuned adapters")
    p.add_argument("--adapter", type=Path, default=None,
                   help="smollm2: serve the LoRA adapters of this PEFT adapter directory "
                        "(node.serving.adapters export writes one) instead of a seed and a node's")
    p.add_argument("--lora-modules", action="append", default=[], metavar="NAME=PEFT_DIR",
                   help="smollm2: also serve this PEFT adapter as model NAME (repeatable, as "
                        "vLLM); it shares the base's weights, has its own KV pool")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the most tokens a reply may ask for (default: the context)")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent,
                   help="requests one tenant may have in flight (then 429)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests the server holds in flight in all (then 503)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds a request may wait for its next token")
    p.add_argument("--request-deadline", type=float, default=d.request_deadline_s,
                   help="seconds a request may take in all (then 503 timeout, its slot freed)")
    p.add_argument("--metrics-auth", action="store_true",
                   help="GET /metrics needs a tenant's token (default: none, as vLLM)")
    openai_follow.add_arguments(p)
    serving_cache.add_cli_args(p)  # --kv-*: warm, disk and Redis tiers of the serving cache
    args = p.parse_args(argv)
    openai_follow.check_arguments(p, args)
    server_cli.check_common(p, args)
    try:
        args.lora_modules = [parse_lora_module(m) for m in args.lora_modules]
    except ValueError as e:
        p.error(str(e))
    if args.lora_modules and args.model != "smollm2":
        p.error("--lora-modules adapts --model smollm2")
    if min(args.max_concurrent, args.max_queue, args.max_tokens or 1) < 1 or \
            min(args.request_timeout, args.request_deadline) <= 0:
        p.error("--max-tokens, --max-concurrent, --max-queue and the timeouts must be positive")
    return args


def _token_file(args: argparse.Namespace, port: int) -> Path:
    """``--token-file``, else ``serve-token`` beside ``--cache-dir`` (the node's), else the
    server's own on ``port`` (the bound one): never one file shared by every server."""
    from node.serving.serve_auth import default_token_file, server_token_file
    if args.token_file is not None:
        return args.token_file
    if args.cache_dir is not None:
        return default_token_file(args.cache_dir)
    return server_token_file(f"openai-{port}")


def _adapted(args: argparse.Namespace, model):
    """The model with ``--lora-seed``'s adapters (B from ``--cache-dir``'s node) or
    ``--adapter``'s (a PEFT directory, ``node.serving.adapters``), else as it is."""
    if args.lora_seed is not None:
        from node.models.lora import LoraConfig, adapt
        return adapt(model, LoraConfig(seed=args.lora_seed))
    if args.adapter is not None:
        return _load_adapter(model, args.adapter, "--adapter")
    return model


def _load_adapter(base, path: Path | str, flag: str):
    from node.serving.adapters import AdapterError, load_into, read_adapter
    try:
        return load_into(base, read_adapter(path, base.cfg))
    except AdapterError as e:
        raise SystemExit(f"{flag} {path}: {e}") from None


def build_cache(args: argparse.Namespace, model: Any, pool_bytes: int, model_id: str,
                adapter: bool = False):
    """The KV cache a served model decodes into, with the ``--kv-*`` tiers
    (``node.serving.serving_cache``); an adapter's has no disk tier of its own (one segment store
    belongs to one cache) but shares Redis, in its own namespace."""
    options = serving_cache.options_from_args(args, pool_bytes)
    if adapter:
        options = replace(options, cold_dir=None, namespace=f"{options.namespace}@{model_id}")
    return serving_cache.build_serving_cache(options, model, model_id)


def _backends(args: argparse.Namespace, base, pool_bytes: int):
    """(ServedModels, hook): the base (``--lora-seed``/``--adapter``/``--cache-dir``) and
    every ``--lora-modules`` adapter, each with its own cache and backend."""
    from node.engine.scheduler import SchedulerConfig
    from node.engine.scheduler_backend import ScheduledBackend
    model = _adapted(args, base)
    cache = build_cache(args, model, pool_bytes, MODEL_IDS[args.model])
    backend, hook = openai_follow.build_backend(args, model.eval(), cache,
                                                MODEL_IDS[args.model],
                                                own_weights=args.model != "byte")
    models = ServedModels(backend.model_id, backend)
    try:
        for name, path in args.lora_modules:
            adapted = _load_adapter(base, path, "--lora-modules").eval()
            models.adapters[name] = ScheduledBackend(
                adapted, build_cache(args, adapted, pool_bytes, name, adapter=True), SchedulerConfig(
                    args.max_running, args.token_budget, args.preempt_mode), model_id=name)
            models.sources[name] = str(path)
    except BaseException:
        models.close(lambda b: openai_follow.close(b, hook))
        raise
    return models, hook


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    server_cli.setup_logging(args.log_level, "openai_api")
    from node.serving.serve_auth import load_tenants
    announce = server_cli.announce
    base, codec = server_cli.load_served(args, args.seed)
    context = server_cli.context_len(base, args.max_context)
    models, hook = _backends(args, base, server_cli.pool_bytes(args, base))
    config = APIConfig(args.max_tokens, args.max_concurrent, args.max_queue,
                       args.request_timeout, args.request_deadline, args.socket_timeout,
                       metrics_auth=args.metrics_auth)
    state = OpenAIState(models, PromptCodec(codec), Tenants(()), config, context)
    state.history = hook.history if hook else None
    app = build_app(state)
    backend = models.backend

    def ready(port: int, tls: bool) -> None:
        token_file = _token_file(args, port)  # --port 0: named by the bound port
        app.state.tenants = state.tenants = load_tenants(token_file, announce)
        if args.ready_file:
            server_cli.write_ready(args.ready_file, port, backend.version)
        host = f"[{args.host}]" if ":" in args.host else args.host
        announce(f"serving {', '.join(models.names())} ({args.backend}, version "
                 f"{backend.version}, context {context}) at {'https' if tls else 'http'}://"
                 f"{host}:{port}/v1 (token file {token_file})")

    def closing() -> None:
        models.close(lambda b: openai_follow.close(b, hook))
        announce("stopped: server and backend closed")
    server_cli.serve(app, args, ready, closing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
