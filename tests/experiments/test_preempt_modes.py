"""experiments.preempt_modes: a tiny run measures both modes, really preempts, and both give the
same greedy tokens."""

import json

import pytest

from experiments import preempt_modes


def test_a_quick_run_preempts_in_both_modes_and_agrees(tmp_path, capsys):
    res = preempt_modes.main(["--quick", "--repeats", "1", "--out", str(tmp_path), "--json"])
    swap, rec = res["modes"]["swap"], res["modes"]["recompute"]
    assert swap["preemptions"] > 0 and rec["preemptions"] > 0
    assert swap["resume_cached_tokens"] > 0 and rec["resume_cached_tokens"] == 0
    assert swap["resume_reused_tokens"] > 0 and rec["resume_reused_tokens"] == 0
    assert res["same_outputs"]
    assert swap["tokens_per_s"] > 0 and rec["resume_ms"] > 0
    assert set(res["ratios"]) == {"throughput_swap_vs_recompute", "resume_ms_swap_vs_recompute"}
    (d,) = (tmp_path / "preempt_modes").iterdir()
    assert {"results.json", "summary.md"} <= {p.name for p in d.iterdir()}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["repeats"] == 1


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--requests", "1"]])
def test_bad_arguments_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        preempt_modes.main(argv + ["--out", str(tmp_path)])
