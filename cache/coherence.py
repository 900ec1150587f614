"""Directory-based MESI coherence over cache entries shared by several agents (the article's
``cache_coherence.c``): the protocol's table, states, modes, errors and agent base. The backend
the product runs is ``cache.coherence_file`` (processes sharing a node's cache directory); an
in-process, thread-safe backend over the same table, used only by the benchmark
``experiments/coherence.py``, is ``experiments/coherence_sim.py``.

An *entry* is any string key: a block's content hash (hex), a named tensor (``param/w1``) or a
namespace (``param``). Per entry the directory records its state (M/E/S/I), the holders'
agent ids with the version each holds (the agent-id tags), the entry version, and at most one
*Pending* request: a write waiting for invalidation ACKs, or a read/write waiting for the
modified owner to ``release`` (the downgrade). Invalidations are delivered to each holder's
inbox and ACKed when that agent next calls ``poll`` (or any ``acquire_*``, which polls first).

Modes (the engine's ``coherence_protocol`` tunable):

* ``Mode.STRONG`` (2): ``acquire_write`` returns only after every other holder has dropped its
  copy and ACKed, so no read returns a version older than the last completed write.
* ``Mode.RELAXED`` (1): a writer does not wait; its invalidations are queued and delivered in
  batches (every ``batch`` writes of that agent, on ``sync()``, or when it leaves), so readers
  may read a stale copy until they process the batch.

An agent's API (``AgentBase``; ``cache.coherence_file.FileDirectory`` makes them)::

    d = FileDirectory(cache_dir, Mode.STRONG, batch=16, timeout_s=10.0)
    trainer, server = d.join("trainer"), d.join("server")
    v = server.acquire_read("param")      # S (E if alone); version it may read
    v = trainer.acquire_write("param")    # M; strong: after the server ACKed (server polls)
    trainer.release("param")              # M -> S: written back, readers may share again
    server.poll()                         # -> ["param"]: dropped and ACKed
    server.holds("param")                 # State.INVALID until it reads again
    p = server.start_polling(0.01, on_invalidate=lambda keys: ...); ...; p.stop()
    d.stats(); d.entry("param")

``try_read``/``try_write`` are the non-blocking halves (``None``: not granted yet, a Pending is
open); ``acquire_*`` loop on them until granted or raise ``CoherenceTimeout`` (the Pending is
withdrawn first, so nothing waits on it). An agent that leaves or crashes drops its holdings,
its queued invalidations are delivered, and every Pending waiting on it resolves.

Serving under model-version coherence: before each token call ``poll()``; if it returns
``param`` (or ``holds("param")`` is INVALID) drop the K/V and ``acquire_read("param")`` again.
In strong mode a new version cannot complete without this agent's ACK, and the ACK is sent
only by its own ``poll``, so a token computed after a poll that returned nothing is never older
than a completed write. With a ``start_polling`` thread the ACK can come from that thread:
then check ``holds(key)`` after computing the token, before returning it.

Holding M is a lock: an agent holding M on one key and waiting for another can deadlock with
an agent doing the reverse; both then get ``CoherenceTimeout``.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cache.errors import CacheError

__all__ = [
    "AgentBase",
    "AgentGoneError",
    "CoherenceConfigError",
    "CoherenceError",
    "CoherenceTable",
    "CoherenceTimeout",
    "Entry",
    "EntryView",
    "Mode",
    "NotOwnerError",
    "Pending",
    "Poller",
    "State",
]


class State(enum.Enum):
    MODIFIED = "M"
    EXCLUSIVE = "E"
    SHARED = "S"
    INVALID = "I"
    PENDING = "P"


class Mode(enum.IntEnum):
    RELAXED = 1
    STRONG = 2


class CoherenceError(CacheError):
    """Base class of the coherence protocol's errors."""


class CoherenceTimeout(CoherenceError, TimeoutError):
    """A request was not granted within the directory's ``timeout_s`` (its Pending withdrawn)."""


class AgentGoneError(CoherenceError):
    """The agent left, crashed or was reaped (or its directory was reset): join again."""


class NotOwnerError(CoherenceError):
    """``release`` of an entry the agent does not hold in M."""


class CoherenceConfigError(CoherenceError, ValueError):
    """A bad mode, batch, timeout or key."""


# --------------------------------------------------------------------------- protocol core


@dataclass(slots=True)
class Pending:
    """A request that waits: on ``waiting_on``'s ACKs (write) or the M owner's release."""

    requester: int
    kind: str            # "read" | "write"
    version: int         # the version a write will create; the current one for a read
    waiting_on: set[int]


