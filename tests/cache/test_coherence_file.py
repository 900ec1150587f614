"""cache.coherence_file: the protocol state machine's rules and invariants over the file
backend (crash = the agent's pid dies, reaped by the next touch), a corrupted or truncated
directory file, real processes that crash, and a trainer process writing parameters back while
a serving process answers tokens from its loaded copy."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import settings

from cache.coherence import AgentGoneError, CoherenceConfigError, CoherenceTimeout, Mode, State
from cache.coherence_file import STATE_FILE, CorruptDirectoryError, FileDirectory, pid_alive
from tests.cache.coherence_machine import CoherenceMachine, check_directory, check_local_copies
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@functools.lru_cache(maxsize=1)
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class FileMachine(CoherenceMachine):
    """The same rules and invariants; ``crash`` gives the agent a dead pid in the file."""

    def make_directory(self) -> FileDirectory:
        self.tmp = tempfile.mkdtemp(prefix="coherence-")
        return FileDirectory(self.tmp, self.mode, batch=2, timeout_s=1.0)

    def crash(self, agent) -> None:
        with self.d.transaction() as (table, _):
            table.agents[agent.id].pid, table.agents[agent.id].start = dead_pid(), 0

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


class RelaxedFileMachine(FileMachine):
    mode = Mode.RELAXED


for _machine in (FileMachine, RelaxedFileMachine):
    _machine.TestCase.settings = settings(max_examples=15, stateful_step_count=30, deadline=None)
TestStrongFileMachine = FileMachine.TestCase
TestRelaxedFileMachine = RelaxedFileMachine.TestCase


def test_deterministic_script_across_two_opened_directories(tmp_path):
    """Two FileDirectory objects on one path (as two processes would): state is shared."""
    d1, d2 = FileDirectory(tmp_path, timeout_s=1.0), FileDirectory(tmp_path, timeout_s=1.0)
    t, s = d1.join("trainer"), d2.join("server")
    assert s.acquire_read("param") == 0
    assert t.try_write("param") is None and s.holds("param") is State.INVALID
    assert s.poll() == ["param"] and t.acquire_write("param") == 1
    check_local_copies(d1, [t, s], Mode.STRONG)
    t.release("param")
    assert s.acquire_read("param") == 1 and d2.entry("param").holders == {t.id: 1, s.id: 1}
    check_directory(d2, {t.id, s.id}, Mode.STRONG)
    s.leave()
    assert d1.agents() == {t.id: "trainer"} and d1.stats()["leaves"] == 1


def test_opening_with_another_mode_is_an_error(tmp_path):
    FileDirectory(tmp_path, Mode.STRONG)
    with pytest.raises(CoherenceConfigError, match="mode 2, batch 16 directory; opened with mode 1"):
        FileDirectory(tmp_path, Mode.RELAXED)
    with pytest.raises(CoherenceConfigError, match="poll_interval_s"):
        FileDirectory(tmp_path, poll_interval_s=0)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_shape", "binary"])
def test_a_corrupt_directory_file_is_a_clear_error_and_left_untouched(tmp_path, damage):
    d = FileDirectory(tmp_path)
    a = d.join("a")
    a.acquire_read("param")
    path = tmp_path / STATE_FILE
    good = path.read_bytes()
    bad = {"garbage": b"not json", "truncated": good[: len(good) // 2],
           "wrong_shape": json.dumps({"format": 1, "epoch": "x"}).encode(),
           "binary": b"\xff\xfe\x00"}[damage]
    path.write_bytes(bad)
    for call in (lambda: a.acquire_read("param"), d.stats, lambda: FileDirectory(tmp_path)):
        with pytest.raises(CorruptDirectoryError, match="left untouched.*reset"):
            call()
    assert path.read_bytes() == bad  # nothing overwritten
    moved = FileDirectory.reset(tmp_path)
    assert moved is not None and moved.read_bytes() == bad and not path.exists()
    with pytest.raises(AgentGoneError, match="directory was reset"):
        a.poll()
    b = FileDirectory(tmp_path).join("b")  # a new epoch: works again
    assert b.acquire_read("param") == 0 and b.id == 1
    (tmp_path / "empty").mkdir(mode=0o700)
    assert FileDirectory.reset(tmp_path / "empty") is None


def test_a_forked_child_cannot_act_as_its_parents_agent(tmp_path):
    agent = FileDirectory(tmp_path).join("parent")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the agent refuses to act here
        try:
            agent.poll()
        except AgentGoneError:
            os._exit(0)
        except BaseException:
            os._exit(2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert agent.poll() == []  # the parent's agent still works


def test_pid_liveness():
    assert pid_alive(os.getpid()) and not pid_alive(dead_pid())
    assert not pid_alive(os.getpid(), start=1)  # same pid, another start time: a reused pid


def _spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # by its pid
        p.wait(10)


HOLDER = textwrap.dedent("""
    import sys, time
    from cache.coherence_file import FileDirectory
    agent = FileDirectory(sys.argv[1], timeout_s=30).join("holder")
    agent.acquire_read("param")
    print("ready", flush=True)
    time.sleep(60)   # never polls: only its death (reaped) lets a strong write through
