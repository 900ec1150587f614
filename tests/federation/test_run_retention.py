"""Retention (``federation.run_retention``): the FEDKV_KEEP_RUNS hook of the node store, and
``prune`` from two processes at once. Real directories, staged mtimes.

Issue 30: retention deleted the model being served (failed attempts pushed completed runs out,
a served cache directory was removed): completed runs are counted apart from the others, a run
in use by a live process (a serving process's lease, a node of a run in progress) or pinned is
kept, and each removal is logged with its folder and size."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation import run_retention  # stdlib only: the spawned pruners below import this module fast
from tests.federation.run_dirs import HOUR, age, names, stage_run
from tests.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


# -- retention: the node store prunes when it makes a new run's directory ---------------
def _store(root: Path, run_id: int, node_id: int = 100):
    from federation.local import make_context
    from federation.node_store import NodeStore

    return NodeStore.for_context(make_context(node_id, 0, 1, {}, run_id=run_id, node_dir=str(root)))


def test_a_new_run_prunes_to_keep_runs_but_never_itself(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "2")
    root = tmp_path / "nodes"
    for i, age in ((1, 3 * HOUR), (2, 2 * HOUR), (3, 1 * HOUR)):
        stage_run(root, f"run-{i}", age)
    store = _store(root, 4)
    assert store.root == root / "run-4" / "node-100"
    assert names(root) == {"run-3", "run-4"}
    store.identity(create=True)  # the node works as before
    assert (root / "run-4" / "node-100" / "identity.key").exists()
    assert (root / "run-4").stat().st_mode & 0o777 == 0o700

    stage_run(root, "run-0", 5 * HOUR)
    _store(root, 4, node_id=101)  # the run exists: another node of it prunes nothing
    assert names(root) == {"enrolled", "run-0", "run-3", "run-4"}  # the node's lasting identity is no run
    _store(root, 5)  # a new run prunes runs, never the enrollment
    assert names(root) == {"enrolled", "run-4", "run-5"}


def test_prune_spares_the_current_run_even_when_it_is_the_oldest(tmp_path) -> None:
    root = tmp_path / "nodes"
    for i, age in ((1, 3 * HOUR), (2, 2 * HOUR), (3, 1 * HOUR)):
        stage_run(root, f"run-{i}", age)
    report = run_retention.prune(root, 1, current="run-1")
    assert names(root) == {"run-1", "run-3"}
    assert [n for n, _ in report.removed] == ["run-2"]


def test_retention_defaults_to_3_and_0_keeps_all(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FEDKV_KEEP_RUNS", raising=False)
    root = tmp_path / "nodes"
    for i in range(1, 6):
        stage_run(root, f"run-{i}", (10 - i) * HOUR)
    _store(root, 6)
    assert names(root) == {"run-4", "run-5", "run-6"}
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "0")
    _store(root, 7)
    assert names(root) == {"run-4", "run-5", "run-6", "run-7"}


def test_a_bad_keep_runs_value_prunes_nothing_and_the_node_still_works(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "two")
    root = tmp_path / "nodes"
    stage_run(root, "run-1", HOUR)
    _store(root, 2).identity(create=True)
    assert names(root) == {"enrolled", "run-1", "run-2"}
    assert "FEDKV_KEEP_RUNS='two' is not an integer" in caplog.text


def test_retention_does_not_remove_a_run_written_recently(tmp_path, monkeypatch) -> None:
    """Another SuperLink sharing the root may still be running it."""
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    root = tmp_path / "nodes"
    stage_run(root, "run-1", HOUR)
    stage_run(root, "run-2", 30)
    _store(root, 3)
    assert names(root) == {"run-2", "run-3"}


def _prune_worker(root: str, start, out) -> None:
    start.wait(HANG_GUARD_S)
    try:
        report = run_retention.prune(Path(root), 1, current="run-999")
        out.put(("ok", [n for n, _ in report.removed]))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        out.put(("error", f"{type(err).__name__}: {err}"))


def test_two_processes_pruning_at_once_do_not_fail(tmp_path) -> None:
    root = tmp_path / "nodes"
    for i in range(1, 41):
        stage_run(root, f"run-{i}", HOUR + i, size=10, nodes=30)
    (root / "run-999").mkdir()
    mp = multiprocessing.get_context("spawn")
    start, out = mp.Barrier(3), mp.Queue()
    procs = [mp.Process(target=_prune_worker, args=(str(root), start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    start.wait(HANG_GUARD_S)  # both started and ready: they prune at once, in the same order
    results = [out.get(timeout=HANG_GUARD_S) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(kind == "ok" for kind, _ in results), results
    assert names(root) == {"run-999"}
    removed = set(results[0][1]) | set(results[1][1])
    assert removed == {f"run-{i}" for i in range(1, 41)}  # each run reported by the process(es) that removed it


# -- issue 30: what a user may still need is kept --------------------------------------
def test_failed_attempts_do_not_push_completed_runs_out(tmp_path, monkeypatch) -> None:
    """Three completed runs, then failed attempts: the completed runs all stay; the failed
    ones are counted apart (their own newest FEDKV_KEEP_RUNS are kept)."""
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "3")
    root = tmp_path / "nodes"
    for i, age_h in ((1, 9), (2, 8), (3, 7)):
        stage_run(root, f"run-{i}", age_h * HOUR, completed=True)
    for i, age_h in ((4, 4), (5, 3), (6, 2)):
        stage_run(root, f"run-{i}", age_h * HOUR)  # failed: no COMPLETED marker
    _store(root, 7)
    assert names(root) == {"run-1", "run-2", "run-3", "run-5", "run-6", "run-7"}


def test_a_node_marks_its_run_completed_after_the_last_rounds_evaluation(tmp_path) -> None:
    from federation.local import InProcessGrid, run_local

    cfg = {"task": "digits", "he": False, "dp-mode": "none", "num-server-rounds": 2, "min-clients": 2, "seed": 42}
    grid = InProcessGrid(2, cfg)
    marker = Path(grid.node_dir) / f"run-{grid.run_id}" / run_retention.COMPLETED
    seen: list[bool] = []
    results = run_local(cfg, 2, grid=grid, on_round=lambda rec: seen.append(marker.exists()))
    assert results.status == "completed"
    assert seen == [False, True]  # written in the last round's evaluation, not before
    assert [r.name for r in run_retention.runs(marker.parent.parent) if r.completed] == [marker.parent.name]


def test_a_runs_kept_adapters_outlive_its_removal(tmp_path, monkeypatch) -> None:
    """A node keeps its final adapters in ``adapters/run-<id>/node-<id>`` beside the runs
    (``NodeStore.adapters_dir``): retention removes the run's state, never them."""
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    from federation.node_store import NodeStore

    root = tmp_path / "nodes"
    store = NodeStore(root / "run-1" / "node-100", "100")  # no lease: run 1's process ended
    assert store.adapters_dir == root / "adapters" / "run-1" / "node-100"
    store.adapters_dir.mkdir(parents=True)
    (store.adapters_dir / "adapter_model.safetensors").write_bytes(b"kept")
    stage_run(root, "run-1", 3 * HOUR, completed=True)
    stage_run(root, "run-2", 2 * HOUR, completed=True)
    _store(root, 3)
    assert names(root) == {"run-2", "run-3", "adapters"}
    assert (store.adapters_dir / "adapter_model.safetensors").read_bytes() == b"kept"


