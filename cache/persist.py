"""Persistence of a KVCache in a directory: what survives between Flower messages.

Everything goes into one ``SegmentStore`` (``cache/segments/``: atomic commits, a checksum
per record and per manifest, AES-256-GCM with the node's key; the record map sealed and record
ids keyed, so nothing on disk names a block's content hash; directory 0700, files 0600): K/V
blocks (``kind: kv``, keyed by content hash), named tensors (``kind: tensor``: the node's ``param/`` and ``grad/``, one
safetensors blob each) and the engine's model version (``kind: engine``). Opening a directory
restores tensors and version at once and blocks lazily (the hottest into warm first).
The functions see the engine through ``Persistent`` (what ``KVCache`` offers publicly), so
this module never imports the engine.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

from safetensors.torch import load as st_load, save as st_save

from cache.fsperm import LOCK_TIMEOUT_S

if TYPE_CHECKING:
    from cache.config import CacheConfig
    from cache.manager import BlockManager
    from cache.segments import SegmentStore
    from cache.tensor_store import TensorStore

_log = logging.getLogger("fedkv.cache")


class Persistent(Protocol):
    """What persistence reads and sets on a cache (``KVCache`` is one)."""

    store: "SegmentStore | None"
    blocks: "BlockManager"
    tensors: "TensorStore"
    found_on_disk: int

    @property
    def version(self) -> int: ...

    def compact(self) -> dict[str, int]: ...

ENGINE_KEY = b"engine:state"
TENSOR_PREFIX = b"tensor:"


def open_store(directory: str | os.PathLike, key: bytes | None, max_bytes: int | None,
               lock_timeout_s: float = LOCK_TIMEOUT_S):
    """The directory's store; a corrupt manifest or an older on-disk format means a clean
    rebuild (logged). A directory group/other can reach, a lock held past ``lock_timeout_s``
    or a wrong key raise (``UnsafePermissionsError``, ``StoreLockedError``, ``WrongKeyError``)."""
    from cache.segments import CorruptManifestError, OldFormatError, SegmentStore

    # read_staged: a block demoted to cold this process is a hit before the next commit
    kw = dict(key=key, max_bytes=max_bytes, read_staged=True, lock_timeout_s=lock_timeout_s)
    try:
        return SegmentStore(directory, **kw)
    except CorruptManifestError as e:
        what = "has an older on-disk format" if isinstance(e, OldFormatError) else "is unreadable"
        _log.warning("cache directory %s %s (%s); rebuilding it empty", directory, what, e)
        SegmentStore.wipe(directory, lock_timeout_s)
        return SegmentStore(directory, **kw)


def open_cache(make: Callable[..., Persistent], directory, config: "CacheConfig", *, key,
               max_bytes, **kwargs: Any) -> Persistent:
    """``make(config, store=..., **kwargs)`` on the directory's store, restored from it."""
    store = open_store(directory, key, max_bytes, config.lock_timeout_s)
    kv = make(config, store=store, **kwargs)
    kv.found_on_disk = sum(1 for k in store.keys() if store.meta(k).get("kind") == "kv")
    _load_tensors(kv)
    if ENGINE_KEY in store:
        kv.blocks.version = int(store.meta(ENGINE_KEY)["model_version"])
    kv.blocks.tiers.prewarm(int(config.warm_bytes * config.warmup_ratio))
    return kv


def _load_tensors(kv: Persistent) -> None:
    store = kv.store
    for k in store.keys():
        meta = store.meta(k)
        if meta.get("kind") != "tensor":
            continue
        try:
            t = st_load(store.get(k))["t"]
        except Exception as e:  # noqa: BLE001 -- a corrupt tensor is dropped, logged
            _log.warning("stored tensor %s dropped: %s: %s", meta.get("name"), type(e).__name__, e)
            store.delete(k)
            continue
        kv.tensors.put(str(meta["name"]), t, int(meta["version"]))


def _save_tensors(kv: Persistent) -> None:
    for name in kv.tensors.names():
        t = kv.tensors.get(name)
        kv.store.put(TENSOR_PREFIX + name.encode(), st_save({"t": t.contiguous()}),
                     {"kind": "tensor", "name": name, "version": kv.tensors.version(name)})


def _hot_entries(kv: Persistent) -> dict:
    m = kv.blocks
    return {b.hash: m.entry(b) for b in m.blocks.values()
            if b.hash is not None and m.index.get(b.hash) is b and b.dirty
            and b.version == m.version}


def flush(kv: Persistent, strict: bool = False) -> None:
    """Tensors, model version and K/V worth keeping, in one commit. ``strict``: a failure to
    write or commit the tensors and version raises (the previous commit stays); otherwise it is
    logged and they stay in memory only."""
    kv.compact()
    if kv.store is None:
        return
    entries = _hot_entries(kv)
    kv.blocks.tiers.drop_versions_where(lambda v: not kv.blocks.servable(v))  # moved while detached
    try:
        _save_tensors(kv)
        kv.store.put(ENGINE_KEY, b"", {"kind": "engine", "model_version": kv.version})
    except OSError as e:
        if strict:
            raise
        _log.warning("cache flush could not write tensors (%s: %s); memory only", type(e).__name__, e)
    kv.blocks.tiers.flush(entries, strict=strict)
    for h in entries:
        kv.blocks.index[h].dirty = False
    _compact_if_mostly_dead(kv)


COMPACT_DEAD_RATIO = 2.0
"""Rewrite the store once its files hold this many times its live records' bytes: tensors
are rewritten at every flush, so without it a node's directory grows by the model each
message."""


def _compact_if_mostly_dead(kv: Persistent) -> None:
    st = kv.store.stats()
    if st["bytes_on_disk"] > COMPACT_DEAD_RATIO * max(st["live_bytes"], 1):
        try:
            kv.store.compact()
        except OSError as e:
            _log.warning("cache store compaction failed (%s: %s); it keeps its old files",
                         type(e).__name__, e)


def close(kv: Persistent, strict: bool = False) -> None:
    flush(kv, strict)
    if kv.store is not None:
        kv.store.close()
        kv.store = None
        kv.blocks.tiers.cold = None
