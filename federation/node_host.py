"""One ``CacheNode`` per Flower node, reused across rounds.

What persists where (measured, see docs/flower-notes.md):

* The node's KV cache (K/V blocks, ``param/``, ``grad/``, model version) persists in its
  cache directory (``cache.KVCache.open``; encrypted with the node's own key), so a fresh
  ClientApp process warm-starts from what the previous message flushed.
* ``context.state`` is the only thing Flower guarantees per node across messages, in
  simulation and in deployment; but in simulation it lives in the ServerApp's process. So it
  keeps only public scalars (global version, generation); the parameters (the decrypted global
  model, which the server must not read) go to the node's own directory
  (``federation.node_store``, ``params-<generation>.npy``, mode 0600), named by generation so a
  handler that fails after writing leaves the committed generation's file in place.
* A module-level cache lives as long as the *process* that runs the ClientApp: a Ray
  actor in simulation (actors are shared by all nodes, a node may land on a different
  actor each message), a fresh process per message in deployment. So the cache is
  only a shortcut: it is used when its ``generation`` equals the one in
  ``context.state``; otherwise the node is rebuilt (data loaders etc.) and its state
  restored from ``context.state``.
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

from federation.config import stale_versions
from federation.messages import NodeSource
from federation.node_store import NodeStore
from node.cache_node import CacheNode, NodeSpec

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


_CACHE: "OrderedDict[tuple[int, int], _Entry]" = OrderedDict()
_OPEN: list[CacheNode] = []
"""Nodes whose cache directory this message opened; ``releasing`` closes them at its end
(another process -- a Ray actor, the next SuperNode message -- may need the directory)."""


def releasing(handler: Callable[..., T]) -> Callable[..., T]:
    """Wrap a ClientApp handler: every cache directory it opened is released when it ends,
    also when it raises (what a message persists is what ``save_node`` flushed)."""
    @functools.wraps(handler)
    def wrapped(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        finally:
            _release_open()
    return wrapped


def _release_open() -> None:
    while _OPEN:
        _OPEN.pop().release()


def peek_node(context: Context) -> CacheNode:
    """The node for inspection outside a handler (its directory released again)."""
    try:
        return get_node(context)[0]
    finally:
        _release_open()


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
        task=str(rc.get("task", "digits")),
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
    """The node for this context and how it was obtained (``NodeSource``: built, restored, reused)."""
    _limit_threads()
    key = (context.run_id, context.node_id)
    meta = context.state.config_records.get(META_KEY)
    generation = int(meta["generation"]) if meta is not None else 0
    entry = _CACHE.get(key)
    if entry is not None and entry.generation == generation:
        _CACHE.move_to_end(key)
        entry.node.reattach()
        _OPEN.append(entry.node)
        return entry.node, NodeSource.REUSED
    node = build_node(context)
    _OPEN.append(node)
    source = NodeSource.BUILT
    if meta is not None:
        scalars = {k: v for k, v in meta.items() if k != "generation"}
        if node.version != int(scalars["version"]):  # the cache is behind: restore the copy
            params = NodeStore.for_context(context).load_params(generation)
            node.load_state(params, scalars)
        else:
            node.load_scalars(scalars)
        source = NodeSource.RESTORED
    _remember(key, node, generation, cache_capacity(context))
    return node, source


def build_node(context: Context) -> CacheNode:
    """A node on its persistent cache directory (node-config ``cache-dir``, else beside its
    node-local files): K/V, parameters and gradients survive between ClientApp processes."""
    store = NodeStore.for_context(context)
    where = store.cache_dir(str(context.node_config.get("cache-dir", "") or ""))
    return CacheNode(spec_from_context(context), cache_dir=where, cache_key=store.cache_key(where))


def save_node(context: Context, node: CacheNode) -> None:
    """Write the node's parameters to its directory, its public scalars into ``context.state``,
    and bump the generation the cache checks."""
    key = (context.run_id, context.node_id)
    meta = context.state.config_records.get(META_KEY)
    generation = (int(meta["generation"]) if meta is not None else 0) + 1
    params, scalars = node.to_state()
    NodeStore.for_context(context).save_params(generation, np.asarray(params))
    node.persist()  # the cache directory is the source of truth; the file above a copy
    context.state[META_KEY] = ConfigRecord({**scalars, "generation": generation})
    _remember(key, node, generation, cache_capacity(context))


def cache_capacity(context: Context) -> int:
    """Nodes one process keeps: the population, within [MIN_CACHED_NODES, MAX_CACHED_NODES]."""
    try:
        population = int(context.node_config.get("num-partitions", 0))
    except (TypeError, ValueError):
        population = 0
    return min(MAX_CACHED_NODES, max(MIN_CACHED_NODES, population))


def _remember(key: tuple[int, int], node: CacheNode, generation: int, capacity: int) -> None:
    _CACHE[key] = _Entry(node, generation)
    _CACHE.move_to_end(key)
    while len(_CACHE) > capacity:
        _CACHE.popitem(last=False)


def discard(context: Context) -> None:
    """Drop this node's cached object (after a failed handler left it half-updated); its
    cache directory keeps what the last successful message flushed."""
    entry = _CACHE.pop((context.run_id, context.node_id), None)
    if entry is not None:
        entry.node.release()


def forget_all() -> None:
    """Drop the process cache (tests; simulates a fresh ClientApp process)."""
    _CACHE.clear()


def stored_params(context: Context) -> np.ndarray:
    """The parameters of the node's committed generation (tests, inspection)."""
    meta = context.state.config_records[META_KEY]
    return NodeStore.for_context(context).load_params(int(meta["generation"]))


def kv_on_disk(node: CacheNode, source: NodeSource) -> int:
    """K/V blocks the node found on disk when this process opened its cache (0 when the
    process reused a node it already held)."""
    return 0 if source == NodeSource.REUSED else node.kv_blocks_on_disk


def pid() -> int:
    return os.getpid()
