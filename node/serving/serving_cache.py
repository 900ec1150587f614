"""The serving cache of an OpenAI server (``node.serving.openai_api``): hot pool plus, by flags, a
warm tier (``--kv-warm-mib``), the node's disk (``--kv-cold-dir``) and a Redis server every
process of the node shares (``--kv-redis``): ``cache/tiers.py``, ``cache/redis_store.py``.

Why a module of its own: the server's request handling and its cache are separate concerns;
the server calls ``add_cli_args`` and ``build_serving_cache`` and nothing else of this.

The Redis tier's records are sealed with the node's cache key (``--kv-key-file``, default the
node's ``kv-cache.key`` when ``--cache-dir`` is given) and namespaced by the model's id and a
digest of the weights it starts from, so two processes share exactly when they serve the same
weights; the model version the node publishes (``--cache-dir``) and the tenant are part of
every block's content hash.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache import KVCache
from cache.config import KV_DTYPES

_log = logging.getLogger("fedkv.openai_api")


@dataclass
class ServingCacheOptions:
    """What the serving cache is made of (defaults: the hot pool alone, as before)."""

    pool_bytes: int
    warm_bytes: int = 0
    """CPU bytes of evicted blocks kept in their storage format (0: none)."""
    cold_dir: Path | None = None
    """This process's own disk tier (``SegmentStore``, sealed with the key); None: none."""
    cold_max_bytes: int | None = None
    redis_url: str | None = None
    """``redis://host:port/db``, ``rediss://`` or ``unix:///path``; None: no Redis tier."""
    redis_ttl_s: float = 86400.0
    redis_timeout_s: float = 0.5
    key_file: Path | None = None
    """The node's 32-byte cache key; needed by the disk and Redis tiers."""
    namespace: str = ""
    """Extra namespace (e.g. a deployment name) on top of model id and weights digest."""
    kv_dtype: str | None = None
    """Storage of cached K/V (``fp32``, ``int8``, ``int4``...; None: the cache's default)."""


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The ``--kv-*`` flags."""
    d = ServingCacheOptions(0)
    p.add_argument("--kv-warm-mib", type=float, default=0.0,
                   help="warm tier: MiB of CPU memory for blocks evicted from the pool")
    p.add_argument("--kv-cold-dir", type=Path, default=None,
                   help="cold tier on this process's disk (sealed with the node's key)")
    p.add_argument("--kv-cold-max-mib", type=float, default=None)
    p.add_argument("--kv-redis", default=None, metavar="URL",
                   help="shared cold tier: redis://host:port/db or unix:///path.sock (password: "
                        "$FEDKV_REDIS_PASSWORD); every process of the node with the same "
                        "weights reuses the prefixes the others computed")
    p.add_argument("--kv-redis-ttl", type=float, default=d.redis_ttl_s,
                   help="seconds a Redis record lives (0: until the server evicts it)")
    p.add_argument("--kv-redis-timeout", type=float, default=d.redis_timeout_s,
                   help="seconds a Redis read may take before it is a miss")
    p.add_argument("--kv-key-file", type=Path, default=None,
                   help="the node's cache key for --kv-cold-dir/--kv-redis (default: "
                        "kv-cache.key beside --cache-dir)")
    p.add_argument("--kv-namespace", default="", help="extra namespace of the shared tier")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help="storage of cached K/V (default: the model's: bf16 for bf16 and int8 "
                        "weights, else fp32)")


def from_args(args: argparse.Namespace, model: Any, model_id: str) -> KVCache:
    """``build_serving_cache`` for the server's parsed flags (its pool: ``--pool-mib``)."""
    return build_serving_cache(options_from_args(args, int(args.pool_mib * (1 << 20))), model,
                               model_id)


def options_from_args(args: argparse.Namespace, pool_bytes: int) -> ServingCacheOptions:
    mib = 1 << 20
    key_file = args.kv_key_file
    cache_dir = getattr(args, "cache_dir", None)
    if key_file is None and cache_dir is not None and not getattr(args, "no_key", False):
        key_file = getattr(args, "key_file", None) or Path(cache_dir).parent / "kv-cache.key"
    return ServingCacheOptions(
        pool_bytes, int(args.kv_warm_mib * mib), args.kv_cold_dir,
        int(args.kv_cold_max_mib * mib) if args.kv_cold_max_mib else None, args.kv_redis,
        args.kv_redis_ttl, args.kv_redis_timeout, key_file, args.kv_namespace, args.kv_dtype)


def weights_digest(model: Any) -> bytes:
    """BLAKE2b of the model's parameters and buffers (names, dtypes, shapes, bytes): two
    processes share Redis records only when they start from the same weights."""
    import torch
    h = hashlib.blake2b(digest_size=16, person=b"fedkv-weights")
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def _key(options: ServingCacheOptions) -> bytes:
    from crypto import passphrase_from_env, read_secret_file
    if options.key_file is None:
        raise SystemExit("--kv-cold-dir and --kv-redis seal cached K/V with the node's key: "
                         "give --kv-key-file (or --cache-dir, whose kv-cache.key is used)")
    try:
        return read_secret_file(options.key_file, passphrase_from_env())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--kv-key-file {options.key_file}: {type(e).__name__}: {e}") from None


def _store(options: ServingCacheOptions, model: Any, model_id: str):
    """The cold store the flags ask for: disk, Redis, both (disk first) or None."""
    if options.cold_dir is None and options.redis_url is None:
        return None
    key = _key(options)
    local = remote = None
    if options.cold_dir is not None:
        from cache.persist import open_store
        local = open_store(options.cold_dir, key, options.cold_max_bytes)
    if options.redis_url is not None:
        from cache.redis_store import RedisOptions, RedisStore
        ns = b"|".join([b"fedkv-serving-v1", model_id.encode(), weights_digest(model),
                        options.namespace.encode()])
        remote = RedisStore(RedisOptions(url=options.redis_url, namespace=ns,
                                         ttl_s=options.redis_ttl_s,
                                         socket_timeout_s=options.redis_timeout_s), key)
    if local is not None and remote is not None:
        from cache.chained_store import ChainedStore
        return ChainedStore(local, remote)
    return local if local is not None else remote


def build_serving_cache(options: ServingCacheOptions, model: Any, model_id: str) -> KVCache:
    """The server's ``KVCache`` with the tiers ``options`` name; at exit its blocks are
    flushed to the disk tier and the Redis writer drained."""
    overrides: dict[str, Any] = {"pool_bytes": options.pool_bytes, "warm_bytes": options.warm_bytes}
    if options.kv_dtype is not None:
        overrides["kv_dtype"] = options.kv_dtype
    store = _store(options, model, model_id)
    kv = KVCache(model.cache_config(**overrides), store=store)
    if store is not None:
        atexit.register(_close, kv)
    return kv


def _close(kv: KVCache) -> None:
    try:
        kv.close()
    except Exception as e:  # noqa: BLE001 -- exiting: report, never hang or raise
        _log.warning("serving cache close failed: %s: %s", type(e).__name__, e)
