"""The coherence directory kept in a file inside a node's cache directory, for processes that
share it (the ClientApp that trains and writes parameters back, a serving process).

    d = FileDirectory(cache_dir, Mode.STRONG, batch=16, timeout_s=10.0)
    agent = d.join("server")          # the agent API of cache.coherence.AgentBase
    p = agent.start_polling(0.005, on_invalidate=lambda keys: ...)   # keeps ACKs flowing

The directory is made 0700 and its files 0600 (``cache.fsperm``); one that group/other can
reach is refused (``UnsafePermissionsError``), and a transaction waits at most ``timeout_s`` for
``coherence.lock`` (``DirectoryLockedError`` names it) instead of hanging on another holder.

Every operation is one transaction: ``flock`` on ``coherence.lock``, read ``coherence.json``,
reap dead agents, apply the ``CoherenceTable`` transition, write the file back (to a temporary
file, then ``os.replace``, so a reader never sees half a file) only when it changed, unlock.
Agents are identified by id + pid (+ the process start time, so a reused pid is not taken for
the old process); an agent whose process is gone (or a zombie) is reaped by whoever next
touches the directory, exactly as a crash in the in-process simulator
(``experiments/coherence_sim.py``, ``Directory.crash``): its holdings dropped, its queued
invalidations delivered, every Pending waiting on it resolved. A blocked ``acquire_*``
retries with a short backoff (no background thread); an agent that never polls holds a strong
writer up until it is reaped or the writer's ``CoherenceTimeout``, hence ``start_polling``.
A transaction that changes nothing (a read hit, an empty poll) costs ~50 us here, one that
writes the file ~0.3 ms; the whole directory is rewritten, so it suits tens to hundreds of
entries (namespaces and named tensors such as ``param``), not one entry per K/V block. An
agent belongs to the process that joined: a forked child gets ``AgentGoneError``.

A corrupted or truncated ``coherence.json`` raises ``CorruptDirectoryError`` and is left
byte-for-byte as it was; nothing is rebuilt automatically. Why: the file is the only record of
who holds which version, and a directory rebuilt from nothing would let a strong write
complete without invalidating a reader that still holds the old version, the very stale read
the protocol exists to prevent. The entries' data live elsewhere (the cache files), so the
error loses nothing. ``FileDirectory.reset(path)`` moves the file aside and starts a new
directory epoch: agents of the old epoch get ``AgentGoneError`` and must join again (with no
copies). Since writes go through ``os.replace``, only something outside the protocol can
corrupt the file.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cache.coherence import (
    AgentBase,
    AgentGoneError,
    AgentRecord,
    CoherenceConfigError,
    CoherenceError,
    CoherenceTable,
    Entry,
    EntryView,
    Mode,
    Pending,
    State,
    check_settings,
)
from cache.fsperm import LockTimeoutError, lock_within, open_private, private_dir

__all__ = ["CorruptDirectoryError", "DirectoryLockedError", "FileAgent", "FileDirectory", "STATE_FILE", "LOCK_FILE",
           "pid_alive", "process_start"]

STATE_FILE = "coherence.json"
LOCK_FILE = "coherence.lock"
FORMAT = 1


class CorruptDirectoryError(CoherenceError):
    """``coherence.json`` cannot be read as a directory; it was left untouched."""


class DirectoryLockedError(CoherenceError, LockTimeoutError):
    """``coherence.lock`` stayed held by another process for the whole bounded wait
    (``timeout_s``): a transaction takes it for well under a millisecond."""


# --------------------------------------------------------------------------- liveness


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return []
    return text[text.rindex(")") + 2:].split()  # comm may hold spaces and parentheses


def process_start(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 where /proc is unavailable)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def pid_alive(pid: int, start: int = 0) -> bool:
    """True while ``pid`` runs and is the process that started at ``start`` (a zombie counts
    as dead: its agent will never ACK again)."""
    fields = _stat_fields(pid)
    if fields is None:
        return False
    if fields:
        return fields[0] not in ("Z", "X") and (start == 0 or int(fields[19]) == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- (de)serialisation


def dump_table(table: CoherenceTable, epoch: str) -> str:
    entries = {
        k: [e.version, e.state.value, {str(a): v for a, v in e.holders.items()}, e.owner,
            None if e.pending is None else [e.pending.requester, e.pending.kind,
                                            e.pending.version, sorted(e.pending.waiting_on)]]
        for k, e in table.entries.items()}
    agents = {str(a): [r.name, r.pid, r.start, [list(m) for m in r.inbox],
                       [list(q) for q in r.queue], r.writes]
              for a, r in table.agents.items()}
    return json.dumps({"format": FORMAT, "epoch": epoch, "mode": int(table.mode), "batch": table.batch,
                       "next_id": table.next_id, "counts": table.counts, "entries": entries,
                       "agents": agents}, separators=(",", ":"))


def load_table(text: str) -> tuple[CoherenceTable, str]:
    """Parse a directory file; any malformation is a ``ValueError``/``KeyError``/``TypeError``."""
    raw = json.loads(text)
    if raw["format"] != FORMAT:
        raise ValueError(f"format {raw['format']!r}, expected {FORMAT}")
    table = CoherenceTable(Mode(raw["mode"]), int(raw["batch"]))
    table.next_id = int(raw["next_id"])
    table.counts.update({k: int(v) for k, v in raw["counts"].items()})
    for key, (version, state, holders, owner, pending) in raw["entries"].items():
        table.entries[key] = Entry(
            int(version), State(state), {int(a): int(v) for a, v in holders.items()},
            None if owner is None else int(owner),
            None if pending is None else Pending(int(pending[0]), str(pending[1]), int(pending[2]),
                                                 {int(a) for a in pending[3]}))
    for aid, (name, pid, start, inbox, queue, writes) in raw["agents"].items():
        table.agents[int(aid)] = AgentRecord(
            str(name), int(pid), int(start), deque((str(k), int(v)) for k, v in inbox),
            [(int(t), str(k), int(v)) for t, k, v in queue], int(writes))
    return table, str(raw["epoch"])


# --------------------------------------------------------------------------- the directory


def _lock(path: Path, timeout_s: float) -> int:
    """flock ``coherence.lock`` (0600), waiting at most ``timeout_s`` for another holder."""
    try:
        return lock_within(path / LOCK_FILE, timeout_s, "the coherence directory")
    except LockTimeoutError as e:
        raise DirectoryLockedError(str(e)) from None


class FileDirectory:
    """A coherence directory in ``path/coherence.json`` shared by every process that opens it
    with the same mode and batch."""

    def __init__(self, path: str | os.PathLike[str], mode: Mode | int = Mode.STRONG, batch: int = 16,
                 timeout_s: float = 10.0, poll_interval_s: float = 0.002) -> None:
        self.mode = check_settings(mode, batch, timeout_s)
        if not poll_interval_s > 0:
            raise CoherenceConfigError(f"poll_interval_s must be > 0, not {poll_interval_s!r}")
        self.batch = batch
        self.timeout_s = float(timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.path = Path(path)
        private_dir(self.path)  # 0700, or refused when group/other can reach it
        self.state_file = self.path / STATE_FILE
        self._lock = threading.Lock()  # flock is per open file; threads also need this
        with self.transaction() as (table, _):
            if (table.mode, table.batch) != (self.mode, batch):
                raise CoherenceConfigError(
                    f"{self.state_file} is a mode {int(table.mode)}, batch {table.batch} directory; "
                    f"opened with mode {int(self.mode)}, batch {batch}")

    @contextmanager
    def transaction(self) -> Iterator[tuple[CoherenceTable, str]]:
        """The table under the file lock, dead agents reaped; written back if it changed."""
        with self._lock:
            fd = _lock(self.path, self.timeout_s)
            try:
                text = self._read()
                table, epoch = self._parse(text) if text is not None else self._fresh()
                self._reap(table)
                yield table, epoch
                new = dump_table(table, epoch)
                if new != text:
                    self._write(new)
            finally:
                os.close(fd)  # releases the flock

    def join(self, name: str) -> "FileAgent":
        if not isinstance(name, str) or not name:
            raise CoherenceConfigError(f"an agent name is a non-empty str, not {name!r}")
        pid = os.getpid()
        with self.transaction() as (table, epoch):
            aid = table.add_agent(name, pid, process_start(pid))
        return FileAgent(self, aid, name, epoch)

    def stats(self) -> dict[str, Any]:
        with self.transaction() as (table, _):
            return table.stats()

    def entry(self, key: str) -> EntryView:
        with self.transaction() as (table, _):
            return table.view(key)

    def agents(self) -> dict[int, str]:
        with self.transaction() as (table, _):
            return {aid: rec.name for aid, rec in table.agents.items()}

    @staticmethod
    def reset(path: str | os.PathLike[str], timeout_s: float = 10.0) -> Path | None:
        """Move ``coherence.json`` aside (``coherence.json.corrupt-N``) so the next opener starts a
        new epoch; returns where it went (None if there was no file)."""
        path = Path(path)
        private_dir(path)
        fd = _lock(path, timeout_s)
        try:
            src = path / STATE_FILE
            if not src.exists():
                return None
            n = 0
            while (path / f"{STATE_FILE}.corrupt-{n}").exists():
                n += 1
            dst = path / f"{STATE_FILE}.corrupt-{n}"
            os.replace(src, dst)
            return dst
        finally:
            os.close(fd)

    # internals ---------------------------------------------------------------------------
    def _read(self) -> str | None:
        try:
            return self.state_file.read_text()
        except FileNotFoundError:
            return None
        except UnicodeDecodeError as exc:
            raise self._corrupt(exc) from exc

    def _parse(self, text: str) -> tuple[CoherenceTable, str]:
        try:
            return load_table(text)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise self._corrupt(exc) from exc

    def _corrupt(self, exc: Exception) -> CorruptDirectoryError:
        return CorruptDirectoryError(
            f"{self.state_file} is not a coherence directory ({type(exc).__name__}: {exc}); "
            f"left untouched; FileDirectory.reset({str(self.path)!r}) moves it aside and starts a "
            "new directory (every agent then joins again)")

    def _fresh(self) -> tuple[CoherenceTable, str]:
        return CoherenceTable(self.mode, self.batch), uuid.uuid4().hex

    def _write(self, text: str) -> None:
        tmp = self.state_file.with_name(STATE_FILE + ".tmp")
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.state_file)

    @staticmethod
    def _reap(table: CoherenceTable) -> None:
        me = os.getpid()
        for aid, rec in list(table.agents.items()):
            if rec.pid and rec.pid != me and not pid_alive(rec.pid, rec.start):
                table.remove_agent(aid, crashed=True)


class FileAgent(AgentBase):
    """An agent of a ``FileDirectory``; every call is one file transaction (no lock-free hit:
    its inbox lives in the file)."""

    def __init__(self, directory: FileDirectory, aid: int, name: str, epoch: str) -> None:
        super().__init__(directory.timeout_s)
        self.id = aid
        self.name = name
        self.pid = os.getpid()
        self._dir = directory
        self._epoch = epoch

    def acquire_read(self, key: str) -> int:
        return self._acquire(key, write=False)

    def acquire_write(self, key: str) -> int:
        return self._acquire(key, write=True)

    def try_read(self, key: str) -> int | None:
        with self._tx() as table:
            return self._attempt(table, key, write=False)

    def try_write(self, key: str) -> int | None:
        with self._tx() as table:
            return self._attempt(table, key, write=True)

    def release(self, key: str) -> None:
        with self._tx() as table:
            if table.release(self.id, key):
                self._copies.pop(key, None)

    def poll(self) -> list[str]:
        with self._tx() as table:
            self._drop(table.take_inbox(self.id))
            return self._take_dropped()

    def holds(self, key: str) -> State:
        with self._tx() as table:
            return table.holds(self.id, key, self._copies.get(key))

    def sync(self) -> None:
        with self._tx() as table:
            table.flush(self.id)

    def leave(self) -> None:
        with self._tx() as table:
            table.remove_agent(self.id)
            self._gone = True
            self._copies.clear()

    @contextmanager
    def _tx(self) -> Iterator[CoherenceTable]:
        if self._gone:
            raise self._gone_error()
        if os.getpid() != self.pid:  # a forked child must not act (and ACK) as its parent
            raise AgentGoneError(f"agent {self.id} ({self.name}) joined in process {self.pid}, "
                                 f"not {os.getpid()}: join again in this process")
        with self._dir.transaction() as (table, epoch):
            if epoch != self._epoch or self.id not in table.agents:
                self._gone = True
                self._copies.clear()
                why = "the directory was reset" if epoch != self._epoch else "it left or was reaped"
                raise AgentGoneError(f"agent {self.id} ({self.name}) is no longer in "
                                     f"{self._dir.state_file}: {why}; join again")
            yield table

    def _attempt(self, table: CoherenceTable, key: str, write: bool) -> int | None:
        self._drop(table.take_inbox(self.id))
        if not write and key in self._copies:
            return self._copies[key]
        v = table.try_write(self.id, key) if write else table.try_read(self.id, key)
        if v is not None:
            self._copies[key] = v
        return v

    def _acquire(self, key: str, write: bool) -> int:
        deadline = time.monotonic() + self._timeout_s
        pause = self._dir.poll_interval_s
        while True:
            err = None
            with self._tx() as table:
                v = self._attempt(table, key, write)
                if v is not None:
                    return v
                if time.monotonic() >= deadline:
                    blockers = table.blockers(key)
                    table.cancel(self.id, key)
                    table.counts["timeouts"] += 1
                    err = self._timeout_error(key, "write" if write else "read", blockers)
            if err is not None:
                raise err
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.02)
