"""experiments.bench_index --quick --json: the last line is one JSON object with every key and
positive finite numbers. Never asserts timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_index
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
LOADS = {"50", "90"}


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_index", "--quick", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("section", ["top", "misses"])
def test_every_kind_has_p50_and_p99_at_both_loads(result, section):
    data = result if section == "top" else result["misses"]
    for kind in ("dict", "cuckoo"):
        assert set(data[kind]) == {"p50_ns", "p99_ns"}
        for stat in ("p50_ns", "p99_ns"):
            assert set(data[kind][stat]) == LOADS
            assert all(_positive_finite(v) for v in data[kind][stat].values()), data[kind]


def test_extra_keys(result):
    assert result["default"] in ("dict", "cuckoo") and result["faster"] in ("dict", "cuckoo")
    assert isinstance(result["default_is_faster"], bool)
    assert "perf_counter_ns" in result["timing"]
    assert result["quick"] is True and result["capacity"] == 4096
    assert result["n_keys"] == {"50": 2048, "90": 3686}
    assert result["load_factor"]["50"] == 0.5 and abs(result["load_factor"]["90"] - 0.9) < 1e-3
    for stat in ("p50_ns", "p99_ns"):
        assert set(result["ratio"][stat]) == LOADS
        assert all(_positive_finite(v) for v in result["ratio"][stat].values())
    assert all(_positive_finite(v) for v in result["loop_ns"].values())


def test_in_process_small_run(capsys):
    bench_index.main(["--json", "--size", "64", "--batches", "5", "--batch", "10"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["capacity"] == 64 and r["n_keys"] == {"50": 32, "90": 57}
    assert all(_positive_finite(r[k]["p50_ns"][l]) for k in ("dict", "cuckoo") for l in LOADS)
