"""Disk hygiene: ``python -m federation.clean``, the FEDKV_KEEP_RUNS retention hook of the node
store, and ``python -m federation.stop --clean-nodes``. Real directories, staged mtimes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation import clean  # stdlib only: the spawned pruners below import this module fast

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def _stage(root: Path, name: str, age_s: float, size: int = 1000, nodes: int = 2) -> Path:
    """A run directory with ``nodes`` node dirs of one ``size``-byte file each, last written
    ``age_s`` seconds ago (the run dir, its node dirs and their files all get that mtime)."""
    run = root / name
    when = time.time() - age_s
    for i in range(nodes):
        node = run / f"node-{i}"
        node.mkdir(parents=True, exist_ok=True)
        (node / "identity.key").write_bytes(b"k" * size)
        os.utime(node / "identity.key", (when, when))
        os.utime(node, (when, when))
    os.utime(run, (when, when))
    return run


def _names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def _cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


# -- the command ------------------------------------------------------------------------
def test_keep_n_keeps_the_newest_by_last_write_not_by_run_id(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    for name, age in (("run-1", 1 * HOUR), ("run-2", 5 * HOUR), ("run-3", 2 * HOUR),
                      ("run-40", 4 * HOUR), ("run-5", 3 * HOUR)):
        _stage(root, name, age)
    assert clean.main(["--node-dir", str(root), "--keep", "2"]) == 0
    assert _names(root) == {"run-1", "run-3"}  # newest writes, whatever their ids
    out = capsys.readouterr().out
    assert "removed run-2 (2.0 kB)" in out and "removed run-40" in out and "removed run-5" in out
    assert "freed 6.0 kB (6000 bytes)" in out


def test_last_write_counts_a_node_dirs_recent_write(tmp_path) -> None:
    """A run whose run dir is old but whose node wrote a file recently is newer than a run
    made later but idle since (the node dir's mtime moves with each file written in it)."""
    root = tmp_path / "nodes"
    _stage(root, "run-1", 3 * HOUR)
    _stage(root, "run-2", 2 * HOUR)
    touched = time.time() - 1 * HOUR
    os.utime(root / "run-1" / "node-0", (touched, touched))
    assert [r.name for r in clean.runs(root)] == ["run-1", "run-2"]
    clean.clean(root, keep=1)
    assert _names(root) == {"run-1"}


def test_run_removes_only_that_run(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    for i in (1, 2, 3):
        _stage(root, f"run-{i}", i * HOUR)
    assert clean.main(["--node-dir", str(root), "--run", "2"]) == 0
    assert _names(root) == {"run-1", "run-3"}
    assert clean.main(["--node-dir", str(root), "--run", "run-3"]) == 0
    assert _names(root) == {"run-1"}
    assert "removed run-3 (2.0 kB)" in capsys.readouterr().out


def test_dry_run_removes_nothing(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    for i in (1, 2, 3):
        _stage(root, f"run-{i}", i * HOUR)
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
    _stage(root, "run-1", HOUR)
    (root / "run-5").symlink_to(elsewhere, target_is_directory=True)
    (root / "run-1" / "node-0" / "escape").symlink_to(elsewhere, target_is_directory=True)  # inside a run
    old = time.time() - HOUR
    os.utime(root / "run-1" / "node-0", (old, old))
    os.utime(root / "run-1", (old, old))
    os.utime(root / "run-5", (old, old), follow_symlinks=False)
    report = clean.clean(root)
    assert dict(report.removed) == {"run-5": 0, "run-1": 2000}  # the link's target is not counted
    assert _names(root) == set()
    assert (elsewhere / "data").read_bytes() == b"x" * 500


def test_entries_not_named_run_digits_are_untouched(tmp_path) -> None:
    root = tmp_path / "nodes"
    keep = {"notes", "run-x", "run-5.bak", "run-", "Run-3", "run-٣", "xrun-4"}  # ٣: an Arabic-Indic digit
    for name in keep:
        _stage(root, name, HOUR)
    (root / "run-7").write_bytes(b"a file, not a run directory")
    os.utime(root / "run-7", (time.time() - HOUR,) * 2)
    _stage(root, "run-6", HOUR)
    assert clean.main(["--node-dir", str(root), "--all"]) == 0
    assert _names(root) == keep | {"run-7"}


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_bad_root_is_one_line_exit_2(tmp_path, kind) -> None:
    root = tmp_path / "nodes"
    if kind == "file":
        root.write_text("not a directory")
    res = _cli("federation.clean", "--node-dir", str(root), "--all")
    assert res.returncode == 2
    assert res.stderr.strip() == f"python -m federation.clean: error: {root} is not a directory"
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--keep", "0"], "--keep N needs N >= 1"),
    (["--run", "../x"], "a run id is digits"),
    (["--run", "9"], "no run-9 under"),
])
def test_bad_arguments_are_one_line_exit_2(tmp_path, capsys, args, message) -> None:
    root = tmp_path / "nodes"
    _stage(root, "run-1", HOUR)
    assert clean.main(["--node-dir", str(root), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert _names(root) == {"run-1"}


def test_a_recently_written_run_is_kept_unless_forced(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    _stage(root, "run-1", HOUR)
    _stage(root, "run-2", 10)  # may be a live run
    assert clean.main(["--node-dir", str(root), "--all"]) == 1
    assert _names(root) == {"run-2"}
    assert "kept run-2: written 10 s ago" in capsys.readouterr().out
    assert clean.main(["--node-dir", str(root), "--all", "--force"]) == 0
    assert _names(root) == set()


def test_listing_shows_runs_with_size_newest_first(tmp_path, capsys) -> None:
    root = tmp_path / "nodes"
    _stage(root, "run-1", 2 * HOUR, size=3000)
    _stage(root, "run-2", HOUR)
    assert clean.main(["--node-dir", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{root}: 2 run(s), 8.0 kB (8000 bytes); newest first"
    assert out[1].split()[:3] == ["run-2", "2.0", "kB"] and out[2].split()[:3] == ["run-1", "6.0", "kB"]
    assert _names(root) == {"run-1", "run-2"}


def test_kit_state_runs(tmp_path, capsys) -> None:
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "node.json").write_text("{}")
    for i in (1, 2, 3):
        _stage(kit / "state", f"run-{i}", i * HOUR)
    assert clean.main(["--kit", str(kit), "--keep", "1"]) == 0
    assert _names(kit / "state") == {"run-1"} and (kit / "node.json").exists()
    assert clean.main(["--kit", str(tmp_path / "state")]) == 2  # not a kit
    assert "is not a node kit" in capsys.readouterr().err


# -- retention: the node store prunes when it makes a new run's directory ---------------
def _store(root: Path, run_id: int, node_id: int = 100):
    from federation.local import make_context
    from federation.node_store import NodeStore

    return NodeStore.for_context(make_context(node_id, 0, 1, {}, run_id=run_id, node_dir=str(root)))


def test_a_new_run_prunes_to_keep_runs_but_never_itself(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "2")
    root = tmp_path / "nodes"
    for i, age in ((1, 3 * HOUR), (2, 2 * HOUR), (3, 1 * HOUR)):
        _stage(root, f"run-{i}", age)
    store = _store(root, 4)
    assert store.root == root / "run-4" / "node-100"
    assert _names(root) == {"run-3", "run-4"}
    store.identity(create=True)  # the node works as before
    assert (root / "run-4" / "node-100" / "identity.key").exists()
    assert (root / "run-4").stat().st_mode & 0o777 == 0o700

    _stage(root, "run-0", 5 * HOUR)
    _store(root, 4, node_id=101)  # the run exists: another node of it prunes nothing
    assert _names(root) == {"run-0", "run-3", "run-4"}


def test_prune_spares_the_current_run_even_when_it_is_the_oldest(tmp_path) -> None:
    root = tmp_path / "nodes"
    for i, age in ((1, 3 * HOUR), (2, 2 * HOUR), (3, 1 * HOUR)):
        _stage(root, f"run-{i}", age)
    report = clean.prune(root, 1, current="run-1")
    assert _names(root) == {"run-1", "run-3"}
    assert [n for n, _ in report.removed] == ["run-2"]


def test_retention_defaults_to_3_and_0_keeps_all(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FEDKV_KEEP_RUNS", raising=False)
    root = tmp_path / "nodes"
    for i in range(1, 6):
        _stage(root, f"run-{i}", (10 - i) * HOUR)
    _store(root, 6)
    assert _names(root) == {"run-4", "run-5", "run-6"}
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "0")
    _store(root, 7)
    assert _names(root) == {"run-4", "run-5", "run-6", "run-7"}


def test_a_bad_keep_runs_value_prunes_nothing_and_the_node_still_works(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "two")
    root = tmp_path / "nodes"
    _stage(root, "run-1", HOUR)
    _store(root, 2).identity(create=True)
    assert _names(root) == {"run-1", "run-2"}
    assert "FEDKV_KEEP_RUNS='two' is not an integer" in caplog.text


def test_retention_does_not_remove_a_run_written_recently(tmp_path, monkeypatch) -> None:
    """Another SuperLink sharing the root may still be running it."""
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    root = tmp_path / "nodes"
    _stage(root, "run-1", HOUR)
    _stage(root, "run-2", 30)
    _store(root, 3)
    assert _names(root) == {"run-2", "run-3"}


def _prune_worker(root: str, start, out) -> None:
    start.wait(60)
    try:
        report = clean.prune(Path(root), 1, current="run-999")
        out.put(("ok", [n for n, _ in report.removed]))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        out.put(("error", f"{type(err).__name__}: {err}"))


def test_two_processes_pruning_at_once_do_not_fail(tmp_path) -> None:
    root = tmp_path / "nodes"
    for i in range(1, 41):
        _stage(root, f"run-{i}", HOUR + i, size=10, nodes=30)
    (root / "run-999").mkdir()
    mp = multiprocessing.get_context("spawn")
    start, out = mp.Barrier(3), mp.Queue()
    procs = [mp.Process(target=_prune_worker, args=(str(root), start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    start.wait(60)  # both started and ready: they prune at once, in the same order
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(kind == "ok" for kind, _ in results), results
    assert _names(root) == {"run-999"}
    removed = set(results[0][1]) | set(results[1][1])
    assert removed == {f"run-{i}" for i in range(1, 41)}  # each run reported by the process(es) that removed it


# -- python -m federation.stop --clean-nodes --------------------------------------------
def test_stop_clean_nodes_without_a_superlink_still_cleans(tmp_path) -> None:
    flwr_home, root = tmp_path / "flwr-home", tmp_path / "nodes"
    flwr_home.mkdir()
    _stage(root, "run-1", HOUR)
    _stage(root, "run-2", 5)  # the run that just stopped: removed too
    (root / "notes").mkdir()
    res = _cli("federation.stop", "--flwr-home", str(flwr_home), "--clean-nodes", "--node-dir", str(root))
    assert res.returncode == 0, res.stderr
    assert "no local SuperLink running" in res.stdout
    assert "removed run-1 (2.0 kB)" in res.stdout and "removed run-2 (2.0 kB)" in res.stdout
    assert _names(root) == {"notes"}

    _stage(root, "run-3", HOUR)  # the default root: $FEDKV_NODE_DIR
    res = _cli("federation.stop", "--flwr-home", str(flwr_home), "--clean-nodes", env={"FEDKV_NODE_DIR": str(root)})
    assert res.returncode == 0 and "removed run-3" in res.stdout
    assert _names(root) == {"notes"}


def test_stop_without_clean_nodes_leaves_node_dirs_and_a_bad_root_is_exit_2(tmp_path) -> None:
    flwr_home, root = tmp_path / "flwr-home", tmp_path / "nodes"
    flwr_home.mkdir()
    _stage(root, "run-1", HOUR)
    res = _cli("federation.stop", "--flwr-home", str(flwr_home), env={"FEDKV_NODE_DIR": str(root)})
    assert res.returncode == 0 and _names(root) == {"run-1"}
    res = _cli("federation.stop", "--flwr-home", str(flwr_home), "--clean-nodes", "--node-dir", str(tmp_path / "no"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().endswith(f"{tmp_path / 'no'} is not a directory")
