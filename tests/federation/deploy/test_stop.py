"""python -m federation.deploy.stop: stops this FLWR_HOME's SuperLink and its descendants, by pid, only.

The "SuperLink" here is a harmless dummy: a sleeping Python process whose command line carries
what ``flwr run`` gives a real one (``flower-superlink ... --log-file $FLWR_HOME/local-superlink/...``),
with one sleeping child standing for superexec/flwr-simulation/Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation.deploy.flwr_sandbox import alive, descendants, stop_pids
from tests.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[3]
DUMMY = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "time.sleep(600)\n"
)


def _fake_superlink(flwr_home: Path) -> subprocess.Popen:
    log_file = flwr_home / "local-superlink" / "superlink.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", DUMMY, "flower-superlink", "--insecure", "--log-file", str(log_file)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while not descendants(proc.pid):  # wait for its child to exist
        assert time.monotonic() < deadline, "dummy SuperLink did not start its child"
        time.sleep(0.05)
    return proc


def _stop_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "federation.deploy.stop", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.fixture
def cleanup():
    """pids to stop by pid if a test fails half-way (never by name)."""
    pids: list[int] = []
    yield pids
    stop_pids([p for p in pids if alive(p)], grace_s=2.0)


def test_stops_only_this_homes_superlink_and_its_descendants(tmp_path, cleanup) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    link = _fake_superlink(ours)
    other = _fake_superlink(theirs)
    family, other_family = descendants(link.pid), descendants(other.pid)
    cleanup += [link.pid, *family, other.pid, *other_family]

    done = _stop_cli("--flwr-home", str(ours))
    assert done.returncode == 0, done.stderr
    link.wait(timeout=30)
    assert f"stopped SuperLink pid {link.pid}" in done.stdout
    for pid in family:
        assert str(pid) in done.stdout
    deadline = time.monotonic() + HANG_GUARD_S
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in [link.pid, *family])
    assert alive(other.pid) and all(alive(p) for p in other_family)  # another FLWR_HOME: untouched

    # $FLWR_HOME is the default
    done = _stop_cli(env={**os.environ, "FLWR_HOME": str(theirs)})
    assert done.returncode == 0 and f"stopped SuperLink pid {other.pid}" in done.stdout
    other.wait(timeout=30)


def test_nothing_running_exits_zero(tmp_path) -> None:
    done = _stop_cli("--flwr-home", str(tmp_path / "empty"))
    assert done.returncode == 0
    assert "no local SuperLink running" in done.stdout


def test_a_home_whose_path_ends_another_homes_path_is_not_ours(tmp_path, cleanup) -> None:
    """The SuperLink of /x/nest/<ours> logs to a path that *contains* ours/local-superlink: not ours."""
    ours = tmp_path / "ours"
    theirs = Path(f"{tmp_path}/nest{ours}")
    other = _fake_superlink(theirs)
    cleanup += [other.pid, *descendants(other.pid)]

    done = _stop_cli("--flwr-home", str(ours))
    assert done.returncode == 0 and "no local SuperLink running" in done.stdout, done.stdout
    assert alive(other.pid)


def test_another_users_or_homes_superlink_is_named_when_none_of_ours_runs(tmp_path, cleanup) -> None:
    """Stop's answer on a shared host: the port a plain flwr run would use is someone else's."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {**os.environ, "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)}
        done = _stop_cli("--flwr-home", str(tmp_path / "empty"), env=env)
    assert done.returncode == 0
    assert f"127.0.0.1:{port} is held by pid {os.getpid()} of user" in done.stdout
    assert "not this FLWR_HOME's, left alone" in done.stdout
