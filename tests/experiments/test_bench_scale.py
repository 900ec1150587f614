"""experiments.bench_scale: medians over repeats, peak memory of a real process family."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from experiments.bench_scale import PeakMemory, _median_point, _rss_bytes, main


def test_median_point_takes_each_figure_over_repeats() -> None:
    runs = [{"nodes": 5, "wall_s": w, "s_per_round": w / 2, "provision_s": 1.0, "peak_rss_mb": m,
             "node_dirs_mb": 3.0, "status": "completed"} for w, m in ((30.0, 100.0), (10.0, 300.0), (20.0, 200.0))]
    p = _median_point(runs)
    assert (p["wall_s"], p["s_per_round"], p["peak_rss_mb"]) == (20.0, 10.0, 200.0)
    assert p["status"] == "completed"
    assert _median_point(runs[:1] + [{**runs[1], "status": "failed"}])["status"] == "completed,failed"


def test_rss_of_this_process_is_positive_and_of_a_dead_pid_zero() -> None:
    assert _rss_bytes(os.getpid()) > 10 * 2**20
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert _rss_bytes(proc.pid) == 0


def test_peak_memory_sees_nothing_without_a_superlink(tmp_path) -> None:
    with PeakMemory(tmp_path, every_s=0.01) as mem:
        time.sleep(0.05)
    assert mem.peak == 0


@pytest.mark.slow
def test_bench_scale_measures_a_real_run() -> None:
    out = main(["--nodes", "3", "--task", "digits", "--rounds", "1"])
    (point,) = out["series"]["this"]
    assert point["status"] == "completed" and point["peak_rss_mb"] > 100 and point["eval_clients"] == [3]
