"""ServerApp main and the Flower-protocol (flower-central) handlers, in process."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from crypto import saturation_budget
from federation import client_app, protocol, server_app
from federation.codec import run_saturation_delta
from federation.config import RunConfig
from federation.results import SCHEMA
from federation.strategy import NotEnoughClients
from node.cache_node import build_model
from tests.federation.fakes import BASE_CONFIG, FakeGrid, make_context, raise_fault, set_server_identity


def server_context(run_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)


def test_server_main_writes_results_json(tmp_path, capsys) -> None:
    rc = {**BASE_CONFIG, "num-server-rounds": 2, "results-dir": str(tmp_path), "min-clients": 2}
    grid = FakeGrid(3, rc)
    server_app.main(grid, server_context(rc))
    (path,) = tmp_path.glob("run-1-*.json")
    assert f"FEDKV_RESULTS {path}" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["status"] == "completed" and data["schema"] == SCHEMA and data["mode"] == "plain"
    assert data["provisioning"]["enrolled"] == 3 and data["provisioning"]["provisioned"] == 0
    assert data["config"]["results-dir"] == str(tmp_path)
    r = data["rounds"][1]
    # he=false with dp-mode none clips too (issue 30.5): digits' updates (norm ~5) all exceed C = 1
    assert r["num_clients"] == 3 and r["clipped_fraction"] == 1.0
    assert set(r["seconds"]) >= {"train", "encrypt", "aggregate", "decrypt", "writeback", "train_phase"}


def test_server_main_stops_clearly_below_min_clients(tmp_path, caplog) -> None:
    rc = {**BASE_CONFIG, "num-server-rounds": 3, "results-dir": str(tmp_path), "min-clients": 3}
    grid = FakeGrid(3, rc)
    grid.faults[(100, protocol.TRAIN)] = raise_fault
    server_app.main(grid, server_context(rc))  # no traceback: one outcome line, the status in the file
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    last = caplog.records[-1].getMessage()
    assert last.startswith("fedkv: run FAILED (stopped: round 1: 2 usable update(s) < min-clients=3")
    assert last.endswith(f"results {next(tmp_path.glob('*.json'))}")
    assert data["status"].startswith("stopped: round 1: 2 usable update(s) < min-clients=3")
    assert len(data["rounds"]) == 0


def test_flower_central_runs_with_flowers_dp_wrapper(tmp_path) -> None:
    rc = {**BASE_CONFIG, "num-server-rounds": 2, "results-dir": str(tmp_path), "dp-mode": "flower-central",
          "clip-norm": 0.5, "noise-multiplier": 0.1}
    grid = FakeGrid(3, rc)
    server_app.main(grid, server_context(rc))
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["status"] == "completed" and data["mode"] == "flower-central"
    assert [r["num_clients"] for r in data["rounds"]] == [3, 3]
    assert all(r["eval_clients"] == 3 and 0 <= r["eval_metric"] <= 1 for r in data["rounds"])
    assert {m.metadata.message_type for m in grid.sent} == {"train", "evaluate"}
    eps = [r["epsilon_client"] for r in data["rounds"]]
    assert 0 < eps[0] < eps[1]


def test_fixedclipping_mod_clips_the_flower_train_reply() -> None:
    set_server_identity()
    ctx = make_context(7, 0, 3, {"lr": 0.5, "local-epochs": 2})
    start = build_model("digits", 42).state_dict()
    msg = Message(
        RecordDict({"arrays": ArrayRecord(start), "config": ConfigRecord({"clipping_norm": 0.01, "server-round": 1})}),
        dst_node_id=7, message_type="train",
    )
    reply = client_app.app(msg, ctx)
    assert not reply.has_error()
    before = np.concatenate([v.numpy().ravel() for v in start.values()])
    after = np.concatenate([a.ravel() for a in reply.content["arrays"].to_numpy_ndarrays()])
    assert np.linalg.norm(after - before) == pytest.approx(0.01, rel=1e-3)
    assert reply.content["metrics"]["clipped"] == 1


def test_train_on_a_node_that_was_never_enrolled_is_an_error() -> None:
    set_server_identity()
    ctx = make_context(7, 0, 3, dict(BASE_CONFIG))
    msg = Message(
        RecordDict({protocol.CONFIG: ConfigRecord({"server-round": 1, "target-version": 0, "num-sampled": 3})}),
        dst_node_id=7, message_type=protocol.TRAIN,
    )
    with pytest.raises(Exception, match="not enrolled"):
        client_app.app(msg, ctx)


def test_opaque_train_without_aggregates_for_a_behind_node_is_an_error() -> None:
    from federation import key_service

    set_server_identity()
    ctx = make_context(7, 0, 3, dict(BASE_CONFIG))
    key_service.node_keys(ctx, create=True)
    msg = Message(
        RecordDict({protocol.CONFIG: ConfigRecord({"server-round": 3, "target-version": 2, "num-sampled": 3})}),
        dst_node_id=7, message_type=protocol.TRAIN,
    )
    with pytest.raises(RuntimeError, match="server expects v2"):
        client_app.app(msg, ctx)


def test_server_main_he_run_writes_results_with_privacy_and_sizes(tmp_path) -> None:
    rc = {**BASE_CONFIG, "he": True, "dp-mode": "distributed", "num-server-rounds": 2,
          "results-dir": str(tmp_path), "noise-multiplier": 0.5}
    grid = FakeGrid(3, rc)
    server_app.main(grid, server_context(rc))
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["status"] == "completed" and data["mode"] == "he"
    prov = data["provisioning"]
    # simulation: node 100 (lowest id) made the key and wrapped it for the two others
    assert prov["enrollment"] == "tofu" and prov["provisioned"] == 2 and prov["refused"] == 0
    assert data["key_origin"] == {"party": "node", "node": 100, "epoch": 0} and data["key_rotations"] == 0
    assert data["privacy_claim"]
    enc = data["encoding"]
    assert enc["mode"] == "packed" and enc["max_weight"] == 1.0 and enc["clip_range"] > 0 and enc["dim"] == 4810
    assert data["rounds"][0]["admitted"] == [100, 101, 102] and data["rounds"][1]["admitted"] == []
    for r in data["rounds"]:
        assert r["num_clients"] == 3 and r["population"] == 3 and r["dropped"] == []
        assert set(r["upload_bytes"]) == {"100", "101", "102"}
        assert r["saturated_fraction"] is None and r["train_loss"] is None  # private under DP: not sent
        assert r["delta"] == 1e-5 and r["key_epoch"] == 0
        assert {"train", "encrypt", "sign", "aggregate", "verify", "decrypt", "writeback"} <= set(r["seconds"])
    assert 0 < data["rounds"][0]["epsilon_client"] < data["rounds"][1]["epsilon_client"]
    assert data["rounds"][0]["epsilon_sample"] is None  # no dp-sgd
    # δ of what runs: the derived range's saturation bound, charged by the coupling bound
    cfg = RunConfig.from_run_config(rc)
    dsat = run_saturation_delta(cfg, 4810)
    assert 0 < dsat <= saturation_budget(1e-5)
    for r in data["rounds"]:
        assert r["saturation_delta"] == pytest.approx(dsat, rel=1e-12)
        want = min(1.0, 1e-5 + (1 + math.exp(min(r["epsilon_client"], 700))) * dsat)  # ε here is large: 1
        assert r["delta_total"] == pytest.approx(want, rel=1e-12)
    types = {m.metadata.message_type for m in grid.sent}
    assert types == {"query.fedkv_enroll", "query.fedkv_keygen", "query.fedkv_provision", protocol.TRAIN,
                     protocol.EVALUATE}


def test_a_bad_run_config_writes_a_failed_results_file_before_anything_runs(tmp_path, caplog) -> None:
    rc = {**BASE_CONFIG, "results-dir": str(tmp_path), "noise-multiplier": float("nan"), "num-server-round": 3}
    grid = FakeGrid(3, {**BASE_CONFIG})
    server_app.main(grid, server_context(rc))  # not raised: Flower would add a traceback banner
    assert caplog.records[-1].getMessage().startswith("fedkv: run FAILED (failed: bad run config: ")
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["status"].startswith("failed: ") and "noise-multiplier" in data["status"]
    assert "num-server-round" in data["status"]  # the unknown key is named
    assert grid.sent == []  # nothing reached a node