@dataclass(slots=True)
class Entry:
    """Directory record of one key; ``holders`` maps agent id -> version of its copy."""

    version: int = 0
    state: State = State.INVALID
    holders: dict[int, int] = field(default_factory=dict)
    owner: int | None = None
    pending: Pending | None = None


@dataclass(frozen=True)
class EntryView:
    """A snapshot of an entry for inspection and tests."""

    state: State
    version: int
    holders: dict[int, int]
    owner: int | None
    pending_requester: int | None
    waiting_on: frozenset[int]


@dataclass(slots=True)
class AgentRecord:
    """What the directory keeps per agent: its inbox of (key, version) invalidations and, in
    relaxed mode, the invalidations its writes queued ((target, key, version))."""

    name: str
    pid: int = 0
    start: int = 0                 # process start time (clock ticks), against pid reuse
    inbox: deque = field(default_factory=deque)
    queue: list = field(default_factory=list)
    writes: int = 0


# reads/writes: directory grants (local hits are not counted: they take no lock);
# invalidations_sent: delivered to an inbox; _queued: relaxed, waiting for a batch; acks_received:
# taken from an inbox by its agent; _discarded: in the inbox of an agent that left or crashed;
# _unsent: queued for an agent that left before the batch; pendings_*: Pending records.
STAT_KEYS = ("reads", "writes", "invalidations_sent", "invalidations_queued", "acks_received",
             "invalidations_discarded", "invalidations_unsent", "batches_sent", "pendings_opened",
             "pendings_resolved", "timeouts", "joins", "leaves", "crashes")


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise CoherenceConfigError(f"an entry key is a non-empty str, not {key!r}")


