"""The engine's live-control plane: ``cache/control.py``'s directory served off the decode path.

A timer thread does the file work: every ``POLL_S`` it takes the change requests waiting in
``live/`` (claim, read, validate the file) into an in-memory inbox, writes the answers of the
requests the engine has applied, and at most every ``PUBLISH_S`` (and never more than 1 % of
the time: ``PUBLISH_COST_FACTOR``) publishes a stats snapshot. The engine's part is in memory
only: at an operation boundary, at most every ``POLL_S``, it applies what the inbox holds
(``apply_pending``: a deque check when there is nothing) -- tunables change on the engine's
own thread, between two operations, as before. So no decode step opens a file or walks the
blocks for a snapshot. Snapshots are also published on request (``publish``: ``KVCache.open``,
``flush``, ``close``).

The snapshot runs on the timer thread while the engine may be operating: it reads the
engine's containers without a lock, so a snapshot describes the cache at some moment during
an operation, and one that meets a container being resized is retried (``SNAPSHOT_TRIES``).
This module knows the engine only as ``LiveEngine`` (``stats``, ``set_tunable``, ``config``);
the plane itself only as two callables (``snapshot`` and ``apply``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from time import perf_counter_ns
from typing import Any, Callable, Protocol

from cache.control import POLL_S, PUBLISH_S, LiveControl, Request

_log = logging.getLogger("fedkv.cache")
PUBLISH_COST_FACTOR = 100
"""Live snapshots take at most 1/100 of the time (``LivePlane.publish``)."""
SNAPSHOT_TRIES = 3
"""Attempts at a snapshot that meets a container changing size under it."""


class LiveEngine(Protocol):
    """What the plane needs of an engine (``KVCache`` is one)."""

    config: Any

    def stats(self) -> dict: ...

    def set_tunable(self, key: str, value: Any) -> Any: ...


def go_live(engine: LiveEngine, directory: str | os.PathLike,
            old: "LivePlane | None" = None) -> "LivePlane | None":
    """A plane for ``engine`` on ``directory`` (``old`` stopped), its first snapshot
    published; None (logged) when the directory cannot hold one. The plane and its thread
    hold the engine only through a weak reference: a dropped engine is not kept alive."""
    if old is not None:
        old.stop()
    ref = weakref.ref(engine)

    def apply(key: str, value: Any) -> tuple[Any, Any]:
        e = ref()
        before = e.set_tunable(key, value)
        after = getattr(e.config, key)
        _log.info("cache tunable %s changed from another process: %r -> %r", key, before, after)
        return before, after

    try:
        plane = LivePlane(directory, lambda: ref().stats(), apply)
    except OSError as e:
        _log.warning("cache live control unavailable in %s (%s)", directory, e)
        return None
    plane.publish()
    return plane


def leave_live(plane: "LivePlane | None") -> None:
    """Stop the plane and publish a last snapshot marked ``attached: false``."""
    if plane is not None:
        plane.stop()
        plane.publish(attached=False)


class LivePlane:
    """Publishes ``snapshot()`` and hands change requests to ``apply(key, value) -> (old,
    new)`` for an engine whose directory is ``directory``; ``timer=False`` leaves the file
    work to explicit ``tick()`` calls (tests)."""

    def __init__(self, directory: str | os.PathLike, snapshot: Callable[[], dict],
                 apply: Callable[[str, Any], tuple[Any, Any]], *, timer: bool = True) -> None:
        self.control = LiveControl(directory)  # OSError: no live control (the caller logs)
        self.snapshot, self.apply = snapshot, apply
        self.inbox: deque[Request] = deque()
        """Requests read from the directory, waiting for the engine's next boundary."""
        self.answered: deque[tuple[Request, dict]] = deque()
        """Requests the engine applied (or refused), waiting for their answer file."""
        self.next_publish_ns = 0
        self._tick_lock = threading.Lock()  # one tick at a time (timer thread or a caller)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timer:
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop,
                                            self._wake), name="cache-live", daemon=True)
            self._thread.start()

    # -- the engine's side (its own thread, in memory) ------------------------------------------
    def apply_pending(self) -> int:
        """Apply every request in the inbox (at an operation boundary); returns how many."""
        done = 0
        while self.inbox:
            req = self.inbox.popleft()
            self.answered.append((req, self.control.outcome(req, self.apply)))
            done += 1
        if done:
            self._wake.set()  # the timer thread writes the answers now
        return done

    # -- the timer thread's side (files) --------------------------------------------------------
    def tick(self, now_ns: int | None = None) -> None:
        """One round of file work: answers out, requests in, a snapshot when due."""
        with self._tick_lock:
            while self.answered:
                self.control.answer(*self.answered.popleft())
            self.inbox.extend(self.control.take_requests())
            now_ns = perf_counter_ns() if now_ns is None else now_ns
            if now_ns >= self.next_publish_ns:
                self.publish(now_ns)

    def publish(self, now_ns: int | None = None, *, attached: bool = True) -> None:
        """Write a snapshot now; the next timed one comes after ``PUBLISH_S`` or 100x this
        one's cost, whichever is later (``stats()`` walks every block)."""
        now_ns = perf_counter_ns() if now_ns is None else now_ns
        self.control.publish(self._snapshot(), attached=attached)
        took = perf_counter_ns() - now_ns
        self.next_publish_ns = now_ns + max(int(PUBLISH_S * 1e9), PUBLISH_COST_FACTOR * took)

    def _snapshot(self) -> dict:
        for attempt in range(SNAPSHOT_TRIES):
            try:
                return self.snapshot()
            except RuntimeError:  # a dict or deque changed size while it was read
                if attempt == SNAPSHOT_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the timer thread (answers still waiting are written first)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None
        with self._tick_lock:
            while self.answered:
                self.control.answer(*self.answered.popleft())


def _run(plane_ref: "weakref.ref[LivePlane]", stop: threading.Event,
         wake: threading.Event) -> None:
    """The timer thread: a tick every ``POLL_S`` (sooner when answers wait) until stopped or
    the plane is gone (its engine was dropped without ``close``)."""
    while True:
        wake.wait(POLL_S)
        wake.clear()
        if stop.is_set():
            return
        plane = plane_ref()
        if plane is None:
            return
        try:
            plane.tick()
        except Exception:  # noqa: BLE001 -- live control never stops the engine
            _log.exception("cache live control failed; the engine goes on")
        del plane