""")


def test_a_strong_write_completes_once_a_silent_holder_process_dies(tmp_path):
    d = FileDirectory(tmp_path, Mode.STRONG, timeout_s=10.0)
    trainer = d.join("trainer")
    proc = _spawn(HOLDER, str(tmp_path))
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert trainer.try_write("param") is None  # waits on the holder's ACK
        proc.kill()  # not waited for: a zombie until _stop, and a zombie counts as dead
        assert trainer.acquire_write("param") == 1
        s = d.stats()
        assert s["crashes"] == 1 and s["pendings_open"] == 0 and s["agents"] == 1
    finally:
        _stop([proc])


def test_a_silent_live_holder_times_the_writer_out(tmp_path):
    d = FileDirectory(tmp_path, Mode.STRONG, timeout_s=0.3)
    trainer, silent = d.join("trainer"), d.join("silent")  # alive (this process), never polls
    silent.acquire_read("param")
    with pytest.raises(CoherenceTimeout, match=rf"write of 'param'.*\[{silent.id}\]"):
        trainer.acquire_write("param")
    assert d.entry("param").pending_requester is None  # withdrawn: nothing waits on it
    assert d.stats()["timeouts"] == 1


WORKER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    from cache.coherence import Mode
    from cache.coherence_file import FileDirectory

    role, path, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    d = FileDirectory(path, Mode.STRONG, timeout_s=20)
    agent = d.join(role)

    def wait_for(name):
        deadline = time.monotonic() + 30
        while not (path / name).exists():
            assert time.monotonic() < deadline, name
            time.sleep(0.002)

    if role == "trainer":   # writes the parameters back n times
        wait_for("server.ready")
        log = []
        for _ in range(n):
            v = agent.acquire_write("param")
            done = time.monotonic()           # the strong write completed (every ACK in)
            np.save(path / "param.tmp.npy", np.full(64, float(v)))
            os.replace(path / "param.tmp.npy", path / "param.npy")
            agent.release("param")
            log.append([v, done])
            time.sleep(0.01)
        (path / "trainer.json").write_text(json.dumps({"writes": log, "stats": d.stats()}))
    else:                   # serves tokens from its loaded copy, polling before each
        def load():
            v = agent.acquire_read("param")
            return v, np.load(path / "param.npy")
        version, params = load()
        (path / "server.ready").touch()
        tokens, reloads = [], 0
        while True:
            checked = time.monotonic()
            if "param" in agent.poll():       # invalidated: drop K/V, reload parameters
                version, params = load()
                reloads += 1
            tokens.append([version, checked, float(params[0])])   # token tagged with its version
            if (path / "trainer.json").exists() and version == n:
                break
            time.sleep(0.001)
        (path / "server.json").write_text(json.dumps({"tokens": tokens, "reloads": reloads}))
    agent.leave()
""")


def test_trainer_process_writes_back_while_server_process_serves(tmp_path):
    """No token computed with an old version is returned after the server could have seen the
    new one: every write newer than a token's version completed after that token's check."""
    import numpy as np

    n = 15
    np.save(tmp_path / "param.npy", np.zeros(64))
    FileDirectory(tmp_path, Mode.STRONG, timeout_s=20)
    procs = [_spawn(WORKER, role, str(tmp_path), str(n)) for role in ("server", "trainer")]
    try:
        for p in procs:
            _, err = p.communicate(timeout=HANG_GUARD_S)
            assert p.returncode == 0, err[-3000:]
    finally:
        _stop(procs)
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    server = json.loads((tmp_path / "server.json").read_text())
    writes = trainer["writes"]
    assert [v for v, _ in writes] == list(range(1, n + 1))  # every strong write completed
    done = dict((v, t) for v, t in writes)
    tokens = server["tokens"]
    for version, checked, value in tokens:
        assert value == version, "a token computed from parameters of another version"
        newer = [done[w] for w in range(version + 1, n + 1)]
        assert all(t > checked for t in newer), f"token of v{version} after a newer write completed"
    assert [t[0] for t in tokens] == sorted(t[0] for t in tokens) and tokens[-1][0] == n
    s = trainer["stats"]
    assert s["writes"] == n and s["timeouts"] == 0 and s["pendings_open"] == 0
    assert s["pendings_opened"] >= 1 and s["invalidations_sent"] >= 1  # the trainer did wait
    assert s["invalidations_sent"] == (s["acks_received"] + s["invalidations_discarded"]
                                       + s["invalidations_in_inboxes"])  # no lost ACK
    assert server["reloads"] >= 1


def test_a_polling_thread_acks_for_an_idle_file_agent(tmp_path):
    d = FileDirectory(tmp_path, Mode.STRONG, timeout_s=10.0)
    trainer, server = d.join("trainer"), d.join("server")
    server.acquire_read("param")
    seen: list[list[str]] = []
    poller = server.start_polling(0.002, on_invalidate=seen.append)
    try:
        assert trainer.acquire_write("param") == 1
    finally:
        poller.stop()
    assert seen == [["param"]] and d.stats()["acks_received"] == 1