def check_settings(mode: Mode | int, batch: int, timeout_s: float) -> Mode:
    """Validated mode; ``batch`` >= 1 and ``timeout_s`` > 0."""
    try:
        mode = Mode(mode)
    except ValueError:
        raise CoherenceConfigError(
            f"coherence mode must be 1 (relaxed) or 2 (strong), not {mode!r}") from None
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CoherenceConfigError(f"batch must be an int >= 1, not {batch!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise CoherenceConfigError(f"timeout_s must be > 0, not {timeout_s!r}")
    return mode


class CoherenceTable:
    """The protocol's state and transitions, with no locking and no waiting: ``FileDirectory``
    calls it under ``flock`` (state in a file), the in-process simulator
    (``experiments/coherence_sim.py``) under a lock."""

    def __init__(self, mode: Mode, batch: int) -> None:
        self.mode = mode
        self.batch = batch
        self.entries: dict[str, Entry] = {}
        self.agents: dict[int, AgentRecord] = {}
        self.next_id = 1
        self.counts: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)

    # agents ------------------------------------------------------------------------------
    def add_agent(self, name: str, pid: int = 0, start: int = 0) -> int:
        aid = self.next_id
        self.next_id += 1
        self.agents[aid] = AgentRecord(name=name, pid=pid, start=start)
        self.counts["joins"] += 1
        return aid

    def remove_agent(self, aid: int, crashed: bool = False) -> None:
        """Leave or crash: queued invalidations delivered, inbox discarded, holdings dropped,
        its own Pendings withdrawn and every Pending waiting on it resolved."""
        self.flush(aid)
        rec = self.agents.pop(aid)
        self.counts["invalidations_discarded"] += len(rec.inbox)
        self.counts["crashes" if crashed else "leaves"] += 1
        for e in self.entries.values():
            if e.pending is not None:
                if e.pending.requester == aid:
                    self._resolve(e)
                else:
                    e.pending.waiting_on.discard(aid)
            if e.holders.pop(aid, None) is not None or e.owner == aid:
                if e.owner == aid:
                    e.owner = None
                e.state = State.INVALID if not e.holders else State.SHARED

    # requests ----------------------------------------------------------------------------
    def try_read(self, aid: int, key: str) -> int | None:
        """Grant S (E if no other holder) and return the version, or ``None`` (Pending)."""
        e = self._entry(key)
        if e.owner == aid or aid in e.holders:
            return e.version
        if not self._pending_cleared(e, aid):
            return None
        if e.owner is not None:
            self._open(e, aid, "read", e.version, {e.owner})
            return None
        if e.holders:
            e.state = State.SHARED
        else:
            e.state = State.EXCLUSIVE
        e.holders[aid] = e.version
        self.counts["reads"] += 1
        return e.version

    def try_write(self, aid: int, key: str) -> int | None:
        """Grant M and return the new version, or ``None`` while others must ACK (strong) or
        the M owner must release first."""
        e = self._entry(key)
        if e.owner == aid:
            return self._grant_write(e, aid, key)
        if not self._pending_cleared(e, aid):
            return None
        if e.owner is not None:
            self._open(e, aid, "write", e.version + 1, {e.owner})
            return None
        others = [a for a in e.holders if a != aid]
        if others and self.mode is Mode.STRONG:
            for a in others:
                self._deliver(a, key, e.version + 1)
            self._open(e, aid, "write", e.version + 1, set(others))
            return None
        for a in others:
            self.agents[aid].queue.append((a, key, e.version + 1))
            self.counts["invalidations_queued"] += 1
        return self._grant_write(e, aid, key)

    def release(self, aid: int, key: str) -> bool:
        """M -> S. True when a write by another agent waits: the releaser's copy is then
        invalidated at once (counted as sent and ACKed) and it must drop it."""
        e = self.entries.get(key)
        if e is None or e.owner != aid:
            state = "no entry" if e is None else f"state {e.state.value}, owner {e.owner}"
            raise NotOwnerError(f"agent {aid} releases {key!r} it does not hold in M ({state})")
        e.owner = None
        e.state = State.SHARED
        p = e.pending
        if p is None or aid not in p.waiting_on:
            return False
        p.waiting_on.discard(aid)
        if p.kind == "read":
            return False
        del e.holders[aid]
        e.state = State.INVALID
        self.counts["invalidations_sent"] += 1
        self.counts["acks_received"] += 1
        return True

    def cancel(self, aid: int, key: str) -> None:
        """Withdraw ``aid``'s Pending on ``key`` (after a timeout); delivered invalidations stay
        delivered (their holders drop a copy that was still current: safe, only a miss)."""
        e = self.entries.get(key)
        if e is not None and e.pending is not None and e.pending.requester == aid:
            self._resolve(e)

    def take_inbox(self, aid: int) -> list[tuple[str, int]]:
        """Remove and ACK every invalidation in ``aid``'s inbox; the caller drops its copies
        older than each message's version."""
        rec = self.agents[aid]
        msgs = list(rec.inbox)
        rec.inbox.clear()
        for key, version in msgs:
            self.counts["acks_received"] += 1
            e = self.entries.get(key)
            if e is None:
                continue
            if e.holders.get(aid, version) < version:
                del e.holders[aid]
                if not e.holders and e.owner is None:
                    e.state = State.INVALID
            p = e.pending
            if p is not None and p.kind == "write" and p.version == version:
                p.waiting_on.discard(aid)
        return msgs

    def flush(self, aid: int) -> int:
        """Deliver ``aid``'s queued (relaxed) invalidations as one batch; returns how many."""
        rec = self.agents[aid]
        queued, rec.queue = rec.queue, []
        for target, key, version in queued:
            if target in self.agents:
                self._deliver(target, key, version)
            else:
                self.counts["invalidations_unsent"] += 1  # its target left: nothing to invalidate
        if queued:
            self.counts["batches_sent"] += 1
        return len(queued)

    def holds(self, aid: int, key: str, local_version: int | None) -> State:
        """The state of ``aid``'s copy: an undelivered-to-the-agent invalidation in its inbox
        makes it INVALID already; a relaxed stale copy the directory no longer tracks is S."""
        e = self.entries.get(key)
        if e is not None and e.pending is not None and e.pending.requester == aid:
            return State.PENDING
        if local_version is None:
            return State.INVALID
        if any(k == key and v > local_version for k, v in self.agents[aid].inbox):
            return State.INVALID
        if e is not None and e.owner == aid:
            return State.MODIFIED
        if e is not None and aid in e.holders:
            return e.state
        return State.SHARED

    def blockers(self, key: str) -> list[int]:
        e = self.entries.get(key)
        if e is None or e.pending is None:
            return []
        return sorted(e.pending.waiting_on) or ([e.owner] if e.owner is not None else [])

    def view(self, key: str) -> EntryView:
        e = self.entries.get(key) or Entry()
        p = e.pending
        return EntryView(State.PENDING if p else e.state, e.version, dict(e.holders), e.owner,
                         p.requester if p else None, frozenset(p.waiting_on) if p else frozenset())

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        out["pendings_open"] = sum(e.pending is not None for e in self.entries.values())
        out["invalidations_in_inboxes"] = sum(len(r.inbox) for r in self.agents.values())
        out["agents"] = len(self.agents)
        out["entries"] = len(self.entries)
        out["mode"] = int(self.mode)
        out["batch"] = self.batch
        return out

    # internals ---------------------------------------------------------------------------
    def _entry(self, key: str) -> Entry:
        e = self.entries.get(key)
        if e is None:
            check_key(key)
            e = self.entries[key] = Entry()
        return e

    def _pending_cleared(self, e: Entry, aid: int) -> bool:
        """False while another agent's Pending or this agent's unresolved one blocks ``e``."""
        p = e.pending
        if p is None:
            return True
        if p.requester != aid or p.waiting_on:
            return False
        self._resolve(e)
        return True

    def _open(self, e: Entry, aid: int, kind: str, version: int, waiting_on: set[int]) -> None:
        e.pending = Pending(aid, kind, version, waiting_on)
        self.counts["pendings_opened"] += 1

    def _resolve(self, e: Entry) -> None:
        e.pending = None
        self.counts["pendings_resolved"] += 1

    def _deliver(self, target: int, key: str, version: int) -> None:
        self.agents[target].inbox.append((key, version))
        self.counts["invalidations_sent"] += 1

    def _grant_write(self, e: Entry, aid: int, key: str) -> int:
        e.version += 1
        e.owner = aid
        e.state = State.MODIFIED
        e.holders = {aid: e.version}
        rec = self.agents[aid]
        rec.writes += 1
        self.counts["writes"] += 1
        if self.mode is Mode.RELAXED and rec.writes % self.batch == 0:
            self.flush(aid)
        return e.version


