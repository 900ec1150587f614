"""experiments.privacy_accuracy on a tiny configuration: the output files, the CSV columns (seed
count, mean, CI, accountant ε with and without amplification, audit ε), finite values (ε = ∞
points excepted where ∞ is the truth), the noise calibration, the audit below the accountant.
Never asserts a timing."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import privacy_accuracy as pa
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--epsilons", "8,inf", "--populations", "8", "--clients-per-round", "4", "--rounds", "2",
        "--modes", "distributed,local", "--seeds", "2", "--audit-trials", "60"]


def _run(args, out: Path, timeout: float = HANG_GUARD_S):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "experiments.privacy_accuracy", *args, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("results: "), last
    run_dir = Path(last.removeprefix("results: "))
    assert run_dir.parent == (out / "privacy_accuracy").resolve() and run_dir.is_dir()
    return proc, run_dir


def _csv(path: Path) -> tuple[list[dict[str, str]], list[str]]:
    with path.open() as fh:
        reader = csv.DictReader(fh)
        return list(reader), list(reader.fieldnames or [])


@pytest.mark.slow  # end-to-end (86 s loaded): .ci/run's slow step; the unit tests below cover its parts
def test_tiny_sweep_writes_every_output(tmp_path: Path) -> None:
    proc, run_dir = _run(TINY, tmp_path)
    first = proc.stdout.strip().splitlines()[0]
    assert first.startswith("expected duration of 4 points x 2 seeds: ~") and "measured" in first, first
    runs, _ = _csv(run_dir / "runs.csv")
    assert len(runs) == 8 and {r["seed"] for r in runs} == {"0", "1"}
    rows, header = _csv(run_dir / "points.csv")
    for col in ("n_seeds", "accuracy_mean", "accuracy_ci_low", "accuracy_ci_high", "epsilon_accountant",
                "epsilon_server", "epsilon_node", "epsilon_colluding", "audit_epsilon", "canary_eps_lower",
                "mia_auc_mean", "mia_auc_ci_low", "mia_auc_ci_high"):
        assert col in header, col
    assert len(rows) == 4
    assert {(r["mode"], r["target_epsilon"]) for r in rows} == {
        ("distributed", "8.0"), ("distributed", "inf"), ("local", "8.0"), ("local", "inf")}
    for r in rows:
        assert r["task"] == "digits" and r["completed"] == "2" and r["n_seeds"] == "2"
        assert int(r["population"]) == 8 and int(r["clients_per_round"]) == 4 and int(r["rounds"]) == 2
        lo, mean, hi = (float(r[f"accuracy_{k}"]) for k in ("ci_low", "mean", "ci_high"))
        assert lo <= mean <= hi and 0.0 <= mean <= 1.0
        assert 0.0 <= float(r["mia_auc_mean"]) <= 1.0
        audit = float(r["audit_epsilon"])
        if r["target_epsilon"] == "inf":
            assert float(r["noise_multiplier"]) == 0.0 and float(r["epsilon_accountant"]) == math.inf
            assert audit >= 10.0  # no noise: the canary is plainly visible
        else:
            sigma, spent = float(r["noise_multiplier"]), float(r["epsilon_accountant"])
            assert sigma > 0 and math.isfinite(spent)
            # the chosen sigma reaches the target (the search tolerance) without overshooting
            assert 7.5 < spent <= 8.0 + 1e-6, spent
            assert spent <= float(r["epsilon_server"])  # 4 of 8 sampled: amplification helps
            # key holders know their own shares: less noise left (distributed); local: σ each
            server, node, t_nodes = (float(r[f"epsilon_{o}"]) for o in ("server", "node", "colluding"))
            if r["mode"] == "distributed":
                assert server < node < t_nodes
            else:
                assert server == node == t_nodes
            assert float(r["canary_eps_lower"]) <= audit
            assert 0.0 <= audit < spent  # an audit above the accountant would be a bug
    for name in ("summary.md", "accuracy_vs_client_epsilon_pop8.png", "mia_auc_vs_client_epsilon_pop8.png"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    summary = (run_dir / "summary.md").read_text()
    assert "| distributed |" in summary and "| local |" in summary and "only 2 seed(s)" in summary
    assert "audit check: every audit ε is at or below" in summary

    # --replot rebuilds points, summary and plots from runs.csv alone (an interrupted run)
    (run_dir / "summary.md").unlink()
    (run_dir / "accuracy_vs_client_epsilon_pop8.png").unlink()
    assert pa.main(["--replot", str(run_dir), "--audit-trials", "60"]) == 0
    assert (run_dir / "summary.md").read_text().count("| distributed |") == 2
    assert (run_dir / "accuracy_vs_client_epsilon_pop8.png").stat().st_size > 0
    assert pa.read_rows(run_dir / "runs.csv")[0]["population"] == 8


@pytest.mark.slow  # end-to-end (40-125 s): .ci/run runs it in its slow step
def test_quick_mode_as_the_issue_names_it(tmp_path: Path) -> None:
    """The acceptance command itself, ``--quick``: 2 seeds and it says so, every mode of the quick
    set, the columns, and no audit above its accountant (LiRA at the dp-sgd points included)."""
    proc, run_dir = _run(["--quick"], tmp_path)
    assert proc.stdout.splitlines()[0].startswith("expected duration of")
    rows, header = _csv(run_dir / "points.csv")
    for col in ("n_seeds", "accuracy_mean", "accuracy_ci_low", "accuracy_ci_high", "epsilon_accountant",
                "epsilon_server", "audit_epsilon", "lira_auc_mean", "lira_epsilon_lb_max"):
        assert col in header, col
    assert {r["mode"] for r in rows} == set(pa.QUICK_MODES) and {r["n_seeds"] for r in rows} == {"2"}
    summary = (run_dir / "summary.md").read_text()
    assert "quick mode: only 2 seed(s)" in summary and "audit check: every audit ε is at or below" in summary
    for r in rows:
        if r["target_epsilon"] != "inf" and r["mode"] != "dp-sgd":  # dp-sgd's audit is LiRA
            assert float(r["audit_epsilon"]) < float(r["epsilon_accountant"])
        if r["mode"] == "dp-sgd":
            assert float(r["lira_epsilon_lb_max"]) <= float(r["epsilon_accountant"])


def test_mean_ci_and_audit_failures() -> None:
    m, lo, hi = pa.mean_ci([0.5, 0.7])
    assert m == pytest.approx(0.6) and lo < 0.5 and hi > 0.7  # t(1): 12.7 x 0.1/sqrt(2) half-width
    assert hi - m == pytest.approx(12.7062 * 0.1414 / math.sqrt(2), rel=1e-3)
    assert math.isnan(pa.mean_ci([0.5])[1]) and math.isnan(pa.mean_ci([math.nan])[0])
    bad = {"mode": "distributed", "population": 10, "target_epsilon": 4.0, "audit_epsilon": 5.0,
           "epsilon_accountant": 4.0}
    assert pa.audit_failures([bad]) and not pa.audit_failures([{**bad, "audit_epsilon": 3.0}])
    assert pa.audit_sigma("local", 1.0, 4) == 2.0 and pa.audit_sigma("distributed", 1.0, 4) == 1.0


def test_sigma_for_reaches_the_target() -> None:
    from crypto import dp_sgd_epsilon

    from federation.client_accounting import ClientAccountant

    for sampling in ("fixed", "poisson"):
        sigma = pa.sigma_for("distributed", 4.0, 1e-5, rounds=10, cpr=10, population=100,
                             train_sizes=None, local_epochs=2, client_sampling=sampling)
        acc = ClientAccountant(sampling, 100, 1e-5)
        acc.step(sigma, 10, 10)
        assert acc.epsilon() == pytest.approx(4.0, rel=0.02)
    # flower-central samples a fixed k whatever fedkv's sampler is
    assert pa.sigma_for("flower-central", 4.0, 1e-5, 10, 10, 100, None, 2, client_sampling="poisson") == \
        pa.sigma_for("distributed", 4.0, 1e-5, 10, 10, 100, None, 2, client_sampling="fixed")
    assert pa.sigma_for("local", math.inf, 1e-5, 10, 10, 100, None, 2) == 0.0
    # dp-sgd: the worst node (fewest batches -> largest sampling rate) sets sigma
    s_small = pa.sigma_for("dp-sgd", 4.0, 1e-5, 5, 5, 5, [20], local_epochs=2)
    s_mixed = pa.sigma_for("dp-sgd", 4.0, 1e-5, 5, 5, 5, [20, 200], local_epochs=2)
    assert s_mixed == pytest.approx(max(s_small, pa.sigma_for("dp-sgd", 4.0, 1e-5, 5, 5, 5, [200], 2)))
    assert dp_sgd_epsilon(s_mixed, 1.0, 1 * 2 * 5, 1e-5) <= 4.0 + 1e-6  # 20 samples = 1 batch of 32: q = 1


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
    assert rc["client-sampling"] == "fixed" and rc["sampler-seed"] == 0 and rc["adaptive-clipping"] is False
    rc = pa.run_config_for(args, "flower-adaptive", 100, 10, 0.5, 0, 50.0)
    assert rc["dp-mode"] == "flower-central" and rc["adaptive-clipping"] is True and rc["he"] is False
    args = pa.build_parser().parse_args(["--client-sampling", "poisson"])
    rc = pa.run_config_for(args, "distributed", 100, 10, 0.5, 3, 50.0)
    assert rc["client-sampling"] == "poisson" and rc["sampler-seed"] == 3
    assert rc["min-clients"] == 5 and rc["max-clients"] == 19  # 10 + 3 sd (sd = 3) of Binomial(100, 0.1)
    rc = pa.run_config_for(args, "dp-sgd", 100, 10, 0.5, 0, 50.0)
    assert rc["he"] is True and rc["dp-sgd"] is True and rc["dp-mode"] == "none" and rc["max-weight"] == 50.0


DP_SGD = ["--epsilons", "8,inf", "--populations", "6", "--clients-per-round", "3", "--rounds", "2",
          "--modes", "dp-sgd", "--seeds", "2", "--audit-trials", "20", "--lira-models", "4", "--lira-pool", "40",
          "--no-estimate"]


@pytest.mark.slow  # end-to-end (66 s loaded): .ci/run's slow step; the LiRA unit tests below cover its parts
def test_dp_sgd_sweep_has_lira_columns(tmp_path: Path) -> None:
    _, run_dir = _run(DP_SGD, tmp_path)
    runs, run_header = _csv(run_dir / "runs.csv")
    for col in ("lira_auc", "lira_auc_ci_low", "lira_auc_ci_high", "lira_tpr_at_0.1pct_fpr", "lira_epsilon_lb",
                "lira_models"):
        assert col in run_header, col
    for r in runs:
        assert r["lira_models"] == "4" and 0 < int(r["lira_pool"]) <= 40 and int(r["lira_steps"]) > 0
        lo, auc, hi = (float(r[k]) for k in ("lira_auc_ci_low", "lira_auc", "lira_auc_ci_high"))
        assert 0.0 <= lo <= auc <= hi <= 1.0 and 0.0 <= float(r["lira_tpr_at_0.1pct_fpr"]) <= 1.0
        assert float(r["lira_epsilon_lb"]) >= 0.0 and 0 < float(r["lira_sample_rate"]) <= 1.0
    points, header = _csv(run_dir / "points.csv")
    for col in ("lira_auc_mean", "lira_auc_ci_low", "lira_auc_ci_high", "lira_tpr_at_0.1pct_fpr_mean",
                "lira_epsilon_lb_max", "lira_models"):
        assert col in header, col
    for p in points:
        assert 0.0 <= float(p["lira_auc_mean"]) <= 1.0 and p["lira_models"] == "4"
        if p["target_epsilon"] != "inf":  # a lower bound above the accountant would be a bug
            assert float(p["lira_epsilon_lb_max"]) <= float(p["epsilon_accountant"])
    summary = (run_dir / "summary.md").read_text()
    assert "LiRA AUC [95% CI]" in summary and "audit check: every audit ε is at or below" in summary
    assert (run_dir / "lira_auc_vs_sample_epsilon_pop6.png").stat().st_size > 0


def test_client_level_runs_have_no_lira() -> None:
    row = pa.no_lira()
    assert set(pa.LIRA_COLUMNS) <= set(row) and math.isnan(row["lira_auc"]) and row["lira_models"] == 0
    base = {"mode": "dp-sgd", "population": 10, "target_epsilon": 4.0, "audit_epsilon": math.nan,
            "epsilon_accountant": 4.0}
    assert pa.audit_failures([{**base, "lira_epsilon_lb_max": 4.5}])[0].count("LiRA") == 1
    assert not pa.audit_failures([{**base, "lira_epsilon_lb_max": 1.0}])


def test_estimate_includes_lira() -> None:
    # 2-round calibration row: 2 s of rounds, 1.5 s LiRA of which 1 s training (4 models x 8 steps)
    row = {"round_s": 2.0, "seconds": 5.0, "lira_s": 1.5, "lira_train_s": 1.0, "lira_models": 4,
           "lira_steps": 8, "lira_sample_rate": 0.25}
    # setup 5 - 2 - 1.5; rounds 10 x 1 s; LiRA 1/32 s per step x 4 models x (4 x 2 x 10) steps + 0.5 s attack
    assert pa.lira_estimate(row, rounds=10, local_epochs=2) == pytest.approx(10.5)
    assert pa.run_estimate(row, rounds=10, local_epochs=2) == pytest.approx(1.5 + 10.0 + 10.5)
    assert pa.lira_estimate({**row, "lira_models": 0, "lira_steps": 0}, 10, 2) == 0.0


def test_full_run_prints_its_duration_before_the_first_point(monkeypatch, capsys, tmp_path: Path) -> None:
    seen: dict[str, object] = {}

    def calibrate(args, populations):
        seen.update(rounds=args.rounds, lira_models=args.lira_models, modes=list(args.modes))
        return 7200.0, "stub basis"

    def first_point(*args, **kwargs):
        seen["printed"] = capsys.readouterr().out
        raise KeyboardInterrupt  # stop before the first real run

    monkeypatch.setattr(pa, "calibrate", calibrate)
    monkeypatch.setattr(pa, "run_point", first_point)
    monkeypatch.setattr(pa, "make_run_dir", lambda out, script: tmp_path)
    with pytest.raises(KeyboardInterrupt):
        pa.main([])
    assert seen["rounds"] == 25 and seen["lira_models"] == 32 and seen["modes"] == list(pa.MODES)
    assert "expected duration of 90 points x 5 seeds: ~2.0 h" in str(seen["printed"])


def test_distributed_adaptive_is_distributed_plus_adaptive_clipping() -> None:
    assert "distributed-adaptive" in pa.MODES and "distributed-adaptive" not in pa.QUICK_MODES
    assert "distributed-adaptive" in pa.CLIENT_LEVEL
    for sampling in ("fixed", "poisson"):
        args = pa.build_parser().parse_args(["--client-sampling", sampling])
        plain = pa.run_config_for(args, "distributed", 100, 10, 0.5, 0, 50.0)
        adaptive = pa.run_config_for(args, "distributed-adaptive", 100, 10, 0.5, 0, 50.0)
        assert adaptive == {**plain, "adaptive-clipping": True}
        assert pa.sigma_for("distributed-adaptive", 4.0, 1e-5, 10, 10, 100, None, 2, client_sampling=sampling) == \
            pa.sigma_for("distributed", 4.0, 1e-5, 10, 10, 100, None, 2, client_sampling=sampling)
    assert pa.parse_modes("distributed-adaptive") == ["distributed-adaptive"]
