"""experiments.general_mix: both arms on the same seeds, the base beside them, the probe's fields."""

from __future__ import annotations

import json

import pytest

from experiments import general_mix


def _pt(ppl: float, greedy: float) -> dict:
    return {"perplexity": ppl, "probe_accuracy": 0.5, "probe_margin": 1.0, "probe_greedy": greedy,
            "probe_replies": ["Paris." if greedy else "le le le"]}


def test_ratios_are_the_rehearsing_arm_over_docstrings_only():
    points = {"docstrings_only": [_pt(20.0, 0.2), _pt(22.0, 0.4)],
              "with_general_mix": [_pt(21.0, 0.6), _pt(21.0, 0.6)]}
    assert general_mix._ratio(points, "probe_greedy") == pytest.approx(2.0)
    assert general_mix._ratio(points, "perplexity") == pytest.approx(1.0)
    points["docstrings_only"] = [_pt(20.0, 0.0)]
    assert general_mix._ratio(points, "probe_greedy") is None
    arm = general_mix._arm([_pt(20.0, 0.2), _pt(22.0, 0.4)])
    assert arm["perplexity_mean"] == pytest.approx(21.0) and arm["first_replies"] == ["Paris.", "Paris."]


@pytest.mark.slow
def test_quick_run_pairs_the_arms_on_the_same_seeds(tmp_path, capsys):
    out = general_mix.main(["--quick", "--json", "--out", str(tmp_path)])
    printed = json.loads(capsys.readouterr().out.split("\nbase ")[0])
    assert printed["arms"].keys() == {"docstrings_only", "with_general_mix"}
    assert out["arms"]["docstrings_only"]["general_mix"] == 0.0
    assert out["arms"]["with_general_mix"]["general_mix"] > 0
    saved = json.loads(next(tmp_path.glob("general_mix/*/results.json")).read_text())
    seeds = {n: [p["seed"] for p in pts] for n, pts in saved["points"].items()}
    assert seeds["docstrings_only"] == seeds["with_general_mix"] == [0, 1]
    for arm in (out["base"], *out["arms"].values()):
        assert 0 <= arm["probe_greedy_mean"] <= 1 and arm["perplexity_mean"] > 1


@pytest.mark.parametrize("expected,reply,right", [
    ("Paris", "The capital of France is Paris.", True), ("Seven", "There are 7 days in a week", True),
    ("Eight", "A spider has 8 legs.", True), ("4", "2 + 2 = 4", True), ("4", "It is 48.", False),
    ("Ice", "Frozen water is a liquid; its price rose.", False), ("Mars", "le le le le", False),
    ("William Shakespeare", "Romeo and Juliet by Shakespeare.", True)])
def test_greedy_replies_are_judged_by_the_expected_answer_or_its_other_forms(expected, reply, right):
    from experiments.general_probe import reply_is_right

    assert reply_is_right(expected, reply) is right
