"""One ``CacheNode`` per Flower node, reused across messages: ``NodeRuntime`` owns its state.

What persists where (``NodeRuntime``; docs/deployment.md, "What a node keeps, and where"):

* **The cache directory** (``KVCache.open``; AES-256-GCM with the node's own key, one atomic
  commit per message): the node's parameters (``param/``), its last update (``grad/``), the
  model version and its K/V blocks. The committed ``param/`` tensors are the one source of
  truth for the node's parameters; the model's weights are loaded from them.
* **context.state** (``fedkv.meta``): public scalars only -- the version, DP-SGD accounting and a
  generation counter. In simulation it lives in the ServerApp's process, so nothing secret.
* **The node directory** (``federation.node_store``): keys, CKKS contexts, the error-feedback
  residual, the adaptive clip-norm history, the kept replies and the record of the aggregates
  applied (``federation.applied_log``) -- no parameters.
* **published-params.bin** beside the cache (``node.serving.param_channel``): a sealed copy for the
  node's serving agent, which cannot open the store while a ClientApp holds it; never read back.
* **Process memory**: a reuse cache of built nodes (a Ray actor in simulation, shared by all
  nodes; a fresh process per message in deployment), used only when its generation equals
  ``context.state``'s; otherwise the node is rebuilt on its cache directory.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import torch
from flwr.app import ConfigRecord, Context

from federation.config import stale_versions, task_id
from federation.messages import NodeSource
from federation.node_store import NodeStore, ProvisioningError
from node.cache_node import CacheNode, NodeSpec, model_layout

T = TypeVar("T")
META_KEY = "fedkv.meta"
MIN_CACHED_NODES = 64
MAX_CACHED_NODES = 512
"""An actor keeps every node of the population (``num-partitions``) within these bounds: in
simulation any node may land on any actor, and one it no longer holds is rebuilt and restored
from disk for every message."""



@dataclass
class _Entry:
    node: CacheNode
    generation: int


class NodeStateLost(ProvisioningError):
    """The node's cache directory is behind its committed ``context.state``: the parameters
    the node committed are gone (the directory was removed or replaced)."""


class NodeRuntime:
    """The node state one process holds across messages (the module docstring lists what
    persists where): the reuse cache of built nodes, ``restore`` at the start of a message,
    ``save`` (commit) at its end and ``release`` of every cache directory it opened.

    A handler that fails before ``save`` commits nothing: its directories are released without
    a flush and its node is ``discard``ed, so the next message restores the previous commit. A
    process that dies after the commit but before Flower keeps ``context.state`` leaves the
    cache one commit ahead; the cache wins (its parameters are a global model the node
    applied; ``catch_up`` skips what it holds) and the scalars come from ``context.state``.
    """

    def __init__(self) -> None:
        self.nodes: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._open: list[CacheNode] = []
        """Nodes whose cache directory this message opened; ``release`` closes them."""

    def restore(self, context: Context) -> tuple[CacheNode, NodeSource]:
        """The node for this context and how it was obtained (built, restored, reused)."""
        _limit_threads()
        key = (context.run_id, context.node_id)
        meta = context.state.config_records.get(META_KEY)
        generation = int(meta["generation"]) if meta is not None else 0
        entry = self.nodes.get(key)
        if entry is not None and entry.generation == generation:
            self.nodes.move_to_end(key)
            entry.node.reattach()
            self._open.append(entry.node)
            return entry.node, NodeSource.REUSED
        node = build_node(context)  # its parameters: the cache directory's committed param/
        self._open.append(node)
        source = NodeSource.BUILT
        if meta is not None:
            scalars = {k: v for k, v in meta.items() if k != "generation"}
            if node.version < int(scalars["version"]):
                raise NodeStateLost(f"the node's cache directory {node.cache_dir} holds model version "
                                    f"{node.version}, but the node committed version {scalars['version']}; "
                                    "its parameters are gone (rejoin the run from a fresh node directory)")
            node.load_scalars(scalars)
            source = NodeSource.RESTORED
        self._remember(key, node, generation, cache_capacity(context))
        return node, source

    def save(self, context: Context, node: CacheNode) -> None:
        """Commit the node's cache (parameters and version, atomically), then its public
        scalars into ``context.state`` with the next generation."""
        meta = context.state.config_records.get(META_KEY)
        generation = (int(meta["generation"]) if meta is not None else 0) + 1
        node.persist()
        context.state[META_KEY] = ConfigRecord({**node.scalars(), "generation": generation})
        self._remember((context.run_id, context.node_id), node, generation, cache_capacity(context))

    def release(self) -> None:
        """Release every cache directory this message opened (without flushing)."""
        while self._open:
            self._open.pop().release()

    def discard(self, context: Context) -> None:
        """Drop this node's object (a failed handler may have left it half-updated)."""
        entry = self.nodes.pop((context.run_id, context.node_id), None)
        if entry is not None:
            entry.node.release()

    def forget_all(self) -> None:
        """Drop the reuse cache (tests; simulates a fresh ClientApp process)."""
        self.nodes.clear()

    def _remember(self, key: tuple[int, int], node: CacheNode, generation: int, capacity: int) -> None:
        self.nodes[key] = _Entry(node, generation)
        self.nodes.move_to_end(key)
        while len(self.nodes) > capacity:
            self.nodes.popitem(last=False)


