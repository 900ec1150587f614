"""``ChainedStore``: the node's own disk (``SegmentStore``) in front of a shared store (the
Redis tier), as one ``ColdStore`` for ``cache/tiers.py``.

Why both: the local store is this process's (its lock, its restart), the shared one every
process of the node reads. A demoted block goes to both; a lookup reads the disk first and
asks the shared store only for what the disk lacks; blocks just computed are written through
to the shared store alone (the disk gets them when they are demoted or flushed). Listing,
version drops and compaction are the local store's (a shared store is not enumerated).
"""

from __future__ import annotations

from typing import Callable

from cache.redis_store import RedisStore
from cache.tiers import ColdStore


class ChainedStore:
    """``local`` first, ``remote`` below it (see the module docstring)."""

    shared = True

    def __init__(self, local: ColdStore, remote: RedisStore) -> None:
        self.local, self.remote = local, remote
        self.last_remote = False

    def put(self, key: bytes, payload, meta: dict) -> None:
        self.remote.put(key, payload, meta)  # queued: never raises
        self.local.put(key, payload, meta)  # a full disk raises OSError: Tiers counts it

    def publish(self, key: bytes, payload, meta: dict) -> None:
        self.remote.publish(key, payload, meta)

    def prefetch(self, keys: list[bytes]) -> None:
        self.remote.prefetch([k for k in keys if k not in self.local])

    def commit(self) -> None:
        self.remote.commit()
        self.local.commit()

    def get(self, key: bytes) -> bytes:
        self.last_remote = key not in self.local
        return self.remote.get(key) if self.last_remote else self.local.get(key)

    def meta(self, key: bytes) -> dict:
        return self.remote.meta(key) if key not in self.local else self.local.meta(key)

    def delete(self, key: bytes) -> None:
        if key in self.local:
            self.local.delete(key)
        self.remote.delete(key)

    def drop_where(self, pred: Callable[[dict], bool]) -> int:
        return self.local.drop_where(pred)

    def keys(self) -> list[bytes]:
        return self.local.keys()

    def keys_hottest_first(self) -> list[bytes]:
        return self.local.keys_hottest_first()

    def compact(self) -> None:
        self.local.compact()

    def stats(self) -> dict:
        return self.local.stats()

    def remote_stats(self) -> dict:
        return self.remote.remote_stats()

    def __contains__(self, key: object) -> bool:
        return key in self.local or key in self.remote

    def __len__(self) -> int:
        return len(self.local)

    def close(self) -> None:
        self.remote.close()
        self.local.close()