def test_a_run_in_progress_is_kept_however_long_it_was_idle(tmp_path, monkeypatch) -> None:
    """A node of run 1 is still working in this process (a long training step writes nothing
    for an hour): its run is not removed although it is neither completed nor recent."""
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    root = tmp_path / "nodes"
    _store(root, 1).identity(create=True)
    age(root / "run-1", HOUR)
    stage_run(root, "run-2", 2 * HOUR)
    _store(root, 3)
    assert names(root) - {"enrolled"} == {"run-1", "run-3"}  # enrolled/: identities, never a run


def test_a_pinned_run_is_never_removed_and_not_counted(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    root = tmp_path / "nodes"
    stage_run(root, "run-1", 9 * HOUR, completed=True, pinned=True)
    stage_run(root, "run-2", 8 * HOUR, pinned=True)  # a failed run the user wants to look into
    stage_run(root, "run-3", 7 * HOUR, completed=True)
    stage_run(root, "run-4", 6 * HOUR, completed=True)
    _store(root, 5)
    assert names(root) == {"run-1", "run-2", "run-4", "run-5"}
    report = run_retention.clean(root, active_s=0)  # --all --force: the pinned runs still stay
    assert [n for n, _ in report.removed] == ["run-4"] and sorted(report.pinned) == ["run-1", "run-2"]
    assert names(root) == {"run-1", "run-2", "run-5"}  # run-5: its node (this process) holds it


def test_the_log_names_each_removed_folder_and_its_size(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    caplog.set_level(logging.INFO, logger="fedkv.node_store")
    root = tmp_path / "nodes"
    stage_run(root, "run-1", 2 * HOUR, size=1500)
    stage_run(root, "run-2", HOUR, size=250_000, nodes=3)
    _store(root, 3)
    assert names(root) == {"run-3"}
    assert f"removed {root / 'run-1'} (3.0 kB, 3000 bytes)" in caplog.text
    assert f"removed {root / 'run-2'} (750.0 kB, 750000 bytes)" in caplog.text


# -- a serving process holds its cache directory: a real ``python -m node.serving.openai_api`` ----
KEY = bytes(range(1, 33))


def _serving(node_dir: Path, ready: Path) -> subprocess.Popen:
    """``python -m node.serving.openai_api --cache-dir <node_dir>/kv-cache`` over the parameters a
    ``CacheNode`` (the run's trainer, now gone) left there; returns once it serves."""
    from crypto import write_secret_file
    from node.cache_node import CacheNode, NodeSpec

    node_dir.mkdir(mode=0o700)
    write_secret_file(node_dir / "kv-cache.key", KEY)
    (node_dir / "serve-token").write_text("alice:alice-token-0123456789\n")
    (node_dir / "serve-token").chmod(0o600)
    CacheNode(NodeSpec(0, 5, "lm"), cache_dir=node_dir / "kv-cache", cache_key=KEY).release()
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.serving.openai_api", "--cache-dir", str(node_dir / "kv-cache"), "--port", "0",
         "--ready-file", str(ready), "--wait-s", "30"], cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"node.serving.openai_api did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def test_a_run_served_by_a_live_process_is_kept_until_that_process_is_gone(tmp_path, monkeypatch, caplog) -> None:
    """The red team's case: an OpenAI server serves run 1's fine-tuned node from its cache
    directory; newer runs would push run 1 out. It stays while the server lives; once the
    server is killed (-9: its lease file stays, unlocked) the stale lease pins nothing."""
    monkeypatch.setenv("FEDKV_KEEP_RUNS", "1")
    caplog.set_level(logging.INFO, logger="fedkv.node_store")
    root = tmp_path / "nodes"
    run1 = stage_run(root, "run-1", 0, completed=True)
    proc = _serving(run1 / "node-100", tmp_path / "ready.json")
    try:
        age(run1, 5 * HOUR)
        age(run1 / "node-100", 5 * HOUR)
        stage_run(root, "run-2", 4 * HOUR, completed=True)
        stage_run(root, "run-3", 3 * HOUR, completed=True)
        _store(root, 4)
        assert names(root) == {"run-1", "run-3", "run-4"}
        assert (run1 / "node-100" / "kv-cache").is_dir()
        assert f"kept run-1: in use by pid {proc.pid} (serving" in caplog.text
        assert proc.poll() is None  # it still serves
    finally:
        _stop(proc, signal.SIGKILL)
    assert list((run1 / "node-100" / "kv-cache").glob("*.lease"))  # left behind by the killed server
    _store(root, 5)
    assert "run-1" not in names(root)
