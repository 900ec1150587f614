"""node.serving.param_follower: a server built with a chat task's adapters takes the adapters a node
publishes (and only parameters that fit it)."""

from __future__ import annotations

import os

import pytest
import torch

from node.serving import param_channel
from node.models.llama import LlamaModel
from node.models.lora import LoraConfig, adapt
from node.serving.param_follower import ParamFollower
from node.tasks.tasks import parameter_layout
from tests.tiny_models import SMALL, tiny_llama

KEY = bytes(range(32))


def _tiny(seed: int = 0) -> LlamaModel:
    return tiny_llama(seed, std=0.2, norms_too=True, **SMALL)


@pytest.fixture
def node_dir(tmp_path):
    d = tmp_path / "kv-cache"
    d.mkdir(mode=0o700)
    return d


def test_a_server_with_the_runs_adapters_takes_the_published_ones(node_dir):
    trainer = adapt(_tiny(), LoraConfig(rank=2, seed=42))
    layout = parameter_layout(trainer)
    state = {e.name: torch.randn(*e.shape) for e in layout.entries}
    param_channel.publish(node_dir, KEY, state, 3)
    served = adapt(_tiny(), LoraConfig(rank=2, seed=42))
    before = served(torch.tensor([[1, 2, 3]]))
    f = ParamFollower(node_dir, KEY, served, parameter_layout(served), own_weights=True, wait_s=5)
    try:
        assert f.load(serving=0) == 3
    finally:
        f.leave()
    got = served.state_dict()
    assert all(torch.equal(got[n], state[n]) for n in layout.names)
    assert not torch.allclose(served(torch.tensor([[1, 2, 3]])), before)


def test_a_plain_base_keeps_its_weights_when_adapters_are_published(node_dir):
    trainer = adapt(_tiny(), LoraConfig(rank=2, seed=42))
    layout = parameter_layout(trainer)
    param_channel.publish(node_dir, KEY, {e.name: torch.ones(*e.shape) for e in
                                          layout.entries}, 1)
    base = _tiny()
    want = {n: t.clone() for n, t in base.state_dict().items()}
    f = ParamFollower(node_dir, KEY, base, parameter_layout(base), own_weights=True, wait_s=5)
    try:
        assert f.load(serving=0) is None  # another model's parameters: serve its own, whole
    finally:
        f.leave()
    assert all(torch.equal(base.state_dict()[n], t) for n, t in want.items())
    assert os.stat(node_dir).st_mode & 0o077 == 0
