"""The model interface (issue 22 item 5): the node drives a language model only through
``node.models.interface.CachedLM``, so a second family plugs in without the node naming it."""

import pytest
import torch
from torch import nn

from cache import KVCache
from crypto import Layout, flatten
from node.models.byte_model import ModelConfig, TinyTransformer
from node.models.interface import CachedLM
from node.engine.sessions import Sessions
from node.tasks.tasks import build_model, federated_state, load_parameters, parameter_layout

CFG = ModelConfig(n_layers=2, n_heads=2, d_model=32, context_len=128)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG).eval()


class Wrapped:
    """Another 'family': it delegates the interface to a tiny model and is no nn.Module and
    no TinyTransformer, so whatever works with it depends on the interface alone."""

    def __init__(self, inner: TinyTransformer):
        self.inner = inner
        self.context_len = inner.context_len

    def cache_config(self, **overrides):
        return self.inner.cache_config(**overrides)

    def __call__(self, idx):
        return self.inner(idx)

    def forward_cached(self, tokens, cache, sid):
        return self.inner.forward_cached(tokens, cache, sid)

    def forward_batch(self, tokens, cache, sids):
        return self.inner.forward_batch(tokens, cache, sids)

    def forward_mixed(self, batch, cache):
        return self.inner.forward_mixed(batch, cache)

    def prefill(self, prompt, cache, sid):
        return self.inner.prefill(prompt, cache, sid)

    def train_loss(self, batch):
        return self.inner.train_loss(batch)

    def trainable_parameters(self):
        return self.inner.trainable_parameters()

    def parameter_layout(self) -> Layout:
        return self.inner.parameter_layout()


def test_the_tiny_lm_is_a_cached_lm_and_the_digits_mlp_is_not(model):
    assert isinstance(model, CachedLM) and isinstance(Wrapped(model), CachedLM)
    assert not isinstance(build_model("digits", 0), CachedLM)
    assert model.parameter_layout() == flatten(model.state_dict())[1]  # trained whole
    assert model.cache_config().num_heads == CFG.n_heads


def test_sessions_run_on_any_cached_lm(model):
    """Both decode loops give the same bytes through the interface as through the class."""
    def replies(lm) -> list[bytes]:
        chats = Sessions(lm, KVCache(lm.cache_config(block_size=4, pool_bytes=2 << 20)))
        a, b = chats.create(b"shared prompt"), chats.create(b"shared prompt")
        one = chats.send(a, b"hello", 6)
        return [one] + [r.reply for r in chats.turn_batch([a, b], [b" again", b"hi"], 5)]

    assert replies(Wrapped(model)) == replies(model)


def test_train_loss_is_next_token_cross_entropy(model):
    batch = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = model(batch[:, :-1])
    want = nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
    assert torch.equal(model.train_loss(batch), want)


class Adapted(TinyTransformer):
    """A model whose federated parameters are a part of it (as LoRA adapters would be)."""

    def parameter_layout(self) -> Layout:
        return flatten({k: v for k, v in self.state_dict().items() if k.startswith("head.")})[1]


def test_only_the_layouts_entries_are_read_and_written():
    torch.manual_seed(1)
    m = Adapted(CFG)
    layout = parameter_layout(m)
    assert layout.names == ["head.weight"]
    base = m.tok.weight.detach().clone()
    load_parameters(m, {"head.weight": torch.zeros_like(m.head.weight)}, layout)
    assert torch.equal(m.head.weight, torch.zeros_like(m.head.weight))
    assert torch.equal(m.tok.weight, base)  # outside the layout: kept
    assert list(federated_state(m, layout)) == ["head.weight"]
    with pytest.raises(KeyError):
        load_parameters(m, {}, layout)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_parameters(m, {"head.weight": torch.zeros(3, 3)}, layout)
    with pytest.raises(KeyError, match="does not have"):
        stray = {"nope": torch.zeros(2)}
        load_parameters(m, stray, flatten(stray)[1])
