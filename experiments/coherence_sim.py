"""The in-process coherence simulator: a thread-safe ``Directory`` and its ``Agent`` over the
product's protocol table (``cache.coherence.CoherenceTable``), for agents that are threads of
one process. Only the benchmark ``experiments/coherence.py`` (and its tests) use it; the
product's backend is ``cache.coherence_file`` (processes sharing a node's cache directory).

    d = Directory(Mode.STRONG, batch=16, timeout_s=10.0)
    trainer, server = d.join("trainer"), d.join("server")
    v = server.acquire_read("param")      # S (E if alone); version it may read
    v = trainer.acquire_write("param")    # M; strong: after the server ACKed (server polls)
    trainer.release("param")              # M -> S: written back, readers may share again
    server.poll()                         # -> ["param"]: dropped and ACKed
    d.crash(server); d.stats(); d.entry("param")

The protocol's semantics (modes, Pending, ACKs, timeouts) are ``cache/coherence.py``'s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from cache.coherence import (
    AgentBase,
    CoherenceConfigError,
    CoherenceTable,
    EntryView,
    Mode,
    State,
    check_settings,
)

__all__ = ["Agent", "Directory"]


class Agent(AgentBase):
    """An agent of an in-process ``Directory`` (use it from one thread, plus its ``Poller``).
    A read of a copy it holds, with an empty inbox, takes no lock."""

    def __init__(self, directory: "Directory", aid: int, name: str) -> None:
        super().__init__(directory.timeout_s)
        self.id = aid
        self.name = name
        self._dir = directory
        self._inbox = directory._table.agents[aid].inbox  # read without the lock (fast path)

    def acquire_read(self, key: str) -> int:
        if not self._inbox and not self._gone:
            v = self._copies.get(key)
            if v is not None:
                return v
        return self._acquire(key, write=False)

    def acquire_write(self, key: str) -> int:
        return self._acquire(key, write=True)

    def try_read(self, key: str) -> int | None:
        with self._dir._cond:
            return self._attempt(key, write=False)

    def try_write(self, key: str) -> int | None:
        with self._dir._cond:
            return self._attempt(key, write=True)

    def release(self, key: str) -> None:
        with self._dir._cond:
            self._check()
            if self._dir._table.release(self.id, key):
                self._copies.pop(key, None)
            self._dir._cond.notify_all()

    def poll(self) -> list[str]:
        """ACK the inbox; the keys whose copies were dropped since the last poll (including
        those an ``acquire_*`` dropped on the way, even if read again since)."""
        with self._dir._cond:
            self._check()
            self._take_inbox()
            return self._take_dropped()

    def holds(self, key: str) -> State:
        with self._dir._cond:
            self._check()
            return self._dir._table.holds(self.id, key, self._copies.get(key))

    def sync(self) -> None:
        with self._dir._cond:
            self._check()
            if self._dir._table.flush(self.id):
                self._dir._cond.notify_all()

    def leave(self) -> None:
        self._dir._remove(self, crashed=False)

    def _check(self) -> None:
        if self._gone:
            raise self._gone_error()

    def _take_inbox(self) -> None:
        if self._inbox:
            self._drop(self._dir._table.take_inbox(self.id))
            self._dir._cond.notify_all()

    def _attempt(self, key: str, write: bool) -> int | None:
        """Under the lock: ACK the inbox, then a local hit or one directory request."""
        self._check()
        self._take_inbox()
        table = self._dir._table
        if not write:
            v = self._copies.get(key)
            if v is not None:
                return v
            v = table.try_read(self.id, key)
        else:
            delivered = table.counts["invalidations_sent"]
            v = table.try_write(self.id, key)
            if table.counts["invalidations_sent"] != delivered:
                self._dir._cond.notify_all()  # holders blocked in acquire_* must ACK
        if v is not None:
            self._copies[key] = v
        return v

    def _acquire(self, key: str, write: bool) -> int:
        cond = self._dir._cond
        deadline = time.monotonic() + self._timeout_s
        with cond:
            while True:
                v = self._attempt(key, write)
                if v is not None:
                    return v
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    blockers = self._dir._table.blockers(key)
                    self._dir._table.cancel(self.id, key)
                    self._dir._table.counts["timeouts"] += 1
                    cond.notify_all()
                    raise self._timeout_error(key, "write" if write else "read", blockers)
                cond.wait(remaining)


class Directory:
    """The in-process, thread-safe directory: one lock (a Condition) around the table; a
    blocked ``acquire_*`` waits on it and is woken by ACKs, releases, leaves and deliveries."""

    def __init__(self, mode: Mode | int = Mode.STRONG, batch: int = 16, timeout_s: float = 10.0) -> None:
        self.mode = check_settings(mode, batch, timeout_s)
        self.batch = batch
        self.timeout_s = float(timeout_s)
        self._table = CoherenceTable(self.mode, batch)
        self._cond = threading.Condition(threading.Lock())

    def join(self, name: str) -> Agent:
        if not isinstance(name, str) or not name:
            raise CoherenceConfigError(f"an agent name is a non-empty str, not {name!r}")
        with self._cond:
            return Agent(self, self._table.add_agent(name), name)

    def crash(self, agent: Agent) -> None:
        """What a crashed agent leaves behind, without its cooperation (tests, supervisors)."""
        self._remove(agent, crashed=True)

    def stats(self) -> dict[str, Any]:
        """Counters (see ``STAT_KEYS``) plus pendings_open, invalidations_in_inboxes, agents,
        entries, mode, batch. Balance: sent == acks + discarded + in inboxes."""
        with self._cond:
            return self._table.stats()

    def entry(self, key: str) -> EntryView:
        with self._cond:
            return self._table.view(key)

    def agents(self) -> dict[int, str]:
        with self._cond:
            return {aid: rec.name for aid, rec in self._table.agents.items()}

    def _remove(self, agent: Agent, crashed: bool) -> None:
        with self._cond:
            if agent._gone:
                raise agent._gone_error()
            self._table.remove_agent(agent.id, crashed=crashed)
            agent._gone = True
            agent._copies.clear()
            self._cond.notify_all()
