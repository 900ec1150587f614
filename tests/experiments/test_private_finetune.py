"""experiments.private_finetune: the summary of point results (means, Student-t CI, the gain
kept against the same method's non-private arm, the ε spent), resuming from written points
(nothing re-run, other settings refused), and -- slow -- ``--quick`` on ``chat:tiny`` writing every
output with the keys the issue's acceptance reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy import stats

from experiments import private_finetune as pf
from experiments.finetune_points import METHODS

EPS = {"1": 1.0, "3": 3.0, "8": 8.0, "inf": math.inf}
BASE = [20.0, 22.0]
"""Base perplexity per seed (0, 1)."""
PPL = {"1": 19.0, "3": 17.0, "8": 15.0, "inf": 10.0}
"""Perplexity per ε for seed 0; seed 1 adds 2 (mean = PPL + 1, per-seed spread sqrt(2))."""


def _point(method: str, e: str, seed: int) -> dict:
    return {"method": method, "epsilon": EPS[e], "seed": seed, "perplexity": PPL[e] + 2 * seed + (method == "lora"),
            "probe_accuracy": 0.5 + 0.1 * seed, "probe_margin": 1.0, "epsilon_example": None if e == "inf" else EPS[e] * 0.99,
            "noise_multiplier": 0.0 if e == "inf" else 1.0 / EPS[e], "upload_bytes": 1000 + seed,
            "upload_values": 100, "ckks_preset": "fedkv-2048", "train_s": 1.0, "wall_s": 2.0}


def _points() -> list[dict]:
    return [_point(m, e, s) for s in (0, 1) for m in METHODS for e in EPS]


def _bases() -> list[dict]:
    return [{"seed": s, "perplexity": BASE[s], "probe_accuracy": 0.7, "probe_margin": 2.0, "wall_s": 1.0}
            for s in (0, 1)]


def test_summary_means_ci_and_gain_kept() -> None:
    out = pf.summarise(_points(), _bases(), 1e-5)
    assert out["base"]["perplexity"] == pytest.approx(21.0)
    assert out["base"]["probe_score_mean"] == pytest.approx(0.7)
    half = stats.t.ppf(0.975, 1) * math.sqrt(2) / math.sqrt(2)  # two seeds 2 apart: sd sqrt(2)
    ffa = out["by_method"]["ffa_lora"]["by_epsilon"]
    assert set(ffa) == set(pf.EPSILONS)
    assert ffa["8"]["perplexity_mean"] == pytest.approx(16.0)
    assert ffa["8"]["perplexity_ci95"] == pytest.approx([16.0 - half, 16.0 + half])
    # gain kept: (base 21 - 16) / (base 21 - non-private 11) = 0.5; the non-private arm keeps 1
    assert ffa["8"]["gain_kept"] == pytest.approx(0.5)
    assert ffa["inf"]["gain_kept"] == pytest.approx(1.0)
    assert ffa["1"]["gain_kept"] == pytest.approx((21 - 20) / 10)
    # plain LoRA is 1 worse everywhere, measured against its own non-private arm (12)
    lora = out["by_method"]["lora"]["by_epsilon"]
    assert lora["8"]["gain_kept"] == pytest.approx((21 - 17) / (21 - 12))
    assert out["non_private"]["perplexity"] == pytest.approx(11.0)
    assert ffa["3"]["epsilon_example"] == pytest.approx(2.97) and ffa["inf"]["epsilon_example"] is None
    assert ffa["3"]["delta"] == 1e-5 and ffa["3"]["upload_bytes"] == 1001
    assert ffa["3"]["probe_score_mean"] == pytest.approx(0.55)
    json.dumps(out, allow_nan=False)  # strict JSON: undefined values are null


def test_no_gain_and_one_seed_are_null_not_nan() -> None:
    pts = [p | {"perplexity": 30.0} for p in _points() if p["seed"] == 0]
    out = pf.summarise(pts, _bases()[:1], 1e-5)
    ffa = out["by_method"]["ffa_lora"]["by_epsilon"]["8"]
    assert ffa["gain_kept"] is None  # fine-tuning made it worse: no gain to keep
    assert ffa["perplexity_ci95"] == [None, None]  # one seed: no interval
    assert pf.gain_kept(20.0, 25.0, 10.0) == pytest.approx(-0.5)
    json.dumps(out, allow_nan=False)


def _synthetic_run(tmp_path: Path) -> Path:
    """A run directory as ``--quick`` leaves it, with synthetic points (nothing to compute)."""
    args = pf.build_parser().parse_args(["--quick"])
    cfg, seeds, eps, methods = pf._config(args)
    run_dir = tmp_path / "run"
    (run_dir / "points").mkdir(parents=True)
    settings = pf.dataclasses.asdict(cfg) | {"seeds": seeds, "epsilons": eps, "methods": methods, "quick": True}
    (run_dir / "settings.json").write_text(json.dumps(settings))
    for p in _points():
        (run_dir / "points" / pf.point_name(p["method"], p["epsilon"], p["seed"])).write_text(json.dumps(p))
    for b in _bases():
        (run_dir / "points" / f"base-seed{b['seed']}.json").write_text(json.dumps(b))
    return run_dir


def test_resume_reads_every_written_point_and_runs_none(tmp_path, monkeypatch) -> None:
    run_dir = _synthetic_run(tmp_path)

    def refuse(*a, **k):
        raise AssertionError("a written point was run again")

    monkeypatch.setattr(pf, "run_point", refuse)
    monkeypatch.setattr(pf, "base_point", refuse)
    out = pf.main(["--quick", "--resume", str(run_dir)])
    assert out["by_method"]["ffa_lora"]["by_epsilon"]["8"]["gain_kept"] == pytest.approx(0.5)
    assert json.loads((run_dir / "results.json").read_text())["base"]["perplexity"] == pytest.approx(21.0)


def test_resume_with_other_settings_is_refused(tmp_path) -> None:
    run_dir = _synthetic_run(tmp_path)
    before = sorted(p.name for p in (run_dir / "points").iterdir())
    with pytest.raises(SystemExit, match="other settings.*aggregation"):
        pf.main(["--quick", "--aggregation", "plaintext", "--resume", str(run_dir)])
    with pytest.raises(SystemExit, match="no settings.json"):
        pf.main(["--quick", "--resume", str(tmp_path)])
    assert sorted(p.name for p in (run_dir / "points").iterdir()) == before


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown --epsilons"):
        pf._config(pf.build_parser().parse_args(["--epsilons", "1,2"]))
    with pytest.raises(SystemExit, match="5-10"):
        pf._config(pf.build_parser().parse_args(["--nodes", "3"]))


@pytest.mark.slow
def test_quick_writes_every_output(tmp_path, capsys) -> None:
    out = pf.main(["--quick", "--json", "--out", str(tmp_path)])
    run_dir = next((tmp_path / "private_finetune").iterdir())
    for name in ("results.json", "points.csv", "summary.md", "perplexity_vs_epsilon.png", "settings.json"):
        assert (run_dir / name).is_file(), name
    assert len(list((run_dir / "points").glob("*.json"))) == 2 * len(METHODS) * len(pf.EPSILONS) + 2
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["aggregation"] == "ckks" and saved["wall_s"] > 0 and saved["settings"]["chat_model"] == "tiny"
    assert saved["base"]["perplexity"] > 1 and saved["non_private"]["perplexity"] > 1
    for method in METHODS:
        by_eps = saved["by_method"][method]["by_epsilon"]
        assert set(by_eps) == {"1", "3", "8", "inf"}
        for e, v in by_eps.items():
            assert {"perplexity_mean", "perplexity_ci95", "gain_kept", "epsilon_example", "delta",
                    "upload_bytes", "probe_score_mean"} <= set(v)
            assert v["perplexity_mean"] > 1 and len(v["perplexity_ci95"]) == 2 and v["upload_bytes"] > 0
            assert 0 <= v["probe_score_mean"] <= 1
            if e != "inf":
                assert 0 < v["epsilon_example"] <= float(e) * 1.01  # the accountant's ε within the target
    # plain LoRA sends A as well as B
    assert (saved["by_method"]["lora"]["by_epsilon"]["8"]["upload_values"]
            > saved["by_method"]["ffa_lora"]["by_epsilon"]["8"]["upload_values"])
    assert out == saved
    assert '"by_method"' in capsys.readouterr().out
