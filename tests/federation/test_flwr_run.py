"""End to end through the real CLI: ``flwr run <app> --stream`` (simulation, Ray).

he=true, 3 nodes, 2 rounds, digits: enroll + provision, CKKS updates, signatures, DP
accounting, results file. Other end-to-end tests should use the ``flwr_cli`` fixture from
conftest.py; this one uses the context manager directly so it can also check, after
cleanup, that nothing it started is still running.
"""

from __future__ import annotations

import json

import pytest

from federation.deploy.flwr_sandbox import alive, flwr_sandbox
from federation.results import SCHEMA


@pytest.mark.slow  # end-to-end (21 s quiet, 68 s loaded): .ci/run's main job and slow step run the CLI;
# tests/federation/test_local.py::test_run_local_digits_he_learns_and_writes_params_back runs the same round in process
def test_flwr_run_digits_he(tmp_path) -> None:
    """he=true through the real CLI: enroll + provision, CKKS updates, signed, DP accounting."""
    results_dir = tmp_path / "results"
    guard = tmp_path / "secret-guard.log"
    with flwr_sandbox(tmp_path / "sandbox") as box:
        box.env["FEDKV_SECRET_GUARD_LOG"] = str(guard)  # every process records its secret contexts
        run = box.run(
            num_supernodes=3,
            run_config={"num-server-rounds": 2, "task": "digits", "he": True, "dp-mode": "distributed",
                        "noise-multiplier": 0.01, "results-dir": str(results_dir)},
        )
        assert run.returncode == 0, run.output[-4000:]
        assert run.superlink_pids, "flwr run should have started our own SuperLink"
        started = run.superlink_pids + run.family
    # after the sandbox: our SuperLink and all its descendants (Ray) are gone
    assert not [p for p in started if alive(p)]

    assert run.results_path is not None, run.output[-4000:]
    assert run.results_path.is_absolute() and run.results_path.parent == results_dir
    data = json.loads(run.results_path.read_text())
    assert data["status"] == "completed", data["status"]
    assert data["mode"] == "he" and data["schema"] == SCHEMA
    assert data["config"]["num-server-rounds"] == 2 and data["config"]["he"] is True
    prov = data["provisioning"]
    assert prov["enrolled"] == 3 and prov["provisioned"] == 2 and prov["refused"] == 0  # + 1 key maker
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    assert len(data["rounds"][0]["admitted"]) == 3 and data["rounds"][1]["admitted"] == []
    for r in data["rounds"]:
        assert r["num_clients"] == 3 and r["eval_clients"] == 3 and r["dropped"] == []
        # one seeded CKKS ciphertext (4,810 values < 12,288 per ciphertext) + signature framing
        assert len(r["upload_bytes"]) == 3 and all(30_000 < b < 40_000 for b in r["upload_bytes"].values())
        assert 60_000 < r["aggregate_bytes"] < 70_000
        assert r["eval_loss"] is not None and 0.0 <= r["eval_metric"] <= 1.0
        assert {"train", "encrypt", "sign", "aggregate", "verify", "decrypt", "writeback"} <= set(r["seconds"])
        assert r["clipped_fraction"] is None and r["train_loss"] is None  # private under DP: not sent
    eps = [r["epsilon_client"] for r in data["rounds"]]
    assert 0 < eps[0] < eps[1]
    assert data["rounds"][1]["eval_loss"] < data["rounds"][0]["eval_loss"]
    assert "fedkv round 2/2" in run.output

    # the claim "the ServerApp process never holds the secret key", checked on the real processes:
    # a node made the key, and no creation or parse of a secret context happened in the server's pid
    assert data["key_origin"]["party"] == "node" and data["provisioning"]["enrollment"] == "tofu"
    events = [line.split() for line in guard.read_text().splitlines()]
    assert any(e[1] == "create" for e in events) and len({e[2] for e in events}) == 1
    server_pid = data["server_pid"]
    assert server_pid > 0 and all(int(e[0]) != server_pid for e in events), (server_pid, events)
    assert "no meaningful" in data["privacy_claim"] or "client-level" in data["privacy_claim"]
