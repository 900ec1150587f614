"""Learning while serving: the OpenAI-compatible server (``node.serving.openai_api``) on a
``ScheduledBackend`` follows the node's trainer through a ``ParamFollower``.

Why the ACK comes only after the old weights are out of use (strong coherence,
``cache.coherence``): the trainer's write-back (``CacheNode._write_params`` under
``node.serving.param_channel.exclusive_params``) takes ``param`` in M and writes only after every reader
ACKed its invalidation. The follower's ``poll`` is that ACK, and ``WeightFollower`` calls it
only from the backend's ``between_steps`` hook, on the scheduler's loop thread: the one thread
that runs forwards, between two steps. The same call then blocks in ``ParamFollower.load``
(``acquire_read``) until the trainer released ``param`` -- its parameters are published -- and
loads them into the model; ``update_weights`` moves the cache to the published version at the
start of the very next step, before its forward. So no forward on the old weights follows the
ACK, and serving pauses while the trainer writes.

A running request restarts under the new version (``node.engine.scheduler``): its K/V are recomputed
from prompt + tokens already streamed (those stay as sent), and each later token is computed
wholly under the new weights. ``Sequence.token_versions`` lists every token's version; the
server's chunks carry theirs as ``system_fingerprint: fedkv-v<version>``.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from cache import KVCache
from cache.coherence import Mode
from node.models.interface import CachedLM
from node.serving.param_follower import ParamFollower
from node.engine.scheduler_backend import ScheduledBackend

_log = logging.getLogger("fedkv.openai_api")


def _loaded(_model: CachedLM) -> None:
    """The parameters are in the model already (``WeightFollower.__call__`` loaded them)."""


class WeightFollower:
    """``between_steps`` hook of a ``ScheduledBackend``: ACK a write-back, load what the
    trainer published, switch the backend to its version (see the module docstring)."""

    def __init__(self, follower: ParamFollower, backend: ScheduledBackend):
        self.follower, self.backend = follower, backend
        self._due = False
        """A write-back was ACKed and its parameters are not loaded yet (a ``load`` that
        failed -- the trainer held ``param`` past the directory's timeout -- is retried at the
        next boundary; the backend logs the error)."""

    def __call__(self) -> None:
        if self.follower.poll():  # ACKs: we are between steps, no forward is running
            self._due = True
        if not self._due:
            return
        version = self.follower.load(self.backend.version)  # waits for the trainer's release
        self._due = False
        if version is not None:
            self.backend.update_weights(_loaded, version)  # applied before the next forward

    def history(self) -> dict:
        """What every tenant may see of the model's history (``GET /v1/stats``)."""
        c = self.follower.counters
        return {"invalidations": c.invalidations, "reloads": c.reloads,
                "versions_seen": list(c.versions_seen)}

    def close(self) -> None:
        """Leave the coherence directory (after the backend stopped calling the hook)."""
        self.backend.between_steps = None
        self.follower.leave()


def join_node(cache_dir: str | os.PathLike, key: bytes | None, model: CachedLM, cache: KVCache,
              *, mode: Mode = Mode.STRONG, wait_s: float = 60.0,
              own_weights: bool = False) -> ParamFollower:
    """A follower holding ``param`` shared in ``cache_dir``'s coherence directory, the
    published parameters (if any fit) already loaded and ``cache`` at their version."""
    from cache.fsperm import private_dir
    from node.tasks.tasks import parameter_layout
    private_dir(cache_dir)  # 0700 when the server is first: the node refuses a reachable one
    follower = ParamFollower(Path(cache_dir), key, model, parameter_layout(model), mode=mode,
                             wait_s=wait_s, own_weights=own_weights)
    try:
        version = follower.load(cache.version)
    except BaseException:
        follower.leave()
        raise
    if version is not None:
        cache.set_version(version)
    return follower


def follow(backend: ScheduledBackend, follower: ParamFollower) -> WeightFollower:
    """Install the hook on ``backend``: from now on it ACKs and loads every write-back."""
    hook = WeightFollower(follower, backend)
    backend.between_steps = hook
    return hook


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``node.serving.openai_api``'s flags for the backend and for following a node (``node.serving.serve``'s)."""
    from node.engine.scheduler import PREEMPT_MODES, SchedulerConfig
    d = SchedulerConfig()
    p.add_argument("--backend", choices=("scheduler", "serial"), default="scheduler",
                   help="scheduler: continuous batching (node.engine.scheduler); serial: one request "
                        "at a time (the baseline; cannot follow a node)")
    p.add_argument("--max-running", type=int, default=d.max_running,
                   help="sequences decoding at once (scheduler)")
    p.add_argument("--token-budget", type=int, default=d.token_budget,
                   help="tokens one step computes: decode rows + prefill chunks (scheduler)")
    p.add_argument("--preempt-mode", choices=PREEMPT_MODES, default=d.preempt_mode,
                   help="what a preempted sequence keeps (scheduler)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="the node's cache directory: serve the parameters its trainer "
                        "publishes, reloading at every write-back (needs --backend scheduler)")
    p.add_argument("--key-file", type=Path, default=None,
                   help="the node's sealed cache key (default: kv-cache.key beside --cache-dir)")
    p.add_argument("--no-key", action="store_true", help="the node's cache is not encrypted (tests)")
    p.add_argument("--coherence", type=int, choices=[1, 2], default=2,
                   help="coherence_protocol: 2 strong (default), 1 relaxed")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="how long to wait for the node's key and first parameters")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write {pid, port, version} here once serving")


def build_backend(args: argparse.Namespace, model: CachedLM, cache: KVCache, model_id: str,
                  own_weights: bool):
    """(backend, hook or None) for ``add_arguments``' flags; with ``--cache-dir`` the model
    first takes the node's published parameters (``join_node``)."""
    from node.engine.scheduler import SchedulerConfig
    from node.engine.serial_backend import SerialBackend
    follower = None
    if args.cache_dir is not None:
        from node.serving.served_model import node_key
        key = None if args.no_key else node_key(args.cache_dir, args.key_file, args.wait_s)
        follower = join_node(args.cache_dir, key, model, cache, mode=Mode(args.coherence),
                             wait_s=args.wait_s, own_weights=own_weights)
    if args.backend == "serial":
        return SerialBackend(model, cache, model_id=model_id), None
    backend = ScheduledBackend(model, cache, SchedulerConfig(
        args.max_running, args.token_budget, args.preempt_mode), model_id=model_id)
    return backend, (follow(backend, follower) if follower is not None else None)


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.cache_dir is not None and args.backend != "scheduler":
        p.error("--cache-dir needs --backend scheduler (it swaps weights between steps)")
    if args.lora_seed is not None and args.model != "smollm2":
        p.error("--lora-seed adapts --model smollm2 (the chat task's base)")
    if args.adapter is not None and args.model != "smollm2":
        p.error("--adapter adapts --model smollm2 (a LoRA adapter of the chat task's base)")
    if args.adapter is not None and (args.lora_seed is not None or args.cache_dir is not None):
        p.error("--adapter serves that file's adapters alone: not with --lora-seed or --cache-dir")
    if min(args.max_running, args.token_budget) < 1 or args.wait_s <= 0:
        p.error("--max-running, --token-budget and --wait-s must be positive")


def close(backend, hook: WeightFollower | None) -> None:
    """The backend first (its loop calls the hook), then leave the node's directory."""
    backend.close()
    if hook is not None:
        hook.close()
