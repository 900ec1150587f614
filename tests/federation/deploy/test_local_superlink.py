"""federation.deploy.local_superlink's decisions, and port_owner, without starting a SuperLink."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from federation.deploy import local_superlink as link
from federation.deploy.flwr_sandbox import stop_pids
from federation.deploy.port_owner import describe, listeners
from federation.deploy.processes import start_time
from tests.federation.deploy.link_fakes import executable
from tests.hang_guard import HANG_GUARD_S


@pytest.fixture
def now(tmp_path, monkeypatch) -> link.Fingerprint:
    monkeypatch.setenv("FEDKV_NODE_DIR", str(tmp_path / "nodes"))
    monkeypatch.chdir(tmp_path)
    return link.Fingerprint.here(link.LinkSettings(executable=tmp_path / "bin" / "flower-superlink"))


@pytest.fixture
def listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_listeners_name_the_process_and_user_of_a_port(listening) -> None:
    found = listeners(listening)
    assert [(f.pid, f.uid) for f in found] == [(os.getpid(), os.getuid())]
    assert describe(found).startswith(f"pid {os.getpid()} of user ") and describe(found).endswith("(you)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert listeners(s.getsockname()[1]) == []  # bound, not listening


def test_no_record_means_new_free_ports(tmp_path, now) -> None:
    chosen = link.plan(tmp_path / "home", now, {})
    assert chosen.reuse is None and chosen.http_port != chosen.control_port
    assert listeners(chosen.http_port) == [] and chosen.http_port != link.FLOWER_DEFAULT_HTTP_PORT


def test_a_chosen_free_port_is_used(tmp_path, now) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chosen = link.plan(tmp_path / "home", now, {link.HTTP_PORT_ENV: str(port), link.CONTROL_PORT_ENV: "40001"})
    assert (chosen.reuse, chosen.http_port, chosen.control_port) == (None, port, 40001)


def test_a_chosen_taken_port_is_refused(tmp_path, now, listening) -> None:
    with pytest.raises(link.LocalSuperLinkError, match=f"127.0.0.1:{listening} .* is held by pid {os.getpid()}"):
        link.plan(tmp_path / "home", now, {link.HTTP_PORT_ENV: str(listening)})


@pytest.mark.parametrize("raw", ["http", "0", "70000"])
def test_a_port_variable_that_is_no_port_is_refused(tmp_path, now, raw) -> None:
    with pytest.raises(link.LocalSuperLinkError, match="is not a TCP port"):
        link.plan(tmp_path / "home", now, {link.HTTP_PORT_ENV: raw})


def test_a_record_of_a_gone_process_is_replaced(tmp_path, now) -> None:
    home = tmp_path / "home"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    link._write_record(home, link.Record(int(gone.stdout), 1, os.getuid(), 1234, 1235, now))
    assert (home / "local-superlink" / link.RECORD_NAME).stat().st_mode & 0o777 == 0o600
    chosen = link.plan(home, now, {})
    assert chosen.reuse is None and chosen.http_port != 1234


def test_a_recycled_pid_is_not_the_recorded_process(tmp_path, now) -> None:
    """Same pid, other start time: a different process (here: this test's own)."""
    record = link.Record(os.getpid(), (start_time(os.getpid()) or 0) + 1, os.getuid(), 1234, 1235, now)
    assert not link.running(record) and link.running(replace(record, start_time=start_time(os.getpid())))


def _sleeper(argv_tail: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *argv_tail])


def _wait_for_exec(pid: int, marker: str, limit_s: float = HANG_GUARD_S) -> None:
    """Until the child has exec'd its script (before that /proc shows the forked parent's
    command line: the check would fail on that, not on what it tests); bounded."""
    deadline = time.monotonic() + limit_s
    while marker not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
        assert time.monotonic() < deadline, f"pid {pid} never ran {marker}"
        time.sleep(0.01)


def test_a_live_record_is_reused_only_while_it_is_what_fedkv_started(tmp_path, now, listening) -> None:
    """The recorded process must carry fedkv's command line and hold its port."""
    home = tmp_path / "home"
    log = home / "local-superlink" / "superlink.log"
    exe = executable(Path(now.executable), "import time; time.sleep(600)")
    proc = subprocess.Popen([str(exe), "--port", str(listening), "--log-file", str(log)])
    try:
        _wait_for_exec(proc.pid, str(exe))
        record = link.Record(proc.pid, start_time(proc.pid) or 0, os.getuid(), listening, 1, now)
        link._write_record(home, record)
        # the port is held by this test process, not by the recorded one
        with pytest.raises(link.LocalSuperLinkError, match=f"is held by pid {os.getpid()}.*not by it"):
            link.plan(home, now, {})
        link._write_record(home, replace(record, http_port=listening + 1))
        with pytest.raises(link.LocalSuperLinkError, match="its command line is not the one fedkv started"):
            link.plan(home, now, {})
    finally:
        stop_pids([proc.pid], grace_s=2.0)
        proc.wait()


def test_fingerprint_differences_name_each_changed_setting(now) -> None:
    other = replace(now, cwd="/elsewhere", env={**now.env, "FEDKV_KEEP_RUNS": "0"})
    assert now.differences(other) == [f"cwd {now.cwd} (now /elsewhere)",
                                      "FEDKV_KEEP_RUNS=<unset> (now 0)"]
    assert now.differences(now) == []


def test_own_superlinks_are_found_by_their_exact_log_file(tmp_path) -> None:
    home = tmp_path / "home"
    procs = [_sleeper(["flower-superlink", "--log-file", str(home / "local-superlink" / "superlink.log")]),
             _sleeper(["flower-superlink", "--log-file", f"{tmp_path}/x{home}/local-superlink/superlink.log"]),
             _sleeper(["not-a-superlink", "--log-file", str(home / "local-superlink" / "superlink.log")])]
    try:
        assert link.own_superlink_pids(home) == [procs[0].pid]
    finally:
        stop_pids([p.pid for p in procs], grace_s=2.0)
        for p in procs:
            p.wait()


def test_only_local_connections_are_managed(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    assert link.local_address(None) == ":local:"  # Flower's default config, written on first use
    config = home / "config.toml"
    config.write_text(config.read_text() + '\n[superlink.remote]\naddress = "10.0.0.1:9093"\ninsecure = true\n'
                      '\n[superlink.mem]\naddress = ":local-in-memory:"\n')
    assert link.local_address("remote") is None
    assert link.local_address("mem") == ":local-in-memory:"
    assert link.local_address("no-such-connection") is None  # flwr run reports it itself
