"""docs/privacy.md's private fine-tuning and client-level population figures, recomputed from
the results the runs wrote (kept in docs/figures/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.client_dp_population import summarise

FIG = Path(__file__).resolve().parents[2] / "docs" / "figures"
DOC = (FIG.parent / "privacy.md").read_text(encoding="utf-8")


def test_fine_tuning_table_matches_the_runs_results():
    r = json.loads((FIG / "private_finetune_smollm2.json").read_text())
    for label, method in (("FFA-LoRA", "ffa_lora"), ("plain LoRA", "lora")):
        row = next(line for line in DOC.splitlines() if line.startswith(f"| {label} |"))
        by = r["by_method"][method]["by_epsilon"]
        for e in ("1", "3", "8"):
            assert f"{by[e]['perplexity_mean']:.2f}" in row and f"kept {by[e]['gain_kept']:.2f}" in row, (label, e)
        assert f"{by['inf']['perplexity_mean']:.2f}" in row and f"{by['8']['upload_bytes']:,} B" in row
        assert by["8"]["epsilon_example"] <= 8.0 and by["8"]["delta"] == 1e-5
    assert f"{r['base']['perplexity']:.2f}" in DOC and r["aggregation"] == "ckks"
    assert len(r["settings"]["seeds"]) == 3


@pytest.mark.parametrize("population", [10, 100, 1000])
def test_population_table_matches_the_runs_results(population):
    r = json.loads((FIG / f"client_dp_population_{population}.json").read_text())
    by = summarise(r["points"])  # the script's own paired ratios, from the stored points
    label = f"{population:,} ({r['settings']['per_round']})"
    row = next(line for line in DOC.splitlines() if line.startswith(f"| {label} |"))
    assert f"{by['8']['noise_multiplier']:.2f}" in row
    if population >= 100:
        ratios = sorted(p["perplexity"] / next(q["perplexity"] for q in r["points"]
                                               if q["epsilon"] == "inf" and q["seed"] == p["seed"])
                        for p in r["points"] if p["epsilon"] == "8")
        shown = sorted(float(x) for x in re.findall(r"×([0-9.]+)", row.split("|")[5]))
        assert shown == pytest.approx(ratios, abs=0.006)
    else:
        assert all(p["perplexity"] > 1e5 for p in r["points"] if p["epsilon"] != "inf")
