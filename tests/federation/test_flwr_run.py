"""End to end through the real CLI: ``flwr run <app> --stream`` (simulation, Ray).

Other end-to-end tests (he=true, DP modes) should use the ``flwr_cli`` fixture from
conftest.py; this one uses the context manager directly so it can also check, after
cleanup, that nothing it started is still running.
"""

from __future__ import annotations

import json

import pytest

from tests.federation.flwr_cli import alive, flwr_sandbox


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flwr_run_digits_plaintext(tmp_path) -> None:
    results_dir = tmp_path / "results"
    with flwr_sandbox(tmp_path / "sandbox") as box:
        run = box.run(
            num_supernodes=3,
            run_config={"num-server-rounds": 2, "task": "digits", "he": False,
                        "results-dir": str(results_dir)},
        )
        assert run.returncode == 0, run.output[-4000:]
        assert run.superlink_pids, "flwr run should have started our own SuperLink"
        started = run.superlink_pids + run.family
    # after the sandbox: our SuperLink and all its descendants (Ray) are gone
    assert not [p for p in started if alive(p)]

    assert run.results_path is not None, run.output[-4000:]
    assert run.results_path.is_absolute() and run.results_path.parent == results_dir
    data = json.loads(run.results_path.read_text())
    assert data["status"] == "completed"
    assert data["mode"] == "plain"
    assert data["config"]["num-server-rounds"] == 2
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    for r in data["rounds"]:
        assert r["num_clients"] == 3 and r["eval_clients"] == 3 and r["dropped"] == []
        assert len(r["upload_bytes"]) == 3 and all(b > 0 for b in r["upload_bytes"].values())
        assert r["eval_loss"] is not None and 0.0 <= r["eval_acc"] <= 1.0
        assert {"train", "encrypt", "aggregate", "decrypt", "writeback"} <= set(r["seconds"])
    assert data["rounds"][1]["eval_loss"] < data["rounds"][0]["eval_loss"]
    assert "fedkv round 2/2" in run.output
