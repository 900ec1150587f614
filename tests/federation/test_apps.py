"""ServerApp main and the Flower-protocol (flower-central) handlers, in process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from federation import client_app, protocol, server_app
from federation.strategy import NotEnoughClients
from node.federated import build_model
from tests.federation.fakes import FakeGrid, make_context, raise_fault, set_server_identity


def server_context(run_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)


def test_server_main_writes_results_json(tmp_path, capsys) -> None:
    rc = {"num-server-rounds": 2, "results-dir": str(tmp_path), "min-clients": 2}
    grid = FakeGrid(3, rc)
    server_app.main(grid, server_context(rc))
    (path,) = tmp_path.glob("run-1-*.json")
    assert f"FEDKV_RESULTS {path}" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["status"] == "completed" and data["schema"] == 1 and data["mode"] == "plain"
    assert data["config"]["results-dir"] == str(tmp_path)
    r = data["rounds"][1]
    assert r["num_clients"] == 3 and r["clipped_fraction"] == 0.0
    assert set(r["seconds"]) >= {"train", "encrypt", "aggregate", "decrypt", "writeback", "train_phase"}


def test_server_main_stops_clearly_below_min_clients(tmp_path) -> None:
    rc = {"num-server-rounds": 3, "results-dir": str(tmp_path), "min-clients": 3}
    grid = FakeGrid(3, rc)
    grid.faults[(100, protocol.TRAIN)] = raise_fault
    with pytest.raises(NotEnoughClients):
        server_app.main(grid, server_context(rc))
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["status"].startswith("stopped: round 1: 2 usable update(s) < min-clients=3")
    assert len(data["rounds"]) == 0


def test_flower_central_runs_with_flowers_dp_wrapper(tmp_path) -> None:
    rc = {"num-server-rounds": 2, "results-dir": str(tmp_path), "dp-mode": "flower-central",
          "clip-norm": 0.5, "noise-multiplier": 0.1}
    grid = FakeGrid(3, rc)
    server_app.main(grid, server_context(rc))
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["status"] == "completed" and data["mode"] == "flower-central"
    assert [r["num_clients"] for r in data["rounds"]] == [3, 3]
    assert all(r["eval_clients"] == 3 and 0 <= r["eval_acc"] <= 1 for r in data["rounds"])
    assert {m.metadata.message_type for m in grid.sent} == {"train", "evaluate"}


def test_fixedclipping_mod_clips_the_flower_train_reply() -> None:
    set_server_identity()
    ctx = make_context(7, 0, 3, {"lr": 0.5, "local-epochs": 2})
    start = build_model("digits", 42).state_dict()
    msg = Message(
        RecordDict({"arrays": ArrayRecord(start), "config": ConfigRecord({"clipping_norm": 0.01})}),
        dst_node_id=7, message_type="train",
    )
    reply = client_app.app(msg, ctx)
    assert not reply.has_error()
    before = np.concatenate([v.numpy().ravel() for v in start.values()])
    after = np.concatenate([a.ravel() for a in reply.content["arrays"].to_numpy_ndarrays()])
    assert np.linalg.norm(after - before) == pytest.approx(0.01, rel=1e-3)
    assert reply.content["metrics"]["clipped"] == 1


def test_opaque_train_without_aggregates_for_a_behind_node_is_an_error() -> None:
    set_server_identity()
    ctx = make_context(7, 0, 3, {})
    msg = Message(
        RecordDict({protocol.CONFIG: ConfigRecord({"server-round": 3, "target-version": 2, "num-sampled": 3})}),
        dst_node_id=7, message_type=protocol.TRAIN,
    )
    with pytest.raises(RuntimeError, match="server expects v2"):
        client_app.app(msg, ctx)
