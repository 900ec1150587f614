"""One command line for the node's servers: ``python -m node.serving.openai_api`` (the OpenAI routes)
and ``python -m node.serving.serve`` (a node's session agent) are this module's two entry points, with
the same flags for what they share -- address, TLS, tokens, timeouts, model, KV pool, log
level -- and one way to run (``serve``: uvicorn via ``node.serving.server_http.LiveServer``).

The KV pool's default is sized from the model (``default_pool_mib``): room for one request of
``--max-context`` tokens (SmolLM2: 4,096 tokens, its per-token K/V of 46,080 B in fp32 -> 182
MiB), so the context a user can use is documented rather than a side effect of a pool size.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
from pathlib import Path
from typing import Any

from node.serving.serve_auth import check_bind

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SMOLLM2_CONTEXT = 4096
"""``--max-context``'s default for SmolLM2 (its own is 8,192): what the default pool holds."""


def common_arguments(p: argparse.ArgumentParser, port: int) -> None:
    """The flags every server of the node takes."""
    from node.serving.served_model import DTYPE_ARGUMENT, MODELS
    p.add_argument("--host", default="127.0.0.1",
                   help="loopback by default; another address only with --tls-cert and --tls-key")
    p.add_argument("--port", type=int, default=port, help="0 = any free port")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (chain): serve TLS")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--token-file", type=Path, default=None,
                   help="'tenant:token' lines (a bare token: tenant 'default'), mode 0600; "
                        "written with one fresh token when missing")
    p.add_argument("--socket-timeout", type=float, default=10.0,
                   help="seconds a client may take for its request head, then for its body "
                        "(and stay idle between requests)")
    p.add_argument("--model", choices=MODELS, default="byte",
                   help="byte: the node's byte-level model; smollm2: SmolLM2-135M-Instruct "
                        "from --model-dir with its chat template")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the converted SmolLM2 directory (default: node.models.smollm2.default_dir(); "
                        "python -m node.models.smollm2 fetch)")
    p.add_argument("--dtype", **DTYPE_ARGUMENT)
    p.add_argument("--pool-mib", type=float, default=None,
                   help="the KV pool (MiB; default: room for one request of --max-context "
                        "tokens)")
    p.add_argument("--max-context", type=int, default=None,
                   help=f"tokens one request may use, prompt and reply (default: "
                        f"{SMOLLM2_CONTEXT} for smollm2, the byte model's own 128)")
    p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                   help="the server's log level (INFO: one line per request)")


def check_common(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        check_bind(args.host, args.tls_cert, args.tls_key)
    except ValueError as e:
        p.error(str(e))
    if args.model_dir is not None and args.model != "smollm2":
        p.error("--model-dir is for --model smollm2")
    if (args.pool_mib is not None and args.pool_mib <= 0) or args.socket_timeout <= 0 or \
            (args.max_context is not None and args.max_context < 1):
        p.error("--pool-mib, --max-context and --socket-timeout must be positive")


def context_len(model: Any, max_context: int | None) -> int:
    """The context one request may use: ``--max-context`` (at most the model's own), else
    ``SMOLLM2_CONTEXT`` for a model that has more, else the model's."""
    own = model.context_len
    return min(own, max_context if max_context is not None else SMOLLM2_CONTEXT)


def default_pool_mib(model: Any, context: int) -> float:
    """MiB for one request of ``context`` tokens: the model's K/V bytes per token (fp32,
    ``cache.sizing.arena_bytes_per_token``) times the context, plus one block of slack."""
    from cache.sizing import arena_bytes_per_token
    cfg = model.cache_config()
    per_token = arena_bytes_per_token(cfg)
    return math.ceil(per_token * (context + cfg.block_size) / (1 << 20))


def load_served(args: argparse.Namespace, seed: int = 0) -> tuple[Any, Any]:
    """(model, codec) for ``--model`` (a ``SystemExit`` naming the fix when it is missing)."""
    from node.models.smollm2 import ModelError
    from node.serving.served_model import load_model
    import torch
    torch.manual_seed(seed)
    try:
        return load_model(args.model, args.model_dir, args.dtype)
    except ImportError as e:
        raise SystemExit(f"--model {args.model} needs the llm extra (pip install -e '.[llm]'): "
                         f"{e}") from None
    except ModelError as e:  # names the fix: python -m node.models.smollm2 fetch (--force)
        raise SystemExit(f"--model {args.model}: {e}") from None


def pool_bytes(args: argparse.Namespace, model: Any) -> int:
    from node.serving.served_model import POOL_MIB
    context = context_len(model, args.max_context)
    mib = args.pool_mib if args.pool_mib is not None else \
        max(POOL_MIB, default_pool_mib(model, context))
    return int(mib * (1 << 20))


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(message)s")


def serve(app: Any, args: argparse.Namespace, on_ready, closing) -> None:
    """Serve ``app`` on ``--host``/``--port`` (TLS with ``--tls-cert``) until SIGTERM or
    SIGINT; ``on_ready(port, tls)`` once bound, ``closing()`` however it ends."""
    import signal
    import sys
    from node.serving.server_http import LiveServer, ServerLimits
    # uvicorn stops cleanly on SIGTERM, then raises it again for the handler it found: this
    # one unwinds to the ``finally`` below and exits 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = None
    try:
        server = LiveServer(app, (args.host, args.port),
                            ServerLimits(socket_timeout_s=args.socket_timeout),
                            tls_cert=args.tls_cert, tls_key=args.tls_key)
        on_ready(server.server_address[1], server.tls)
        server.serve_forever()  # uvicorn handles SIGTERM/SIGINT: returns after a clean stop
    finally:
        if server is not None:
            server.server_close()
        closing()


announce = functools.partial(print, flush=True)


def write_ready(path: Path, port: int, version: int) -> None:
    """``--ready-file``: {pid, port, version}, atomically (a reader never sees half of it)."""
    import json
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "port": port, "version": version}))
    tmp.replace(path)
