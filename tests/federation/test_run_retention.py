"""Retention (``federation.run_retention``): the FEDKV_KEEP_RUNS hook of the node store, and
``prune`` from two processes at once. Real directories, staged mtimes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from federation import run_retention  # stdlib only: the spawned pruners below import this module fast
from tests.federation.run_dirs import HOUR, names, stage_run


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
    start.wait(60)
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
    start.wait(60)  # both started and ready: they prune at once, in the same order
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(kind == "ok" for kind, _ in results), results
    assert names(root) == {"run-999"}
    removed = set(results[0][1]) | set(results[1][1])
    assert removed == {f"run-{i}" for i in range(1, 41)}  # each run reported by the process(es) that removed it
