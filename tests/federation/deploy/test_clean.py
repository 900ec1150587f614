"""``python -m federation.deploy.clean`` and ``python -m federation.deploy.stop --clean-nodes``
over the retention rules of ``federation.run_retention``. Real directories, staged mtimes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation import run_retention
from federation.deploy import clean
from tests.federation.run_dirs import HOUR, names, stage_run
from tests.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[3]


def _cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, **(env or {})})


# -- the command ------------------------------------------------------------------------
def test_keep_n_keeps_the_newest_by_last_write_not_by_run_id(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    for name, age in (("run-1", 1 * HOUR), ("run-2", 5 * HOUR), ("run-3", 2 * HOUR),
                      ("run-40", 4 * HOUR), ("run-5", 3 * HOUR)):
        stage_run(root, name, age)
    assert clean.main(["--node-dir", str(root), "--keep", "2"]) == 0
    assert names(root) == {"run-1", "run-3"}  # newest writes, whatever their ids
    out = capsys.readouterr().out
    assert "removed run-2 (2.0 kB)" in out and "removed run-40" in out and "removed run-5" in out
    assert "freed 6.0 kB (6000 bytes)" in out


def test_last_write_counts_a_node_dirs_recent_write(tmp_path) -> None:
    """A run whose run dir is old but whose node wrote a file recently is newer than a run
    made later but idle since (the node dir's mtime moves with each file written in it)."""
    root = tmp_path / "nodes"
    stage_run(root, "run-1", 3 * HOUR)
    stage_run(root, "run-2", 2 * HOUR)
    touched = time.time() - 1 * HOUR
    os.utime(root / "run-1" / "node-0", (touched, touched))
    assert [r.name for r in run_retention.runs(root)] == ["run-1", "run-2"]
    run_retention.clean(root, keep=1)
    assert names(root) == {"run-1"}


def test_run_removes_only_that_run(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    for i in (1, 2, 3):
        stage_run(root, f"run-{i}", i * HOUR)
    assert clean.main(["--node-dir", str(root), "--run", "2"]) == 0
    assert names(root) == {"run-1", "run-3"}
    assert clean.main(["--node-dir", str(root), "--run", "run-3"]) == 0
    assert names(root) == {"run-1"}
    assert "removed run-3 (2.0 kB)" in capsys.readouterr().out


def test_dry_run_removes_nothing(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    for i in (1, 2, 3):
        stage_run(root, f"run-{i}", i * HOUR)
    before = sorted(str(p) for p in root.rglob("*"))
    for args in (["--all"], ["--keep", "1"], ["--run", "2"]):
        assert clean.main(["--node-dir", str(root), "--dry-run", *args]) == 0
    assert sorted(str(p) for p in root.rglob("*")) == before
    out = capsys.readouterr().out
    assert "would remove run-3 (2.0 kB)" in out and "would free 4.0 kB (4000 bytes)" in out
    assert "removed" not in out.replace("would remove", "")


def test_a_symlinked_run_is_unlinked_and_its_target_untouched(tmp_path) -> None:
    root, elsewhere = tmp_path / "nodes", tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "data").write_bytes(b"x" * 500)
    stage_run(root, "run-1", HOUR)
    (root / "run-5").symlink_to(elsewhere, target_is_directory=True)
    (root / "run-1" / "node-0" / "escape").symlink_to(elsewhere, target_is_directory=True)  # inside a run
    old = time.time() - HOUR
    os.utime(root / "run-1" / "node-0", (old, old))
    os.utime(root / "run-1", (old, old))
    os.utime(root / "run-5", (old, old), follow_symlinks=False)
    report = run_retention.clean(root)
    assert dict(report.removed) == {"run-5": 0, "run-1": 2000}  # the link's target is not counted
    assert names(root) == set()
    assert (elsewhere / "data").read_bytes() == b"x" * 500


def test_entries_not_named_run_digits_are_untouched(tmp_path) -> None:
    root = tmp_path / "nodes"
    keep = {"notes", "run-x", "run-5.bak", "run-", "Run-3", "run-٣", "xrun-4"}  # ٣: an Arabic-Indic digit
    for name in keep:
        stage_run(root, name, HOUR)
    (root / "run-7").write_bytes(b"a file, not a run directory")
    os.utime(root / "run-7", (time.time() - HOUR,) * 2)
    stage_run(root, "run-6", HOUR)
    assert clean.main(["--node-dir", str(root), "--all"]) == 0
    assert names(root) == keep | {"run-7"}


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_bad_root_is_one_line_exit_2(tmp_path, kind) -> None:
    root = tmp_path / "nodes"
    if kind == "file":
        root.write_text("not a directory")
    res = _cli("federation.deploy.clean", "--node-dir", str(root), "--all")
    assert res.returncode == 2
    assert res.stderr.strip() == f"python -m federation.deploy.clean: error: {root} is not a directory"
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--keep", "0"], "--keep N needs N >= 1"),
    (["--run", "../x"], "a run id is digits"),
    (["--run", "9"], "no run-9 under"),
])
def test_bad_arguments_are_one_line_exit_2(tmp_path, capsys, args, message) -> None:
    root = tmp_path / "nodes"
    stage_run(root, "run-1", HOUR)
    assert clean.main(["--node-dir", str(root), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert names(root) == {"run-1"}


def test_a_recently_written_run_is_kept_unless_forced(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    stage_run(root, "run-1", HOUR)
    stage_run(root, "run-2", 10)  # may be a live run
    assert clean.main(["--node-dir", str(root), "--all"]) == 1
    assert names(root) == {"run-2"}
    assert "kept run-2: written 10 s ago" in capsys.readouterr().out
    assert clean.main(["--node-dir", str(root), "--all", "--force"]) == 0
    assert names(root) == set()


def test_listing_shows_runs_with_size_newest_first(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    stage_run(root, "run-1", 2 * HOUR, size=3000)
    stage_run(root, "run-2", HOUR)
    assert clean.main(["--node-dir", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{root}: 2 run(s), 8.0 kB (8000 bytes); newest first"
    assert out[1].split()[:3] == ["run-2", "2.0", "kB"] and out[2].split()[:3] == ["run-1", "6.0", "kB"]
    assert names(root) == {"run-1", "run-2"}


def test_kit_state_runs(tmp_path, capsys) -> None:
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "node.json").write_text("{}")
    for i in (1, 2, 3):
        stage_run(kit / "state", f"run-{i}", i * HOUR)
    assert clean.main(["--kit", str(kit), "--keep", "1"]) == 0
    assert names(kit / "state") == {"run-1"} and (kit / "node.json").exists()
    assert clean.main(["--kit", str(tmp_path / "state")]) == 2  # not a kit
    assert "is not a node kit" in capsys.readouterr().err


# -- issue 30: completed runs counted apart, pinned runs, runs in use --------------------------
def test_keep_counts_completed_runs_apart_from_the_others(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    stage_run(root, "run-1", 5 * HOUR, completed=True)
    stage_run(root, "run-2", 4 * HOUR, completed=True)
    stage_run(root, "run-3", 3 * HOUR)  # failed attempts, newer than every completed run
    stage_run(root, "run-4", 2 * HOUR)
    assert clean.main(["--node-dir", str(root), "--keep", "1"]) == 0
    assert names(root) == {"run-2", "run-4"}  # the newest completed one and the newest other
    out = capsys.readouterr().out
    assert "removed run-1 (2.0 kB)" in out and "removed run-3 (2.0 kB)" in out


def test_a_pinned_run_survives_all_until_unpinned(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    stage_run(root, "run-1", 2 * HOUR, completed=True)
    stage_run(root, "run-2", HOUR)
    assert clean.main(["--node-dir", str(root), "--pin", "1"]) == 0
    assert (root / "run-1" / "PINNED").is_file()
    assert clean.main(["--node-dir", str(root), "--pin", "run-1"]) == 0  # idempotent
    assert clean.main(["--node-dir", str(root), "--all", "--force"]) == 1
    assert names(root) == {"run-1"}
    out = capsys.readouterr().out
    assert "run-1 is now pinned" in out and "run-1 was already pinned" in out
    assert "kept run-1: pinned (python -m federation.deploy.clean --unpin run-1 lets it go)" in out
    assert clean.main(["--node-dir", str(root), "--run", "1"]) == 1 and names(root) == {"run-1"}
    assert clean.main(["--node-dir", str(root), "--unpin", "1"]) == 0
    assert clean.main(["--node-dir", str(root), "--all"]) == 0
    assert names(root) == set()
    assert clean.main(["--node-dir", str(root), "--pin", "7"]) == 2
    assert "no run-7 under" in capsys.readouterr().err


def test_a_run_in_use_is_listed_as_such_and_kept_even_when_forced(tmp_path, capsys) -> None:
    from node.serving import dir_lease

    root = tmp_path / "nodes"
    stage_run(root, "run-1", 2 * HOUR, completed=True, pinned=True)
    run2 = stage_run(root, "run-2", HOUR)
    lease = dir_lease.take(run2 / "node-0", "serving.test")  # this process serves from it
    try:
        assert clean.main(["--node-dir", str(root)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[1].split()[0] == "run-2" and out[1].endswith(f"not completed; in use by pid {os.getpid()} (serving.test)")
        assert out[2].split()[0] == "run-1" and out[2].endswith("completed; pinned")
        assert clean.main(["--node-dir", str(root), "--all", "--force"]) == 1
        assert names(root) == {"run-1", "run-2"}
        assert f"kept run-2: in use by pid {os.getpid()} (serving.test)" in capsys.readouterr().out
    finally:
        lease.release()
    assert not list(run2.rglob("*.lease"))
    assert clean.main(["--node-dir", str(root), "--all", "--force"]) == 1  # the pinned run stays
    assert names(root) == {"run-1"}


# -- python -m federation.deploy.stop --clean-nodes --------------------------------------------
def test_stop_clean_nodes_without_a_superlink_still_cleans(tmp_path) -> None:
    flwr_home, root = tmp_path / "flwr-home", tmp_path / "nodes"
    flwr_home.mkdir()
    stage_run(root, "run-1", HOUR)
    stage_run(root, "run-2", 5)  # the run that just stopped: removed too
    (root / "notes").mkdir()
    res = _cli("federation.deploy.stop", "--flwr-home", str(flwr_home), "--clean-nodes", "--node-dir", str(root))
    assert res.returncode == 0, res.stderr
    assert "no local SuperLink running" in res.stdout
    assert "removed run-1 (2.0 kB)" in res.stdout and "removed run-2 (2.0 kB)" in res.stdout
    assert names(root) == {"notes"}

    stage_run(root, "run-3", HOUR)  # the default root: $FEDKV_NODE_DIR
    res = _cli("federation.deploy.stop", "--flwr-home", str(flwr_home), "--clean-nodes", env={"FEDKV_NODE_DIR": str(root)})
    assert res.returncode == 0 and "removed run-3" in res.stdout
    assert names(root) == {"notes"}

    stage_run(root, "run-4", HOUR, pinned=True)  # issue 30: a pinned run survives --clean-nodes
    res = _cli("federation.deploy.stop", "--flwr-home", str(flwr_home), "--clean-nodes", "--node-dir", str(root))
    assert res.returncode == 0 and "kept run-4: pinned" in res.stdout
    assert names(root) == {"notes", "run-4"}


def test_stop_without_clean_nodes_leaves_node_dirs_and_a_bad_root_is_exit_2(tmp_path) -> None:
    flwr_home, root = tmp_path / "flwr-home", tmp_path / "nodes"
    flwr_home.mkdir()
    stage_run(root, "run-1", HOUR)
    res = _cli("federation.deploy.stop", "--flwr-home", str(flwr_home), env={"FEDKV_NODE_DIR": str(root)})
    assert res.returncode == 0 and names(root) == {"run-1"}
    res = _cli("federation.deploy.stop", "--flwr-home", str(flwr_home), "--clean-nodes", "--node-dir", str(tmp_path / "no"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().endswith(f"{tmp_path / 'no'} is not a directory")