# --------------------------------------------------------------------------- agents


class AgentBase(ABC):
    """What both backends' agents share: blocking acquires over the non-blocking ``try_*``, and
    the local copies (key -> version) an agent reads without asking the directory."""

    id: int
    name: str

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._copies: dict[str, int] = {}
        self._dropped: list[str] = []
        self._gone = False

    @abstractmethod
    def try_read(self, key: str) -> int | None: ...
    @abstractmethod
    def try_write(self, key: str) -> int | None: ...
    @abstractmethod
    def release(self, key: str) -> None: ...
    @abstractmethod
    def poll(self) -> list[str]: ...
    @abstractmethod
    def holds(self, key: str) -> State: ...
    @abstractmethod
    def sync(self) -> None: ...
    @abstractmethod
    def leave(self) -> None: ...
    @abstractmethod
    def acquire_read(self, key: str) -> int: ...
    @abstractmethod
    def acquire_write(self, key: str) -> int: ...

    @property
    def gone(self) -> bool:
        return self._gone

    def start_polling(self, interval_s: float = 0.01,
                      on_invalidate: Callable[[list[str]], None] | None = None) -> "Poller":
        """A daemon thread calling ``poll()`` every ``interval_s`` and ``on_invalidate(keys)``
        when keys were dropped, so an idle agent never holds a strong writer up."""
        return Poller(self, interval_s, on_invalidate)

    def _drop(self, msgs: Iterable[tuple[str, int]]) -> None:
        """Drop local copies older than each invalidation; remember them for ``poll``."""
        for key, version in msgs:
            have = self._copies.get(key)
            if have is not None and have < version:
                del self._copies[key]
                self._dropped.append(key)

    def _take_dropped(self) -> list[str]:
        out, self._dropped = self._dropped, []
        return out

    def _gone_error(self) -> AgentGoneError:
        return AgentGoneError(f"agent {self.id} ({self.name}) has left the directory")

    def _timeout_error(self, key: str, kind: str, blockers: list[int]) -> CoherenceTimeout:
        return CoherenceTimeout(
            f"agent {self.id} ({self.name}): {kind} of {key!r} not granted within "
            f"{self._timeout_s} s; waiting on agent(s) {blockers} (Pending withdrawn)")


class Poller:
    """A stoppable daemon thread that polls an agent; a callback error stops it and is raised
    again by ``stop()``."""

    def __init__(self, agent: AgentBase, interval_s: float,
                 on_invalidate: Callable[[list[str]], None] | None) -> None:
        if not interval_s > 0:
            raise CoherenceConfigError(f"interval_s must be > 0, not {interval_s!r}")
        self.agent = agent
        self.interval_s = interval_s
        self.on_invalidate = on_invalidate
        self.error: BaseException | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"poll-{agent.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                keys = self.agent.poll()
                self.polls += 1
                if keys and self.on_invalidate is not None:
                    self.on_invalidate(keys)
                self._stop.wait(self.interval_s)
        except AgentGoneError:
            return
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error
