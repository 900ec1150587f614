"""Reading and changing a live engine's cache from another process, through its directory.

A ``KVCache.open(dir, ...)`` engine owns ``dir/live/`` (mode 0700):

* ``stats.json``: its latest ``stats()`` snapshot with its pid and the wall time it was
  written; published on ``open``, on ``flush()`` and at most every ``PUBLISH_S`` by a timer
  thread (less often when a snapshot is expensive: at most 1 % of the time;
  ``attached: false`` once ``close``/``release`` let go of the directory);
* ``set-<id>.json``: a change request (``{"key", "value"}``) written by ``python -m cache set``;
  the engine's timer thread looks for requests every ``POLL_S`` (one ``os.scandir`` of this
  small directory), the engine applies each at its next operation boundary through
  ``KVCache.set_tunable`` (the same validator as the command line; ``cache/live.py``) and the
  thread answers in
* ``ack-<id>.json``: ``{"status": "applied", "key", "old", "new", "pid"}``, or
  ``"rejected"``/``"unreadable"`` with an ``error``.

Every file is written to a temporary name and renamed (readers never see half a file), mode
0600, and holds tunables and figures only, never key material. The engine logs and drops a
request it cannot read and never lets a bad file stop an operation; a reader gets
``CorruptLiveFileError``. Requests are separate files, so concurrent ``set`` calls are not lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from cache.errors import CacheError, ConfigError

_log = logging.getLogger("fedkv.cache")
LIVE_DIR = "live"
STATS_FILE = "stats.json"
POLL_S = 0.2
"""Longest wait before a live engine looks for change requests, and between two operation
boundaries that apply them."""
PUBLISH_S = 1.0
"""Longest wait between two timed stats snapshots."""
ACK_TTL_S = 60.0
"""Answers nobody collected (the requester timed out) are deleted after this long."""
_REQUEST = re.compile(r"^set-([0-9a-f]{32})\.json$")


class LiveControlError(CacheError):
    """Base of the errors of reading or changing a live engine through its directory."""


class NoLiveEngineError(LiveControlError):
    """No engine serves the directory: no snapshot, its writer exited or let go, or no answer."""


class CorruptLiveFileError(LiveControlError):
    """A stats snapshot or an answer in ``live/`` that is not what an engine writes."""


class ChangeRejectedError(LiveControlError, ConfigError):
    """The live engine refused a change (its validator said why)."""


def live_dir(directory: str | os.PathLike) -> str:
    return os.path.join(os.fspath(directory), LIVE_DIR)


def write_json_atomic(path: str, obj: Any) -> None:
    """``obj`` as JSON at ``path`` via a 0600 temporary file in the same directory + rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: str) -> bool:
    """Delete ``path``; False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _read_json_object(path: str) -> dict:
    """The JSON object in ``path``; CorruptLiveFileError when it is not one."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptLiveFileError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CorruptLiveFileError(f"{path} holds a {type(obj).__name__}, not a JSON object")
    return obj


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


# == engine side ===============================================================================
@dataclass(frozen=True)
class Request:
    """A change request read from ``set-<rid>.json``."""

    rid: str
    key: str
    value: Any


