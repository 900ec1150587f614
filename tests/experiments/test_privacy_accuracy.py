"""experiments.privacy_accuracy on a tiny configuration: the output files, the CSV columns, finite
values (ε = ∞ points excepted where ∞ is the truth), the noise calibration. Never asserts a timing."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import privacy_accuracy as pa

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--epsilons", "8,inf", "--populations", "6", "--rounds", "2", "--modes", "distributed,local"]


def _run(args, out: Path, timeout: int = 240):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "experiments.privacy_accuracy", *args, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("results: "), last
    run_dir = Path(last.removeprefix("results: "))
    assert run_dir.parent == (out / "privacy_accuracy").resolve() and run_dir.is_dir()
    return proc, run_dir


def test_tiny_sweep_writes_every_output(tmp_path: Path) -> None:
    proc, run_dir = _run(TINY, tmp_path)
    first = proc.stdout.strip().splitlines()[0]
    assert first.startswith("expected duration of 4 points: ~") and "measured" in first, first
    with (run_dir / "points.csv").open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        header = reader.fieldnames
    for col in ("task", "mode", "population", "clients_per_round", "rounds", "target_epsilon",
                "noise_multiplier", "epsilon_spent", "accuracy", "mia_auc", "seconds", "round_s"):
        assert col in header, col
    assert len(rows) == 4
    assert {(r["mode"], r["target_epsilon"]) for r in rows} == {
        ("distributed", "8.0"), ("distributed", "inf"), ("local", "8.0"), ("local", "inf")}
    for r in rows:
        assert r["task"] == "digits" and r["status"] == "completed"
        assert int(r["population"]) == 6 and int(r["clients_per_round"]) == 6 and int(r["rounds"]) == 2
        for col in ("accuracy", "mia_auc", "seconds", "noise_multiplier", "fed_metric"):
            assert math.isfinite(float(r[col])), (col, r)
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and 0.0 <= float(r["mia_auc"]) <= 1.0
        if r["target_epsilon"] == "inf":
            assert float(r["noise_multiplier"]) == 0.0 and float(r["epsilon_spent"]) == math.inf
        else:
            sigma, spent = float(r["noise_multiplier"]), float(r["epsilon_spent"])
            assert sigma > 0 and math.isfinite(spent)
            # the chosen sigma reaches the target (Opacus' search tolerance) without overshooting much
            assert 7.5 < spent <= 8.0 + 1e-6, spent
    # without noise, local and distributed are the same computation (up to CKKS' approximation
    # error, fresh randomness per encryption, which may flip a near-tie prediction)
    inf = {r["mode"]: float(r["accuracy"]) for r in rows if r["target_epsilon"] == "inf"}
    assert inf["distributed"] == pytest.approx(inf["local"], abs=0.02)
    for name in ("summary.md", "accuracy_vs_epsilon_pop6.png", "mia_auc_vs_epsilon_pop6.png"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    summary = (run_dir / "summary.md").read_text()
    assert "| distributed |" in summary and "| local |" in summary

    # --replot rebuilds summary and plots from points.csv alone (an interrupted run)
    (run_dir / "summary.md").unlink()
    (run_dir / "accuracy_vs_epsilon_pop6.png").unlink()
    assert pa.main(["--replot", str(run_dir)]) == 0
    assert (run_dir / "summary.md").read_text().count("| distributed |") == 2
    assert (run_dir / "accuracy_vs_epsilon_pop6.png").stat().st_size > 0
    assert pa.read_rows(run_dir / "points.csv")[0]["population"] == 6


def test_sigma_for_reaches_the_target() -> None:
    from crypto import PrivacyAccountant

    sigma = pa.sigma_for("distributed", 4.0, 1e-5, rounds=10, cpr=10, population=100,
                         train_sizes=None, local_epochs=2)
    acc = PrivacyAccountant("rdp")
    acc.step(sigma, 0.1, steps=10)
    assert acc.epsilon(1e-5) == pytest.approx(4.0, rel=0.02)
    assert pa.sigma_for("local", math.inf, 1e-5, 10, 10, 100, None, 2) == 0.0
    # dp-sgd: the worst node (fewest batches -> largest sampling rate) sets sigma
    s_small = pa.sigma_for("dp-sgd", 4.0, 1e-5, 5, 5, 5, [20], local_epochs=2)
    s_mixed = pa.sigma_for("dp-sgd", 4.0, 1e-5, 5, 5, 5, [20, 200], local_epochs=2)
    assert s_mixed == pytest.approx(max(s_small, pa.sigma_for("dp-sgd", 4.0, 1e-5, 5, 5, 5, [200], 2)))
    acc = PrivacyAccountant("rdp")
    acc.step(s_mixed, 1.0, steps=1 * 2 * 5)  # 20 samples = 1 batch of 32: q = 1
    assert acc.epsilon(1e-5) <= 4.0 + 1e-6


def test_fraction_and_flags() -> None:
    assert pa.fraction_for(10, 100) == 0.1
    assert pa.clients_per_round(6, 10) == 6 and pa.clients_per_round(100, 10) == 10
    assert pa.parse_floats("1, 8,inf") == [1.0, 8.0, math.inf]
    with pytest.raises(Exception):
        pa.parse_floats("0")
    with pytest.raises(Exception):
        pa.parse_modes("distributed,central")
    args = pa.build_parser().parse_args(["--rounds", "3"])
    rc = pa.run_config_for(args, "flower-central", 100, 10, 0.5, 0, 50.0)
    assert rc["he"] is False and rc["dp-mode"] == "flower-central" and rc["fraction-train"] == 0.1
    rc = pa.run_config_for(args, "dp-sgd", 100, 10, 0.5, 0, 50.0)
    assert rc["he"] is True and rc["dp-sgd"] is True and rc["dp-mode"] == "none" and rc["max-weight"] == 50.0
