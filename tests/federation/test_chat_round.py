"""task=chat in process (real ClientApp handlers, real strategy): the tiny random Llama's adapters
trained on two nodes, summed under CKKS with distributed DP, written back into both caches."""

from __future__ import annotations

import math

import numpy as np
import pytest

from federation.local import InProcessGrid, run_local
from node.tasks.instruct_data import heldout_pairs
from node.tasks.tasks import TINY_CHAT_CORPUS

CHAT_HE = {"task": "chat", "chat-model": "tiny", "he": True, "dp-mode": "distributed",
           "num-server-rounds": 2, "min-clients": 2, "seed": 42, "local-epochs": 1}


def test_chat_rounds_under_he_write_adapters_back_and_report_base_and_samples(one_thread) -> None:
    grid = InProcessGrid(2, CHAT_HE)
    results = run_local(CHAT_HE, 2, grid=grid)

    assert results.status == "completed", results.status
    assert results.mode == "he" and results.encoding["dim"] >= 1536  # the adapters only (+ count)
    for rec in results.rounds:
        assert rec.num_clients == 2 and not rec.dropped
        assert rec.metric == "answer perplexity" and math.isfinite(rec.eval_metric)
        assert math.isfinite(rec.base_metric) and rec.base_metric != rec.eval_metric
        assert [s["question"] for s in rec.samples] == [p.question for p in heldout_pairs(42, TINY_CHAT_CORPUS)[:2]]
        assert all(isinstance(s["reply"], str) for s in rec.samples)
    finals = []
    for node_id in grid.node_ids:
        node = grid.node(node_id)
        assert node.version == 2 and all(n.endswith("lora_B") for n in node.layout.names)
        assert all(node.cache.tensor_version(f"param/{n}") == 2 for n in node.layout.names)
        finals.append(node.flat_params())
    assert np.any(finals[0])  # the adapters moved from zero
    np.testing.assert_allclose(finals[1], finals[0], rtol=0, atol=1e-6)  # one global model
    _kept_adapters_are_the_final_model(grid)


def _kept_adapters_are_the_final_model(grid: InProcessGrid) -> None:
    """Each node kept its final adapters as a PEFT adapter outside the run's directory, where
    retention (``run-<digits>`` entries only) never reaches them."""
    import stat
    from pathlib import Path

    import torch

    from node.serving.adapters import read_adapter
    from node.tasks.tasks import TINY_CHAT

    for node_id in grid.node_ids:
        kept = Path(grid.node_dir) / "adapters" / f"run-{grid.run_id}" / f"node-{node_id}"
        adapter = read_adapter(kept, TINY_CHAT)
        assert adapter.version == 2 and stat.S_IMODE(kept.stat().st_mode) == 0o700
        model = grid.node(node_id).model.state_dict()
        assert all(torch.equal(t, model[n]) for n, t in adapter.state.items())


@pytest.mark.slow
def test_one_real_smollm2_round_beats_the_base(one_thread) -> None:
    """One round of SmolLM2-135M-Instruct adapters on 2 nodes under CKKS + distributed DP
    (skipped without ``python -m node.models.smollm2 fetch``)."""
    from node.models.smollm2 import default_dir

    if not (default_dir() / "config.json").is_file():
        pytest.skip("SmolLM2 not converted: python -m node.models.smollm2 fetch")
    cfg = {**CHAT_HE, "chat-model": "smollm2", "num-server-rounds": 1, "local-epochs": 2}
    results = run_local(cfg, 2, grid=InProcessGrid(2, cfg))
    assert results.status == "completed", results.status
    rec = results.rounds[0]
    assert rec.eval_metric < rec.base_metric, (rec.eval_metric, rec.base_metric)
    assert len(rec.samples) == 2 and all(s["reply"].strip() for s in rec.samples)


def _eval_metrics(**extra):
    from federation import messages, protocol

    serve = {**dict.fromkeys(protocol.SERVE_COUNTS, 0), **dict.fromkeys(protocol.SERVE_AMOUNTS, 0.0)}
    return messages.EvalMetrics(8, 3.2, 24.5, 0.1, 0.1, 1.0, 2, 0, 7, 0, serve=serve, **extra)


def test_eval_reply_carries_base_metric_and_sample_replies(monkeypatch) -> None:
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from federation import messages

    for attr in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, attr, 1)

    sent = _eval_metrics(base_metric=38.3, samples=[("What does `a.b` do?", "It does b.")])
    request = Message(RecordDict(), dst_node_id=1, message_type="evaluate.fedkv")
    reply = messages.eval_reply(request, sent)
    assert messages.parse_eval_reply(reply) == sent
    plain = messages.parse_eval_reply(messages.eval_reply(request, _eval_metrics()))
    assert plain.base_metric is None and plain.samples == []  # digits/lm replies: unchanged wire
    reply.content[messages.SAMPLES] = ConfigRecord({"questions": ["q"], "replies": ["a", "b"]})
    with pytest.raises(messages.BadReply, match="equal length"):
        messages.parse_eval_reply(reply)


def test_chat_config_names_the_base_and_refuses_what_cannot_run() -> None:
    from federation.config import ConfigError, RunConfig, task_id

    assert RunConfig(task="chat").task_id == "chat:smollm2"
    assert RunConfig(task="chat", chat_model="tiny").task_id == task_id({"task": "chat", "chat-model": "tiny"}) == "chat:tiny"
    assert RunConfig(task="lm", chat_model="tiny").task_id == "lm"
    assert RunConfig.from_run_config({"task": "chat", "dp-sgd": True}).dp_sgd  # node.tasks.dp_sgd trains chat too
    for bad, why in (({"chat-model": "gpt"}, "chat-model must be one of"),
                     ({"dp-mode": "flower-central", "he": False}, "task=chat does not run with dp-mode=flower-central")):
        with pytest.raises(ConfigError, match=why):
            RunConfig.from_run_config({"task": "chat", **bad})
