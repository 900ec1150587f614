"""The chat task on the tiny random Llama (``chat:tiny``): the write-back invalidation with adapters.

After a write-back of new adapters (B), K/V computed under the old adapters is never served (the
cache's model version), K/V of a prefix computed under the current version is reused, and the
logits through the cache equal a fresh cache-free forward of a model built with the new adapters.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from node.tasks import instruct_data as qa
from node.cache_node import CacheNode, NodeSpec, model_layout
from node.engine.sessions import Sessions
from node.tasks.tasks import ChatTask, build_model, chat_layout_model, load_parameters, make_task


@pytest.fixture()
def node(one_thread) -> CacheNode:
    return CacheNode(NodeSpec(0, 2, task="chat:tiny"))


def _system(node: CacheNode) -> list[int]:
    return node.task.codec.system(qa.SYSTEM_PROMPT)


def _random_update(node: CacheNode, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, node.layout.size)


def test_system_prompt_blocks_are_reused_before_a_write_back_not_after(node) -> None:
    kv, model, prompt = node.cache, node.model, _system(node)
    assert len(prompt) > 2 * kv.config.block_size  # whole blocks to share
    first = kv.open_session()
    model.prefill(prompt, kv, first)
    second = kv.open_session()
    assert kv.match_prefix(second, prompt) >= kv.config.block_size  # same version: reused

    node.apply_mean_update(_random_update(node), version=1)
    assert kv.is_stale(first) and kv.is_stale(second)
    third = kv.open_session()
    assert kv.match_prefix(third, prompt) == 0  # K/V of the old adapters is never served
    after = model.prefill(prompt, kv, third)
    fourth = kv.open_session()
    assert kv.match_prefix(fourth, prompt) >= kv.config.block_size  # the new version's is

    fresh = node.task.build_model(node.spec.seed)  # a model that never saw the cache
    load_parameters(fresh, node.params(), node.layout)
    with torch.no_grad():
        want = fresh(torch.tensor([prompt]))[0, -1]
        base = node.task.build_model(node.spec.seed)(torch.tensor([prompt]))[0, -1]
    torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, base, atol=1e-4)  # the write-back did change the logits


def test_a_chat_session_is_recomputed_under_the_new_adapters(node) -> None:
    sessions = Sessions(node.model, node.cache, codec=node.task.codec)
    chat = sessions.create(qa.SYSTEM_PROMPT)
    sessions.send(chat, "What does `json.dumps` do?", max_new_tokens=4)
    sid = sessions[chat]
    history = node.cache.tokens(sid)
    node.apply_mean_update(_random_update(node, 1), version=1)
    assert node.cache.is_stale(sid)
    reply = sessions.turn(chat, "And `json.loads`?", max_new_tokens=4)
    assert reply.recomputed >= len(history) - node.cache.config.block_size
    assert not node.cache.is_stale(sessions[chat])
    assert node.cache.tokens(sessions[chat])[:len(history)] == history


def test_node_layout_is_the_adapters_and_the_server_sizes_it_without_weights(node) -> None:
    assert node.layout == model_layout("chat:tiny", node.spec.seed)
    assert all(n.endswith("lora_B") for n in node.layout.names)
    meta = chat_layout_model("tiny", 42)
    assert meta.model.embed_tokens.weight.device.type == "meta"  # nothing allocated
    assert not np.any(node.flat_params())  # B starts at zero: round 0 is the base model


def test_training_moves_only_b_and_lowers_the_share_loss(one_thread) -> None:
    task = ChatTask(1, 2, chat_model="tiny", steps_per_epoch=4)
    model = task.build_model(42)
    base_state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("lora_B")}
    ids, labels = qa.batch(task.codec, task.share[:8], task.max_len)
    with torch.no_grad():
        before = float(qa.answer_loss(model, ids, labels))
    task.train(model, 1, task.default_lr, seed=3)
    with torch.no_grad():
        after = float(qa.answer_loss(model, ids, labels))
    assert after < before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base_state.items())


def test_evaluate_reports_answer_perplexity_base_and_samples(one_thread) -> None:
    task = ChatTask(0, 2, chat_model="tiny", sample_tokens=4)
    loss, ppl, n = task.evaluate(task.build_model(42))
    assert math.isclose(ppl, math.exp(loss)) and n > 0
    assert math.isclose(task.base_metric, ppl, rel_tol=1e-6)  # B = 0: the adapted model is the base
    assert [s["question"] for s in task.samples] == [p.question for p in task.heldout[:2]]
    assert ChatTask(1, 2, chat_model="tiny").eval_pairs != task.eval_pairs  # disjoint slices


def test_unknown_chat_model_and_missing_real_model_say_what_to_do(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="unknown chat model"):
        make_task("chat:nope", 0, 2, 42, 1.0)
    monkeypatch.setenv("FEDKV_MODEL_DIR", str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="python -m node.models.smollm2 fetch"):
        build_model("chat", 42)
