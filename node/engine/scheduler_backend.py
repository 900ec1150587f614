"""``ScheduledBackend``: a ``node.engine.generation.GenerationBackend`` that runs a ``Scheduler`` on one
background thread.

The thread owns the model and the cache: ``submit`` checks and builds the handles in the
caller's thread and hands them over through a queue; cancellations and weight updates are
flags the loop applies at the next step boundary; tokens reach consumers through each
handle's own thread-safe queue (``Sequence.tokens``). ``close`` cancels what is left, stops the
thread and joins it.

``between_steps`` (optional) runs on the loop thread before every step and on every idle
wake-up: while it runs no forward runs, so a caller that must know the old weights are out of
use (a coherence ACK, ``node.serving.openai_follow``) does its work there.

The loop thread holds the process's OpenMP workers: the constructor frees its caller's, and
the loop frees its own whenever it waits for work (``node.engine.openmp_pool`` says why).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from cache import KVCache
from node.engine import openmp_pool
from node.engine.generation import GenerationRequest, kv_gauges, remote_events
from node.models.interface import CachedLM
from node.engine.scheduler import Scheduler, SchedulerConfig, Sequence

_log = logging.getLogger("fedkv.scheduler")


class ScheduledBackend:
    """Continuous batching behind the generation contract (see the module docstring)."""

    def __init__(self, model: CachedLM, cache: KVCache, config: SchedulerConfig | None = None,
                 *, model_id: str = "fedkv", idle_wait_s: float = 0.05,
                 between_steps: Callable[[], None] | None = None):
        self.model_id = model_id
        self.between_steps = between_steps
        self.scheduler = Scheduler(model, cache, config)
        self._inbox: queue.SimpleQueue[list[Sequence]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing = threading.Lock()  # a submit is queued before close, or refused
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._loop, name="fedkv-scheduler", daemon=True)
        self._thread.start()
        openmp_pool.release_pool()  # the loop runs the forwards now (node.engine.openmp_pool)

    @property
    def version(self) -> int:
        return self.scheduler.cache.version

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def gauges(self) -> dict[str, Any]:
        """A read-only glance for ``/metrics`` from any thread: requests waiting (queued here
        or in the scheduler) and running, preemptions so far, prefix-cache block hits per tier
        and what the cache holds (``KVCache.stats``, a snapshot safe beside the loop)."""
        s = self.scheduler
        stats = s.cache.stats()
        return {"waiting": self._inbox.qsize() + len(s.waiting), "running": len(s.running),
                "preemptions": s.counters["preemptions"],
                "tier_hits": dict(stats["tier_hits"]), "kv": kv_gauges(stats),
                "remote": remote_events(stats)}

    def submit(self, request: GenerationRequest) -> list[Sequence]:
        """One handle per fork; ``ValueError`` for a request the model or pool can never take."""
        seqs = self.scheduler.prepare(request)
        for s in seqs:
            s.on_cancel = self._wake.set
        with self._closing:
            if self._stop.is_set():
                raise RuntimeError("the backend is closed")
            self._inbox.put(seqs)
        self._wake.set()
        return seqs

    def update_weights(self, apply: Callable[[CachedLM], None], version: int | None = None) -> None:
        """Load new weights at the next step boundary (``Scheduler.update_weights``)."""
        self.scheduler.update_weights(apply, version)
        self._wake.set()

    def close(self) -> None:
        """Cancel every handle, stop the loop thread and join it."""
        with self._closing:
            self._stop.set()
        self._wake.set()
        self._thread.join()

    def __enter__(self) -> "ScheduledBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self) -> None:
        s = self.scheduler
        try:
            while not self._stop.is_set():
                self._between_steps()
                self._drain()
                if not s.has_work:
                    self._idle()
                    continue
                try:
                    s.step()
                except Exception as e:  # noqa: BLE001 -- fail the requests, keep serving
                    _log.exception("scheduler step failed")
                    s.fail_all(f"the decode step failed ({type(e).__name__})")
        finally:
            self._drain()
            s.cancel_all()

    def _idle(self) -> None:
        """Free this thread's OpenMP workers (``node.engine.openmp_pool``; a no-op when it has
        none), then wait for work."""
        openmp_pool.release_pool()
        self._wake.wait(self._idle_wait_s)
        self._wake.clear()

    def _between_steps(self) -> None:
        if self.between_steps is None:
            return
        try:
            self.between_steps()
        except Exception:  # noqa: BLE001 -- the hook's failure is logged; serving goes on
            _log.exception("between-steps hook failed")

    def _drain(self) -> None:
        while True:
            try:
                seqs = self._inbox.get_nowait()
            except queue.Empty:
                return
            self.scheduler.enqueue(seqs)