class LiveControl:
    """The engine's end: publishes snapshots, serves change requests."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = live_dir(directory)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def publish(self, stats: dict, *, attached: bool = True) -> None:
        """Write the snapshot; a failure (full disk) is logged, the engine goes on."""
        snap = {"pid": os.getpid(), "written_at": time.time(), "attached": attached,
                "stats": stats}
        try:
            write_json_atomic(os.path.join(self.dir, STATS_FILE), snap)
        except (OSError, TypeError, ValueError) as e:
            _log.warning("cache stats snapshot not written (%s: %s)", type(e).__name__, e)

    def serve(self, apply: Callable[[str, Any], tuple[Any, Any]]) -> int:
        """Apply every pending request with ``apply(key, value) -> (old, new)`` and answer
        it; returns how many were applied. Never raises for a bad file or a full disk.
        (A live engine splits this: ``cache.live.LivePlane``.)"""
        applied = 0
        for req in self.take_requests():
            answer = self.outcome(req, apply)
            self.answer(req, answer)
            applied += answer["status"] == "applied"
        return applied

    def take_requests(self) -> list[Request]:
        """Claim and read every pending request; one that cannot be read is answered
        ``unreadable`` at once (logged). Old answers nobody collected are pruned."""
        try:
            entries = list(os.scandir(self.dir))
        except OSError as e:
            _log.warning("cache control directory %s unreadable (%s)", self.dir, e)
            return []
        out = []
        for entry in entries:
            m = _REQUEST.match(entry.name)
            if m:
                req = self._take_one(entry.path, m.group(1))
                if req is not None:
                    out.append(req)
            elif entry.name.startswith("ack-"):
                self._prune_ack(entry)
        return out

    def _take_one(self, path: str, rid: str) -> Request | None:
        taken = path + ".taken"
        try:  # claim it: of two threads, or an engine and a withdrawing
            os.rename(path, taken)  # requester, exactly one gets the request
        except FileNotFoundError:
            return None
        try:
            req = _read_json_object(taken)
            if not isinstance(req.get("key"), str) or "value" not in req:
                raise CorruptLiveFileError(f"{path} has no string 'key' and 'value'")
            return Request(rid, req["key"], req["value"])
        except (CorruptLiveFileError, OSError) as e:
            _log.warning("cache control request %s ignored: %s", path, e)
            self.answer(Request(rid, "", None), {"status": "unreadable", "error": str(e)})
            return None
        finally:
            _unlink_quietly(taken)

    @staticmethod
    def outcome(req: Request, apply: Callable[[str, Any], tuple[Any, Any]]) -> dict:
        """``apply`` the request; the answer: applied (old, new) or rejected (why)."""
        try:
            old, new = apply(req.key, req.value)
        except ConfigError as e:
            return {"status": "rejected", "error": str(e)}
        return {"status": "applied", "key": req.key, "old": old, "new": new}

    def answer(self, req: Request, answer: dict) -> None:
        """Write the request's answer file (the engine's pid added); a failure is logged."""
        try:
            write_json_atomic(os.path.join(self.dir, f"ack-{req.rid}.json"),
                              {"pid": os.getpid(), **answer})
        except OSError as e:
            _log.warning("cache control answer for %s not written (%s)", req.rid, e)

    @staticmethod
    def _prune_ack(entry: os.DirEntry) -> None:
        try:
            if time.time() - entry.stat().st_mtime > ACK_TTL_S:
                os.unlink(entry.path)
        except OSError:
            pass


# == client side ===============================================================================
@dataclass
class Snapshot:
    """A published snapshot as a reader sees it."""

    pid: int
    age_s: float
    attached: bool
    stats: dict

    @property
    def live(self) -> bool:
        return self.attached and pid_alive(self.pid)

    def why_not_live(self) -> str:
        if not pid_alive(self.pid):
            return f"the engine that wrote it (pid {self.pid}) is not running"
        return f"the engine (pid {self.pid}) has closed or released the directory"


def live_engines_below(directory: str | os.PathLike) -> list[tuple[str, Snapshot]]:
    """The live engines of agents that keep their cache in a subdirectory of ``directory``
    (a serving agent publishes in ``<cache-dir>/serve``, beside the trainer's
    ``<cache-dir>/live``), as (that subdirectory, its snapshot), by name; a snapshot that is
    missing, unreadable or not live is left out."""
    try:
        subdirs = sorted(e.path for e in os.scandir(directory)
                         if e.is_dir(follow_symlinks=False) and e.name != LIVE_DIR)
    except OSError:
        return []
    found = []
    for sub in subdirs:
        if not os.path.exists(os.path.join(live_dir(sub), STATS_FILE)):
            continue
        try:
            snap = read_snapshot(sub)
        except LiveControlError:
            continue
        if snap.live:
            found.append((sub, snap))
    return found


def read_snapshot(directory: str | os.PathLike) -> Snapshot:
    """The directory's latest snapshot; NoLiveEngineError when there is none,
    CorruptLiveFileError when it is garbage."""
    path = os.path.join(live_dir(directory), STATS_FILE)
    if not os.path.exists(path):
        raise NoLiveEngineError(f"no live engine: {path} does not exist (no KVCache.open "
                                f"engine has published stats for {os.fspath(directory)})")
    snap = _read_json_object(path)
    try:
        return Snapshot(int(snap["pid"]), max(0.0, time.time() - float(snap["written_at"])),
                        bool(snap["attached"]), dict(snap["stats"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptLiveFileError(f"{path} is not an engine snapshot (bad or missing "
                                   f"field: {e})") from None


def request_change(directory: str | os.PathLike, key: str, value: Any, *,
                   timeout_s: float = 5.0, poll_s: float = 0.02) -> dict:
    """Hand ``key = value`` to the live engine and wait for its answer ({"old", "new",
    "pid", ...}). NoLiveEngineError when no engine is live or none answers in time (the
    request is withdrawn), ChangeRejectedError when it refuses the value."""
    snap = read_snapshot(directory)
    if not snap.live:
        raise NoLiveEngineError(f"no live engine for {os.fspath(directory)}: "
                                f"{snap.why_not_live()}")
    rid = uuid.uuid4().hex
    folder = live_dir(directory)
    req, ack = os.path.join(folder, f"set-{rid}.json"), os.path.join(folder, f"ack-{rid}.json")
    write_json_atomic(req, {"key": key, "value": value, "requested_at": time.time()})
    if not _wait_for(ack, timeout_s, poll_s):
        # withdrawn unless the engine took it a moment ago: then its answer is on the way
        if _unlink_quietly(req) or not _wait_for(ack, 1.0, poll_s):
            raise NoLiveEngineError(
                f"no answer from the engine (pid {snap.pid}) within {timeout_s:g} s: it applies "
                f"changes between cache operations, so it may be idle or stuck; request "
                f"withdrawn")
    try:
        answer = _read_json_object(ack)
    finally:
        _unlink_quietly(ack)
    status = answer.get("status")
    if status == "applied" and {"old", "new"} <= answer.keys():
        return answer
    if status == "rejected":
        raise ChangeRejectedError(f"the engine refused it: {answer.get('error')}")
    if status == "unreadable":
        raise CorruptLiveFileError(f"the engine could not read the request: {answer.get('error')}")
    raise CorruptLiveFileError(f"{ack} is not an engine answer: {answer!r}")


def _wait_for(path: str, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