RUNTIME = NodeRuntime()
"""This process's runtime (one per ClientApp process)."""


def releasing(handler: Callable[..., T]) -> Callable[..., T]:
    """Wrap a ClientApp handler: every cache directory it opened is released when it ends,
    also when it raises (what a message persists is what ``save_node`` committed)."""
    @functools.wraps(handler)
    def wrapped(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        finally:
            RUNTIME.release()
    return wrapped


def peek_node(context: Context) -> CacheNode:
    """The node for inspection outside a handler (its directory released again)."""
    try:
        return get_node(context)[0]
    finally:
        RUNTIME.release()


def spec_from_context(context: Context) -> NodeSpec:
    """Node identity from node_config (partition) and run_config (task, seed, split).

    Raises ``NodeConfigError`` (a ``ConfigError``, so a ``ValueError``) when partition-id or
    num-partitions is missing or not an integer with 0 <= partition-id < num-partitions;
    a SuperNode gets them from ``--node-config "partition-id=0 num-partitions=N"``.
    """
    from federation.config import NodeConfigError

    rc, nc = context.run_config, context.node_config
    how = 'pass them to every SuperNode: --node-config "partition-id=0 num-partitions=N" (one partition-id per node)'
    problems: list[str] = []
    ids: dict[str, int] = {}
    for key in ("partition-id", "num-partitions"):
        if key not in nc:
            problems.append(f"{key} is missing")
            continue
        value = nc[key]
        if isinstance(value, str):
            value = value.strip()
            try:
                value = int(value) if value.lstrip("+-").isdigit() else float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}={nc[key]!r} is not an integer")
        else:
            ids[key] = value
    if len(ids) == 2:
        pid, n = ids["partition-id"], ids["num-partitions"]
        if n < 1:
            problems.append(f"num-partitions={n} must be >= 1")
        elif not 0 <= pid < n:
            problems.append(f"partition-id={pid} must be in [0, num-partitions={n})")
    if problems:
        raise NodeConfigError([*problems, how])
    return NodeSpec(
        partition_id=ids["partition-id"],
        num_partitions=ids["num-partitions"],
        task=task_id(rc),
        seed=int(rc.get("seed", 42)),
        alpha=float(rc.get("alpha", 1.0)),
        kv_dtype=str(rc.get("kv-dtype", "fp32")),
        kv_stale_versions=stale_versions(str(rc.get("kv-stale-policy", "invalidate"))),
    )


def _limit_threads() -> None:
    """One intra-op thread per ClientApp process (override: FEDKV_TORCH_THREADS).

    The models are tiny and a 2-core machine runs several actors/processes; torch's
    default (all cores) made per-client training 10-100x slower and erratic here.
    """
    want = int(os.environ.get("FEDKV_TORCH_THREADS", "1"))
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


def get_node(context: Context) -> tuple[CacheNode, NodeSource]:
    """``RUNTIME.restore``: the node for this context and how it was obtained."""
    return RUNTIME.restore(context)


def build_node(context: Context) -> CacheNode:
    """A node on its persistent cache directory (node-config ``cache-dir``, else beside its
    node-local files): K/V, parameters and gradients survive between ClientApp processes."""
    store = NodeStore.for_context(context)
    where = store.cache_dir(str(context.node_config.get("cache-dir", "") or ""))
    return CacheNode(spec_from_context(context), cache_dir=where, cache_key=store.cache_key(where))


def save_node(context: Context, node: CacheNode) -> None:
    """``RUNTIME.save``: commit the node's cache, its public scalars into ``context.state``."""
    RUNTIME.save(context, node)


def discard(context: Context) -> None:
    """``RUNTIME.discard``."""
    RUNTIME.discard(context)


def forget_all() -> None:
    """``RUNTIME.forget_all``."""
    RUNTIME.forget_all()


def cache_capacity(context: Context) -> int:
    """Nodes one process keeps: the population, within [MIN_CACHED_NODES, MAX_CACHED_NODES]."""
    try:
        population = int(context.node_config.get("num-partitions", 0))
    except (TypeError, ValueError):
        population = 0
    return min(MAX_CACHED_NODES, max(MIN_CACHED_NODES, population))


def stored_params(context: Context) -> np.ndarray:
    """The parameters the node's cache directory has committed, as a fresh process reads them
    (tests, inspection; outside a handler: it takes the directory's lock for the read)."""
    from safetensors.torch import load as st_load

    from cache.persist import TENSOR_PREFIX, open_store

    store = NodeStore.for_context(context)
    where = store.cache_dir(str(context.node_config.get("cache-dir", "") or ""))
    spec = spec_from_context(context)
    layout = model_layout(spec.task, spec.seed)
    seg = open_store(where, store.cache_key(where), None)
    try:
        state = {n: st_load(seg.get(TENSOR_PREFIX + f"param/{n}".encode()))["t"] for n in layout.names}
    finally:
        seg.close()
    return layout.flatten(state).astype(np.float32)


def kv_on_disk(node: CacheNode, source: NodeSource) -> int:
    """K/V blocks the node found on disk when this process opened its cache (0 when the
    process reused a node it already held)."""
    return 0 if source == NodeSource.REUSED else node.kv_blocks_on_disk


def pid() -> int:
    return os.getpid()
