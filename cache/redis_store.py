"""``RedisStore``: the cold tier on a Redis server several processes of one node share.

It stands behind the ``ColdStore`` interface of ``cache/tiers.py`` (what the local
``SegmentStore`` offers), so a cache uses it alone or under the local store
(``cache/chained_store.py``). What differs, and why:

* **Keys and values** are sealed with the node's cache key (``cache/remote_seal.py``): a key is
  an HMAC of (namespace, the block's chained content hash), a value AES-256-GCM with both as
  associated data. The Redis operator sees opaque ids, sizes and access times, nothing more.
* **Namespace**: node, model and adapter/weights identity (``RedisOptions.namespace``); the
  model version and the tenant are inside the content hash already, so a write-back's new
  version and another tenant never meet a record of the old one or of another tenant.
* **Batched reads**: ``prefetch`` fetches every block of a prefix walk with one ``MGET``
  (``batch_keys`` per command, pipelined); the walk then reads from that batch.
* **Writes off the request path**: ``put``/``publish`` queue the block (bounded by
  ``write_queue_bytes``); a writer thread seals it and ``SET``s it with ``ttl_s`` in
  pipelines. ``commit`` waits for the queue to drain (bounded), which is what tests and
  ``flush`` want; a block queued and not yet written is read from the queue.
* **Faults are misses**: a stopped, restarting, full (``maxmemory``), slow (``socket_timeout_s``)
  server or a record that fails its tag is counted (``stats()``) and the block recomputed;
  after a connection failure or a timeout the server is not asked again for
  ``retry_after_s`` (lookups miss at once instead of each waiting for a timeout).
* A shared store is not enumerated: ``keys`` is empty, ``drop_where`` drops nothing (old
  versions are never read: their hashes differ; they age out by ``ttl_s`` or the server's
  eviction policy). Only K/V blocks (``meta["kind"] == "kv"``) are stored, never tensors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from cache.remote_seal import RecordRejected, RemoteKeys
from cache.segments.errors import UnknownRecordError

_log = logging.getLogger("fedkv.cache")
_MISSING = object()


@dataclass
class RedisOptions:
    """Where the Redis tier lives and how it behaves (defaults suit a server on loopback)."""

    url: str
    """``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or ``unix:///path.sock``."""
    namespace: bytes = b""
    """Node, model and adapter/weights identity: records of other weights never meet."""
    prefix: str = "fedkv:kv:"
    """Prefix of every Redis key this tier writes (several applications on one server)."""
    ttl_s: float = 86400.0
    """Records expire after this long (0: never; then only the server's eviction policy)."""
    socket_timeout_s: float = 0.5
    """A read or write slower than this is a miss (a timeout), not a wait."""
    retry_after_s: float = 2.0
    """After a connection failure or timeout, lookups miss at once for this long."""
    batch_keys: int = 8
    """Keys per ``MGET`` (and ``SET``s per writer pipeline); a longer prefix walk sends several
    ``MGET``s in one pipeline, one round trip: small replies start arriving at once (one
    ``MGET`` of 63 fp32 SmolLM2 blocks is a 46 MB reply the server builds before sending)."""
    write_queue_bytes: int = 256 << 20
    """Payload bytes queued for the writer at most; past it a block is not written (counted)."""
    password_env: str = "FEDKV_REDIS_PASSWORD"
    """Environment variable with the password when the URL has none (keeps it out of ``ps``)."""


COUNTERS = ("hits", "misses", "rejected", "errors", "timeouts", "skipped", "round_trips",
            "bytes_read", "writes", "bytes_written", "write_errors", "writes_dropped",
            "writes_skipped")


