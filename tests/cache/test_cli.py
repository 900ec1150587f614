"""``python -m cache stats|set`` against a live engine in another process (started and
stopped by pid here), against no engine, and against garbage files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cache import KVCache
from cache.__main__ import main
from cache.control import LIVE_DIR, STATS_FILE, read_snapshot

from tests.cache.conftest import small_config
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("live_engine.py")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m cache ARGS`` in its own process (the real entry point)."""
    return subprocess.run([sys.executable, "-m", "cache", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture
def run(capsys):
    """The same CLI in this process (``cache.__main__.main``): no interpreter start per call."""

    def call(*args: str) -> subprocess.CompletedProcess:
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse refusing the usage
            rc = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out.out, out.err)

    return call


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(process, directory, its stderr file): a live engine looping over operations."""
    d = tmp_path_factory.mktemp("live")
    log = d.parent / f"{d.name}-engine.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(ENGINE), str(d / "cache")], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", log.read_text()
        yield proc, d / "cache", log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 15)  # SIGTERM: the engine closes its cache and exits
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, 9)
                proc.wait()
        proc.stdout.close()


def _eventually(pred, timeout: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_stats_prints_the_live_engines_snapshot(engine):
    proc, d, _ = engine
    r = cli("stats", "--dir", str(d))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pid"] == proc.pid and out["live"] is True and out["age_s"] >= 0
    assert {"hit_rate_by_tier", "swaps", "utilisation", "latency", "tunables"} <= set(out["stats"])
    # within a couple of publishes the snapshot shows the engine's operations
    assert _eventually(lambda: read_snapshot(d).stats["latency"]["reserve"]["samples"] > 0)


def test_set_is_applied_by_the_live_engine_and_prints_old_to_new(engine, run):
    proc, d, _ = engine
    r = cli("set", "evict_batch", "24", "--dir", str(d))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"evict_batch: 16 → 24 (engine pid {proc.pid})"
    r = run("set", "eviction_policy", "arc", "--dir", str(d))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("eviction_policy: 'lru' → 'arc'")
    assert _eventually(lambda: read_snapshot(d).stats["tunables"]["evict_batch"] == 24
                       and read_snapshot(d).stats["tunables"]["eviction_policy"] == "arc")
    assert proc.poll() is None


def test_a_bad_value_or_key_is_refused_with_exit_2_and_nothing_is_sent(engine, run):
    _, d, _ = engine
    r = run("set", "evict_batch", "0", "--dir", str(d))
    assert r.returncode == 2
    assert "evict_batch" in r.stderr and "'0'" in r.stderr and "[1, 1048576]" in r.stderr
    r = run("set", "evict_batches", "4", "--dir", str(d))
    assert r.returncode == 2 and "unknown tunable" in r.stderr and "evict_batch" in r.stderr
    assert not [n for n in os.listdir(d / LIVE_DIR) if n.startswith("set-")]
    r = run("set", "evict_batch", "--dir", str(d))
    assert r.returncode == 2  # argparse: bad usage


def test_a_garbage_request_is_logged_and_ignored_by_the_live_engine(engine, run):
    proc, d, log = engine
    rid = uuid.uuid4().hex
    (d / LIVE_DIR / f"set-{rid}.json").write_bytes(b"\x00\xffnot json{")
    ack = d / LIVE_DIR / f"ack-{rid}.json"
    assert _eventually(ack.exists)
    assert json.loads(ack.read_text())["status"] == "unreadable"
    assert not (d / LIVE_DIR / f"set-{rid}.json").exists()
    assert "ignored" in log.read_text()
    r = run("set", "prefetch_degree", "4", "--dir", str(d))  # the engine still serves
    assert r.returncode == 0 and "prefetch_degree: 2 → 4" in r.stdout, r.stderr
    assert proc.poll() is None


def test_live_files_are_private(engine):
    _, d, _ = engine
    assert (d / LIVE_DIR / STATS_FILE).stat().st_mode & 0o777 == 0o600
    assert (d / LIVE_DIR).stat().st_mode & 0o777 == 0o700


def test_no_engine_ever_ran_exits_1(tmp_path, run):
    for args in (("stats",), ("set", "evict_batch", "8")):
        r = run(*args, "--dir", str(tmp_path))
        assert r.returncode == 1 and "no live engine" in r.stderr, r.stderr


def test_a_garbage_stats_file_is_a_clear_error(tmp_path, run):
    (tmp_path / LIVE_DIR).mkdir()
    (tmp_path / LIVE_DIR / STATS_FILE).write_text('{"pid": 1, "stats": ')
    r = run("stats", "--dir", str(tmp_path))
    assert r.returncode == 1 and "not valid JSON" in r.stderr
    (tmp_path / LIVE_DIR / STATS_FILE).write_text('{"pid": "x"}')
    r = run("set", "evict_batch", "8", "--dir", str(tmp_path))
    assert r.returncode == 1 and "not an engine snapshot" in r.stderr


def test_a_snapshot_whose_writer_exited_is_not_live(tmp_path, run):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / LIVE_DIR).mkdir()
    (tmp_path / LIVE_DIR / STATS_FILE).write_text(json.dumps(
        {"pid": gone.pid, "written_at": time.time() - 5, "attached": True, "stats": {}}))
    r = run("stats", "--dir", str(tmp_path))
    assert r.returncode == 1 and f"(pid {gone.pid}) is not running" in r.stderr
    assert json.loads(r.stdout)["live"] is False  # the last snapshot is still shown
    r = run("set", "evict_batch", "8", "--dir", str(tmp_path))
    assert r.returncode == 1 and "is not running" in r.stderr


def test_an_idle_engine_that_does_not_answer_times_out_with_exit_1(tmp_path, run):
    kv = KVCache.open(tmp_path, small_config())  # live (this process), but runs no operation
    try:
        r = run("set", "evict_batch", "8", "--dir", str(tmp_path), "--timeout", "0.5")
        assert r.returncode == 1 and "no answer" in r.stderr and "withdrawn" in r.stderr
        assert not [n for n in os.listdir(tmp_path / LIVE_DIR) if re.match(r"set-", n)]
        assert kv.config.evict_batch == 16
    finally:
        kv.close()
    r = run("stats", "--dir", str(tmp_path))  # closed: the directory has no live engine
    assert r.returncode == 1 and "closed or released" in r.stderr


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_stats_on_a_cache_dir_shows_the_live_agent_below_it(tmp_path, run):
    """A node's cache dir: the trainer's engine exited (its snapshot stays), a serving agent's
    engine is live in ``DIR/serve`` (``node.serving.serve``): stats shows the live one and exits 0;
    set never redirects, its error names the live one."""
    (tmp_path / LIVE_DIR).mkdir()
    (tmp_path / LIVE_DIR / STATS_FILE).write_text(json.dumps(
        {"pid": _dead_pid(), "written_at": time.time() - 5, "attached": True, "stats": {}}))
    agent = KVCache(small_config())
    agent.go_live(tmp_path / "serve")  # live: this process
    r = run("stats", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["live"] is True and out["pid"] == os.getpid()
    assert out["dir"] == str(tmp_path / "serve") and "tunables" in out["stats"]
    assert "no live engine of its own" in r.stderr and str(tmp_path / "serve") in r.stderr
    r = run("set", "evict_batch", "8", "--dir", str(tmp_path), "--timeout", "0.2")
    assert r.returncode == 1 and f"--dir {tmp_path / 'serve'}" in r.stderr, r.stderr
    assert agent.config.evict_batch == 16
    agent.release()  # the agent let go: nothing is live any more
    r = run("stats", "--dir", str(tmp_path))
    assert r.returncode == 1 and "is not running" in r.stderr
    assert json.loads(r.stdout)["dir"] == str(tmp_path)  # the directory's own last snapshot


def _no_constants(name: str):
    raise AssertionError(f"not strict JSON: {name}")


def test_stats_output_is_strict_json(tmp_path, run):
    """A prefetcher that issued nothing has NaN accuracies: the snapshot file holds NaN (the
    engine writes Python's JSON), the command prints null."""
    kv = KVCache.open(tmp_path, small_config(prefetch_mode="sequential", warm_bytes=1 << 20))
    try:
        kv.match_prefix(kv.open_session(), list(range(8)))
        kv.flush()  # publishes a snapshot
        assert "NaN" in (tmp_path / LIVE_DIR / STATS_FILE).read_text()
        r = run("stats", "--dir", str(tmp_path))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout, parse_constant=_no_constants)
        assert out["stats"]["prefetch"]["accuracy"] is None
        assert out["stats"]["prefetch"]["issued"] == 0
    finally:
        kv.close()
