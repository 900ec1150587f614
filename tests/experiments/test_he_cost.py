"""experiments.he_cost on a tiny configuration: every output file, the CSV columns, finite values,
the size ordering of the modes (which does not depend on timing). Never asserts a timing.

The SecAgg+ baseline starts Ray (~15-30 s on 2 cores): the default test skips it (--no-secagg);
``test_secagg_baseline_end_to_end`` (marked slow) covers it, and checks no process of the child's
session survives. Cheap pieces of experiments.secagg_baseline are tested without Ray."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import he_cost, secagg_baseline
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--quick", "--sizes", "1e4,3e4", "--clients", "3", "--repeats", "1"]


def _run(args, tmp_path, timeout=HANG_GUARD_S):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "experiments.he_cost", *args, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("results: "), last
    run_dir = Path(last.removeprefix("results: "))
    assert run_dir.parent == (tmp_path / "he_cost").resolve() and run_dir.is_dir()
    return proc, run_dir


def _read_csv(path):
    with path.open() as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def _assert_finite(rows, text_columns=("mode",)):
    for row in rows:
        for k, v in row.items():
            if k in text_columns:
                continue
            x = float(v)
            assert math.isfinite(x) and x >= 0, (k, v, row)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _run([*TINY, "--no-secagg"], tmp_path_factory.mktemp("he_cost"))


def test_tiny_run_writes_every_output(tiny):
    proc, run_dir = tiny
    for name in ("points.csv", "summary.md", "bytes_per_param.png", "seconds_per_round.png", "meta.json"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    for png in ("bytes_per_param.png", "seconds_per_round.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run_dir / "secagg.csv").exists()
    assert "expected duration of this quick run: ~" in proc.stdout
    assert proc.stdout.index("expected duration") < proc.stdout.index("# HE cost vs model size")


def test_points_csv_columns_and_values(tiny):
    _, run_dir = tiny
    columns, rows = _read_csv(run_dir / "points.csv")
    assert tuple(columns) == he_cost.POINT_COLUMNS
    assert len(rows) == 2 * len(he_cost.MODES)
    assert {(int(r["params"]), r["mode"]) for r in rows} == {(d, m) for d in (10_000, 30_000) for m in he_cost.MODES}
    _assert_finite(rows)
    for r in rows:
        assert int(r["clients"]) == 3 and int(r["repeats"]) == 1 and int(r["saturated"]) == 0
        assert float(r["seconds_per_round"]) == pytest.approx(
            float(r["encrypt_s_per_client"]) + float(r["aggregate_s"]) + float(r["decrypt_s"]))
        assert int(r["upload_bytes_per_client"]) == round(float(r["bytes_per_param"]) * int(r["params"]))
    by = {(int(r["params"]), r["mode"]): float(r["bytes_per_param"]) for r in rows}
    for d in (10_000, 30_000):
        assert by[(d, "plaintext")] == pytest.approx(4.0, abs=0.01)
        assert by[(d, "fedkv_8bit")] < by[(d, "plaintext")] < by[(d, "fedkv_none")] < by[(d, "tenseal_default")]
        assert by[(d, "fedkv")] <= by[(d, "fedkv_8bit")]
    assert by[(30_000, "fedkv")] < 0.75 * by[(30_000, "fedkv_8bit")]  # 5 values per slot part, not 3
    err = {(int(r["params"]), r["mode"]): float(r["max_abs_error"]) for r in rows}
    assert err[(30_000, "fedkv_none")] < 1e-6 and err[(30_000, "tenseal_default")] < 1e-6
    assert err[(30_000, "fedkv_8bit")] < 0.05  # a few 8-bit quantization steps of [-1, 1]
    dense = he_cost.PackingConfig.dense(40, 3, 5, clip_range=1.0, max_weight=1000.0)
    assert err[(30_000, "fedkv")] < dense.step * 3  # the hard bound: step * clients / weight sum (>= 1.5)


def test_summary_and_meta(tiny):
    _, run_dir = tiny
    text = (run_dir / "summary.md").read_text()
    assert "| params | plaintext | tenseal_default | fedkv_none | fedkv_8bit | fedkv |" in text
    assert "| 30,000 |" in text and "nan" not in text.lower()
    assert "SecAgg+ baseline skipped (--no-secagg)" in text
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["sizes"] == [10_000, 30_000] and meta["clients"] == 3 and meta["secagg"]["sizes"] == []
    assert meta["estimate_seconds"] > 0 and meta["wall_seconds"] > 0


def test_mode_subset(tmp_path):
    _, run_dir = _run(["--quick", "--sizes", "2e4", "--clients", "2", "--repeats", "1", "--no-secagg",
                       "--modes", "fedkv,plaintext"], tmp_path)
    _, rows = _read_csv(run_dir / "points.csv")
    assert [r["mode"] for r in rows] == ["plaintext", "fedkv"]


@pytest.mark.parametrize("args, message", [
    (["--clients", "40"], "exceeds the packing headroom"),
    (["--secagg-clients", "2"], "must be >= 3"),
    (["--sizes", "1e4,abc"], "not a number"),
    (["--sizes", "0.5"], "positive integer"),
    (["--modes", "fedkv,rsa"], "unknown mode"),
])
def test_bad_arguments_are_rejected(tmp_path, args, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments.he_cost", "--quick", "--sizes", "1e4", *args,
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert not (tmp_path / "he_cost").exists() or not any((tmp_path / "he_cost").iterdir())


def test_parse_sizes():
    assert he_cost.parse_sizes("3e4, 1e4,1e4") == [10_000, 30_000]
    for bad in ("", "1e4,-5", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            he_cost.parse_sizes(bad)


def test_estimates_scale_with_size_and_clients():
    rates = {"data": {"per_value": [0.0, 1e-8]},
             "fedkv": {"encrypt": [0.01, 1e-7], "aggregate": [0.0, 5e-8], "decrypt": [0.001, 5e-8]}}
    small = he_cost.estimate_sweep(rates, [10_000], ["fedkv"], 10, 3)
    big = he_cost.estimate_sweep(rates, [10_000_000], ["fedkv"], 10, 3)
    assert 0 < small < big and math.isfinite(big)
    assert he_cost.estimate_point(rates, "fedkv", 10**6, 10, 1) == pytest.approx(
        10 * (0.01 + 0.1) + 10 * 0.05 + 0.001 + 0.05)
    assert he_cost.estimate_secagg([10**5, 10**6], 3) > he_cost.estimate_secagg([10**5], 3) > 0


def test_secagg_summary_counts_bytes_and_times():
    records = [{"direction": d, "stage": s, "node": node, "bytes": b}
               for node in (1, 2, 3) for _ in range(2)
               for d, s, b in (("download", "setup", 100), ("upload", "setup", 50),
                               ("upload", "collect_masked_vectors", 8000), ("upload", "unmask", 30))]
    lines = [{"node": node, "round": str(r), "stage": "x", "total_s": 0.5 + node, "fit_s": 0.5}
             for node in (1, 2, 3) for r in (1, 2)]
    rounds = [{"wall": 2.0, "server": 0.25}, {"wall": 3.0, "server": 0.35}]
    s = secagg_baseline._summarise("secaggplus", 1000, 3, 2, rounds, records, lines, 1e-7, 3, 2)
    assert s["upload_bytes_per_client_round"] == 8080 and s["upload_bytes_per_param"] == 8.08
    assert s["download_bytes_per_client_round"] == 100
    assert s["upload_bytes_by_stage"] == {"setup": 50, "collect_masked_vectors": 8000, "unmask": 30}
    assert s["seconds_per_round"] == 2.5 and s["client_protocol_seconds"] == 3.0
    assert s["protocol_seconds"] == pytest.approx(3.3)
    row = he_cost.secagg_row(s)
    assert row["mode"] == "flower_secaggplus" and row["upload_vector_bytes"] == 8000
    assert row["upload_keys_shares_bytes"] == 80 and set(row) == set(he_cost.SECAGG_COLUMNS)
    with pytest.raises(RuntimeError, match="clients"):
        secagg_baseline._summarise("secaggplus", 1000, 4, 2, rounds, records, lines, 0.0, 3, 2)
    with pytest.raises(RuntimeError, match="timing"):
        secagg_baseline._summarise("secaggplus", 1000, 3, 2, rounds, records, lines[:-1], 0.0, 3, 2)


def test_message_nbytes_counts_the_array_payload():
    # a Message needs a live run id; its RecordDict is counted the same way (nested objects)
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    def content(n):
        return RecordDict({"a": ArrayRecord([np.zeros(n, np.float32)]), "c": ConfigRecord({"k": b"x" * 1000})})

    small, big = secagg_baseline.message_nbytes(content(10)), secagg_baseline.message_nbytes(content(100_010))
    assert small > 1000
    assert 400_000 <= big - small < 400_000 + 64  # the payload (+ a longer shape in the npy header)


@pytest.mark.slow
def test_secagg_baseline_end_to_end(tmp_path):
    proc, run_dir = _run(["--quick", "--sizes", "1e4", "--clients", "3", "--repeats", "1", "--modes", "plaintext",
                          "--secagg-sizes", "1e4", "--secagg-rounds", "2", "--secagg-clients", "4"], tmp_path)
    columns, rows = _read_csv(run_dir / "secagg.csv")
    assert tuple(columns) == he_cost.SECAGG_COLUMNS
    assert [r["mode"] for r in rows] == ["flower_fedavg", "flower_secaggplus"]
    _assert_finite(rows)
    fedavg, secagg = ({k: float(v) for k, v in r.items() if k != "mode"} for r in rows)
    assert fedavg["clients"] == secagg["clients"] == 4 and fedavg["rounds"] == 2
    # FedAvg uploads the float32 vector (4 B/param); SecAgg+ the masked int64 vector (8 B/param) + keys/shares
    assert 4.0 < fedavg["upload_bytes_per_param"] < 4.3
    assert 8.0 < secagg["upload_bytes_per_param"] < 8.6
    assert secagg["upload_vector_bytes"] > 8 * 10_000 and secagg["upload_keys_shares_bytes"] > 0
    assert fedavg["upload_keys_shares_bytes"] == 0
    assert secagg["max_abs_error"] < 1e-5 and fedavg["max_abs_error"] < 1e-6  # both really aggregated
    assert (secagg["num_shares"], secagg["reconstruction_threshold"]) == (3, 2)
    assert "Flower SecAgg+ vs plain FedAvg" in (run_dir / "summary.md").read_text()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["secagg"]["returncode"] == 0 and meta["secagg"]["leftover_pids_stopped"] == []
    assert he_cost._session_pids(meta["secagg"]["child_pid"]) == []  # no Ray process left behind
