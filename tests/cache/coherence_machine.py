"""The coherence protocol's hypothesis state machine and invariants, over any backend: agents
join, leave, crash, read, write, release, poll and sync, single-threaded and so deterministic
(ACKs are delivered when the machine makes an agent poll or request). A backend's test
subclasses ``CoherenceMachine`` with ``make_directory`` and ``crash``: the file backend
(``tests/cache/test_coherence_file.py``) and the in-process simulator
(``tests/experiments/test_coherence_sim.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache.coherence import AgentGoneError, Mode, State

KEYS = ("param", "kv/a1", "kv/b2")
VALID = (State.MODIFIED, State.EXCLUSIVE, State.SHARED)


def check_directory(d: Any, live_ids: set[int], mode: Mode) -> None:
    """The invariants every backend keeps after every step."""
    for key in KEYS:
        e = d.entry(key)
        assert set(e.holders) <= live_ids, (key, e)
        assert e.waiting_on <= live_ids, (key, e)
        if e.owner is not None:  # single writer ...
            assert set(e.holders) == {e.owner}, (key, e)
        if e.state is State.EXCLUSIVE:
            assert len(e.holders) == 1, (key, e)
        assert all(v == e.version for v in e.holders.values()), (key, e)  # holders are current
    s = d.stats()
    assert s["invalidations_sent"] == (s["acks_received"] + s["invalidations_discarded"]
                                       + s["invalidations_in_inboxes"]), s
    assert s["pendings_opened"] == s["pendings_resolved"] + s["pendings_open"], s


def check_local_copies(d: Any, agents: list, mode: Mode) -> None:
    """... or many readers, as the agents see it: in strong mode an M/E copy excludes every
    other valid copy (in relaxed mode stale S copies may linger until the batch arrives)."""
    for key in KEYS:
        states = {a.id: a.holds(key) for a in agents}
        version = d.entry(key).version
        for a in agents:
            if states[a.id] in VALID:
                assert a._copies[key] <= version
        exclusive = [i for i, s in states.items() if s in (State.MODIFIED, State.EXCLUSIVE)]
        assert len(exclusive) <= 1, (key, states)
        if exclusive and mode is Mode.STRONG:
            others = [s for i, s in states.items() if i != exclusive[0]]
            assert all(s in (State.INVALID, State.PENDING) for s in others), (key, states)


class CoherenceMachine(RuleBasedStateMachine):
    """Rules and invariants over any backend: a subclass makes the directory and crashes an agent."""

    mode = Mode.STRONG

    def __init__(self) -> None:
        super().__init__()
        self.d = self.make_directory()
        self.agents: list = []
        self.waiting: dict[int, tuple[str, bool]] = {}   # agent id -> (key, write) not granted
        self.completed: dict[str, int] = {}              # key -> version of the last completed write
        self.granted: dict[int, set[str]] = {}           # agent id -> keys granted since its last poll

    # backend hooks (each backend's machine defines them) ----------------------------------
    def make_directory(self) -> Any:
        raise NotImplementedError

    def crash(self, agent) -> None:
        raise NotImplementedError

    # helpers -----------------------------------------------------------------------------
    def _pick(self, i: int, idle: bool | None = None):
        pool = [a for a in self.agents if idle is None or (a.id in self.waiting) != idle]
        return pool[i % len(pool)] if pool else None

    def _granted(self, agent, key: str, write: bool, version: int) -> None:
        if write:
            assert version == self.completed.get(key, 0) + 1
            self.completed[key] = version
        elif self.mode is Mode.STRONG:
            assert version >= self.completed.get(key, 0), "stale read in strong mode"
        assert version <= self.d.entry(key).version

    def _attempt(self, agent, key: str, write: bool) -> None:
        v = agent.try_write(key) if write else agent.try_read(key)
        if v is None:
            self.waiting[agent.id] = (key, write)
            assert agent.holds(key) is State.PENDING or self.d.entry(key).pending_requester != agent.id
        else:
            self.waiting.pop(agent.id, None)
            self.granted.setdefault(agent.id, set()).add(key)
            self._granted(agent, key, write, v)

    def _owned(self, agent) -> list[str]:
        return [k for k in KEYS if self.d.entry(k).owner == agent.id]

    # rules -------------------------------------------------------------------------------
    @precondition(lambda self: len(self.agents) < 4)
    @rule(name=st.sampled_from(["trainer", "server", "prefetch"]))
    def join(self, name: str) -> None:
        self.agents.append(self.d.join(name))

    @precondition(lambda self: any(a.id not in self.waiting for a in self.agents))
    @rule(i=st.integers(0, 7), key=st.sampled_from(KEYS), write=st.booleans())
    def request(self, i: int, key: str, write: bool) -> None:
        self._attempt(self._pick(i, idle=True), key, write)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 7))
    def retry(self, i: int) -> None:
        agent = self._pick(i, idle=False)
        self._attempt(agent, *self.waiting[agent.id])

    @precondition(lambda self: self.agents)
    @rule(i=st.integers(0, 7))
    def release(self, i: int) -> None:
        agent = self._pick(i)
        for key in self._owned(agent)[:1]:
            agent.release(key)
            assert agent.holds(key) in (State.SHARED, State.INVALID)

    @precondition(lambda self: self.agents)
    @rule(i=st.integers(0, 7))
    def poll(self, i: int) -> None:
        agent = self._pick(i)
        regained = self.granted.pop(agent.id, set())  # dropped inside a request, then re-read
        for key in agent.poll():
            assert agent.holds(key) in (State.INVALID, State.PENDING) or key in regained

    @precondition(lambda self: self.agents)
    @rule(i=st.integers(0, 7))
    def sync(self, i: int) -> None:
        self._pick(i).sync()

    @precondition(lambda self: self.agents)
    @rule(i=st.integers(0, 7), crash=st.booleans())
    def leave(self, i: int, crash: bool) -> None:
        agent = self._pick(i)
        self.agents.remove(agent)
        self.waiting.pop(agent.id, None)
        self.crash(agent) if crash else agent.leave()
        with pytest.raises(AgentGoneError):
            agent.poll()

    # invariants --------------------------------------------------------------------------
    @invariant()
    def directory_consistent(self) -> None:
        check_directory(self.d, {a.id for a in self.agents}, self.mode)

    @invariant()
    def local_copies_consistent(self) -> None:
        check_local_copies(self.d, self.agents, self.mode)

    def teardown(self) -> None:
        """Every Pending resolves once its agents poll and the owners release: drain."""
        for _ in range(2 * len(self.agents) + 2):
            for a in self.agents:
                a.sync()
            for a in self.agents:
                a.poll()
                for key in self._owned(a):
                    a.release(key)
            for a in [a for a in self.agents if a.id in self.waiting]:
                self._attempt(a, *self.waiting[a.id])
        assert not self.waiting, f"unresolved requests {self.waiting}"
        assert self.d.stats()["pendings_open"] == 0
        for a in self.agents:  # after sync + poll no copy is stale, in either mode
            a.poll()
            for key in KEYS:
                if a.holds(key) in VALID:
                    assert a.try_read(key) == self.d.entry(key).version
        check_directory(self.d, {a.id for a in self.agents}, self.mode)