class RedisStore:
    """The Redis tier of one cache (see the module docstring)."""

    shared = True
    """Blocks are written through when computed (``Tiers.publish``), not only when evicted."""

    def __init__(self, options: RedisOptions, key: bytes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.options, self.clock = options, clock
        self._keys = RemoteKeys(key, options.namespace)
        del key
        self._errors = (redis.RedisError, OSError)
        self._timeout_errors = (redis.TimeoutError, TimeoutError)
        password = os.environ.get(options.password_env) or None
        self.client = redis.Redis.from_url(
            options.url, password=password, socket_timeout=options.socket_timeout_s,
            socket_connect_timeout=options.socket_timeout_s, retry=Retry(NoBackoff(), 0),
            health_check_interval=0)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.read_s = 0.0
        self.last_remote = False
        """The last ``get`` came from this tier (``Tiers`` counts it as a Redis hit)."""
        self._lock = threading.Lock()
        self._ahead: dict[bytes, bytes | None] = {}
        self._last: tuple[bytes, dict] | None = None
        self._pending: dict[bytes, tuple[bytes, dict]] = {}
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._written: OrderedDict[bytes, None] = OrderedDict()
        self._down_until = 0.0
        self._closed = False
        self._cv = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="fedkv-redis-writer",
                                        daemon=True)
        self._writer.start()

    # -- bookkeeping ---------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _rkey(self, key: bytes) -> bytes:
        return self.options.prefix.encode() + self._keys.record_id(key).hex().encode()

    def _available(self) -> bool:
        if self.clock() < self._down_until:
            self._count("skipped")
            return False
        return True

    def _fail(self, err: Exception, what: str) -> None:
        timeout = isinstance(err, self._timeout_errors)
        self._count("timeouts" if timeout else "errors")
        was_up = self.clock() >= self._down_until
        self._down_until = self.clock() + self.options.retry_after_s
        with self._lock:
            self._written.clear()  # a restarted server may have lost what we wrote
        if was_up:
            _log.warning("Redis tier %s failed (%s); blocks are recomputed, the server is "
                         "asked again in %.1f s", what, type(err).__name__,
                         self.options.retry_after_s)

    # -- reads -------------------------------------------------------------------------
    def prefetch(self, keys: list[bytes]) -> None:
        """Fetch the records of ``keys`` (a prefix walk's blocks) in one batched read."""
        self._ahead = {}
        want = [k for k in keys if k not in self._pending]
        if not want:
            return
        if not self._available():
            self._ahead = dict.fromkeys(want)
            return
        n = max(1, self.options.batch_keys)
        chunks = [want[i:i + n] for i in range(0, len(want), n)]
        t0 = time.perf_counter()
        try:
            if len(chunks) == 1:
                values = self.client.mget([self._rkey(k) for k in chunks[0]])
            else:
                pipe = self.client.pipeline(transaction=False)
                for c in chunks:
                    pipe.mget([self._rkey(k) for k in c])
                values = [v for part in pipe.execute() for v in part]
        except self._errors as e:
            self._fail(e, "read")
            self._ahead = dict.fromkeys(want)
            return
        self.read_s += time.perf_counter() - t0
        self._count("round_trips")
        self._ahead = dict(zip(want, values))

    def __contains__(self, key: object) -> bool:
        key = bytes(key)
        if key in self._pending:
            return True
        if key in self._ahead:
            found = self._ahead[key] is not None
        elif not self._available():
            return False
        else:
            try:
                found = bool(self.client.exists(self._rkey(key)))
                self._count("round_trips")
            except self._errors as e:
                self._fail(e, "lookup")
                return False
        if not found:
            self._count("misses")
            with self._lock:
                self._written.pop(key, None)  # evicted or expired there: write it again
        return found

    def get(self, key: bytes) -> bytes:
        """The payload of ``key``; ``ConnectionError`` when the server is unreachable (a miss
        for ``Tiers``), ``RecordRejected`` for a value that is not this node's record."""
        key = bytes(key)
        self.last_remote = True
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            self._last = (key, pending[1])
            return pending[0]
        value = self._ahead.pop(key, _MISSING)
        if value is _MISSING:
            value = self._get_one(key)
        if value is None:
            raise UnknownRecordError("no such record in the Redis tier (evicted or expired)")
        try:
            payload, meta = self._keys.open(key, value)
        except RecordRejected:
            self._count("rejected")
            raise
        with self._lock:
            self.counters["hits"] += 1
            self.counters["bytes_read"] += len(value)
        self._last = (key, meta)
        return payload

    def _get_one(self, key: bytes) -> bytes | None:
        if not self._available():
            raise ConnectionError("the Redis tier is unavailable for now")
        t0 = time.perf_counter()
        try:
            value = self.client.get(self._rkey(key))
        except self._errors as e:
            self._fail(e, "read")
            raise ConnectionError(f"the Redis tier failed a read ({type(e).__name__})") from None
        self.read_s += time.perf_counter() - t0
        self._count("round_trips")
        return value

    def meta(self, key: bytes) -> dict:
        key = bytes(key)
        if self._last is not None and self._last[0] == key:
            return dict(self._last[1])
        self.get(key)
        return dict(self._last[1])

    # -- writes ------------------------------------------------------------------------
    def put(self, key: bytes, payload, meta: dict) -> None:
        """Queue a K/V block for the writer (other kinds are not stored here)."""
        if meta.get("kind") != "kv":
            return
        key, payload = bytes(key), bytes(payload)
        with self._lock:
            if key in self._written or key in self._pending:
                self.counters["writes_skipped"] += 1
                return
            if self._closed or self._queued_bytes + len(payload) > self.options.write_queue_bytes \
                    or self.clock() < self._down_until:
                self.counters["writes_dropped"] += 1
                return
            self._pending[key] = (payload, dict(meta))
            self._queue.append(key)
            self._queued_bytes += len(payload)
            self._cv.notify()

    publish = put
    """Write-through of a block just computed: another process may want it now."""

    def _take_batch(self) -> list[tuple[bytes, bytes, dict]] | None:
        with self._lock:
            while not self._queue and not self._closed:
                self._cv.wait()
            if not self._queue:
                return None
            batch = []
            while self._queue and len(batch) < self.options.batch_keys:
                key = self._queue.popleft()
                batch.append((key, *self._pending[key]))
            self._busy = True
            return batch

    def _write_loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 -- the writer never dies; the blocks are dropped
                _log.exception("Redis tier writer failed; blocks dropped")
                self._count("write_errors", len(batch))
            finally:
                with self._lock:
                    for key, payload, _ in batch:
                        self._pending.pop(key, None)
                        self._queued_bytes -= len(payload)
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, batch: list[tuple[bytes, bytes, dict]]) -> None:
        if self.clock() < self._down_until:
            self._count("writes_dropped", len(batch))
            return
        ttl = int(self.options.ttl_s * 1000) or None
        pipe = self.client.pipeline(transaction=False)
        sizes = 0
        for key, payload, meta in batch:
            value = self._keys.seal(key, payload, meta)
            sizes += len(value)
            pipe.set(self._rkey(key), value, px=ttl)
        try:
            results = pipe.execute(raise_on_error=False)
        except self._errors as e:
            self._fail(e, "write")
            self._count("write_errors", len(batch))
            return
        ok = [k for (k, _, _), r in zip(batch, results) if not isinstance(r, Exception)]
        with self._lock:
            self.counters["writes"] += len(ok)
            self.counters["bytes_written"] += sizes
            self.counters["write_errors"] += len(batch) - len(ok)
            for k in ok:
                self._written[k] = None
            while len(self._written) > 100_000:
                self._written.popitem(last=False)

    def commit(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) until every queued block is written or dropped."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))

    # -- the rest of the ColdStore interface -----------------------------------------------
    def delete(self, key: bytes) -> None:
        """Drop a record found corrupt (errors ignored: it is rejected again next time)."""
        key = bytes(key)
        self._ahead.pop(key, None)
        with self._lock:
            self._written.pop(key, None)
        if self._available():
            try:
                self.client.delete(self._rkey(key))
            except self._errors as e:
                self._fail(e, "delete")

    def drop_where(self, pred: Callable[[dict], bool]) -> int:
        return 0

    def keys(self) -> list[bytes]:
        return []

    def keys_hottest_first(self) -> list[bytes]:
        return []

    def compact(self) -> None:
        pass

    def __len__(self) -> int:
        return 0

    def remote_stats(self) -> dict:
        """What ``KVCache.stats()["remote"]`` shows: hits, misses, faults, bytes, times."""
        with self._lock:
            out = dict(self.counters)
            out["pending_writes"] = len(self._queue) + (1 if self._busy else 0)
        out["read_s"] = self.read_s
        return out

    def stats(self) -> dict:
        return {"bytes_on_disk": 0, "live_bytes": 0, "remote": self.remote_stats()}

    def close(self) -> None:
        """Write what is queued (bounded by ``commit``), stop the writer, close the client."""
        self.commit()
        with self._lock:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(5.0)
        self.client.close()
