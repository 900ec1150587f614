"""``node.serving.dir_lease``: a lease is live exactly while its holder process lives (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node.serving import dir_lease

REPO = Path(__file__).resolve().parents[3]
_HOLD = "import sys, time; from node.serving import dir_lease; dir_lease.take(sys.argv[1], 'serving.test'); print('held', flush=True); time.sleep(120)"


def test_a_lease_is_seen_with_its_pid_and_gone_once_released(tmp_path) -> None:
    (tmp_path / "kv-cache").mkdir()
    with dir_lease.take(tmp_path / "kv-cache", "serving.x") as lease:
        found = dir_lease.holders(tmp_path)
        assert [(h.path, h.pid, h.purpose) for h in found] == [(lease.path, os.getpid(), "serving.x")]
        assert found[0].describe() == f"pid {os.getpid()} (serving.x)"
    assert not lease.held and dir_lease.holders(tmp_path) == []
    assert list(tmp_path.rglob("*")) == [tmp_path / "kv-cache"]  # the file went with the lease


def test_another_processs_lease_pins_until_it_is_killed(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        assert [h.pid for h in dir_lease.holders(tmp_path)] == [proc.pid]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    assert len(list(tmp_path.glob("*.lease"))) == 1  # left behind, unlocked: stale
    assert dir_lease.holders(tmp_path) == []


def test_a_forked_child_does_not_release_its_parents_lease(tmp_path) -> None:
    lease = dir_lease.take(tmp_path, "serving.x")
    try:
        pid = os.fork()
        if pid == 0:  # the child: release closes its inherited fd only
            lease.release()
            os._exit(0)
        os.waitpid(pid, 0)
        assert lease.path.exists() and [h.pid for h in dir_lease.holders(tmp_path)] == [os.getpid()]
    finally:
        lease.release()


def test_symlinks_are_not_followed_and_a_bad_purpose_is_refused(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "link").symlink_to(elsewhere, target_is_directory=True)
    with dir_lease.take(elsewhere, "serving.x"):
        assert dir_lease.holders(tmp_path / "run") == []
    with pytest.raises(ValueError, match="lease purpose"):
        dir_lease.take(tmp_path, "../x")
    assert not any(p.name.endswith((".lease", ".tmp")) for p in tmp_path.rglob("*"))
