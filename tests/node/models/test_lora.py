"""node.models.lora: FFA-LoRA on a tiny random Llama (2 layers, hidden 64, 4 query over 2 KV heads).

A is frozen and the same on every node (a public seed), B starts at zero (the adapted model is
the base), only the B matrices are trained, laid out and sent; the base weights are shared,
never copied or changed; the adapter acts in the cached decode path as in the cache-free one.
"""

from __future__ import annotations

import pytest
import torch

from cache import KVCache
from node.models.llama import LlamaModel
from node.models.lora import LoraConfig, LoraLinear, adapt, public_a
from node.tasks.tasks import parameter_layout
from tests.tiny_models import tiny_config, tiny_llama

TINY = dict(vocab_size=96, max_position_embeddings=256)
CFG = tiny_config(**TINY)


@pytest.fixture()
def base(one_thread) -> LlamaModel:
    return tiny_llama(std=0.1, **TINY)


def _ids(n: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


def _randomize_b(model) -> None:
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.normal_(0, 0.5)


def test_a_is_frozen_and_the_same_on_every_node(base) -> None:
    one, two = adapt(base, LoraConfig(seed=7)), adapt(base, LoraConfig(seed=7))
    other = adapt(base, LoraConfig(seed=8))
    name = "model.layers.1.self_attn.v_proj.lora_A"
    a1, a2, a3 = (m.state_dict()[name] for m in (one, two, other))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    assert torch.equal(a1, public_a("model.layers.1.self_attn.v_proj", 8, 64, 7))
    assert all(not n.endswith("lora_A") for n, _ in one.named_parameters())  # a buffer: never trained


def test_b_starts_at_zero_so_the_adapted_model_is_the_base(base) -> None:
    model = adapt(base)
    ids = _ids()
    assert all(float(p.detach().abs().sum()) == 0 for p in model.trainable_parameters())
    torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)


def test_only_b_is_in_the_layout_and_trainable(base) -> None:
    model = adapt(base, LoraConfig(rank=4))
    layout = parameter_layout(model)
    assert layout.names == [f"model.layers.{i}.self_attn.{p}.lora_B"
                            for i in range(2) for p in ("q_proj", "v_proj")]
    # q: 4 heads x 16, v: 2 KV heads x 16, each by rank 4
    assert layout.size == 2 * (64 * 4 + 32 * 4)
    assert [id(p) for p in model.trainable_parameters()] == \
        [id(dict(model.named_parameters())[n]) for n in layout.names]


def test_gradients_reach_b_only_and_the_base_is_shared_and_unchanged(base) -> None:
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = adapt(base)
    assert model.model.embed_tokens.weight is base.model.embed_tokens.weight  # shared, not copied
    opt = torch.optim.AdamW(list(model.trainable_parameters()), lr=1e-2)
    model.train()
    for _ in range(3):
        loss = model.train_loss(_ids(17))
        opt.zero_grad()
        loss.backward()
        opt.step()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all((g is not None and float(g.abs().sum()) > 0) == n.endswith("lora_B") for n, g in grads.items())
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert any(float(p.detach().abs().sum()) > 0 for p in model.trainable_parameters())


def test_adapter_equals_the_merged_weight_and_acts_in_the_cached_path(base) -> None:
    model = adapt(base, LoraConfig(rank=4, alpha=8.0))
    _randomize_b(model)
    merged = LlamaModel(CFG)
    state = base.state_dict()
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLinear):
            state[f"{name}.weight"] = mod.weight + mod.scale * mod.lora_B @ mod.lora_A
    merged.load_state_dict(state)
    ids = _ids()
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(full, merged(ids), rtol=1e-4, atol=1e-4)
        kv = KVCache(model.cache_config(block_size=8, pool_bytes=1 << 20))
        sid = kv.open_session()
        torch.testing.assert_close(model.forward_cached(ids[0], kv, sid), full[0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(full, base(ids), atol=1e-3)


def test_a_meta_base_gives_the_same_layout_without_weights(base) -> None:
    with torch.device("meta"):
        meta = LlamaModel(CFG)
    assert parameter_layout(adapt(meta)) == parameter_layout(adapt(base))


def test_bad_input_is_refused(base) -> None:
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="no nn.Linear named"):
        adapt(base, LoraConfig(targets=("nope",)))
    with pytest.raises(TypeError, match="LlamaModel"):
        adapt(torch.nn.Linear(2, 2))


def test_plain_lora_trains_and_lays_out_a_and_b(base) -> None:
    """train_a=True (plain LoRA, experiments.private_finetune's comparison arm): A is a trained
    parameter, in the layout before its B, still drawn from the public seed; the base stays frozen."""
    model = adapt(base, LoraConfig(rank=4, train_a=True, seed=3))
    layout = parameter_layout(model)
    assert layout.names == [f"model.layers.{i}.self_attn.{p}.lora_{m}"
                            for i in range(2) for p in ("q_proj", "v_proj") for m in ("A", "B")]
    assert layout.size == 2 * (64 * 4 + 32 * 4) + 2 * 2 * (4 * 64)  # B as FFA-LoRA's, plus A [4, 64] each
    assert [id(p) for p in model.trainable_parameters()] == \
        [id(dict(model.named_parameters())[n]) for n in layout.names]
    ffa = adapt(base, LoraConfig(rank=4, seed=3))
    assert torch.equal(model.state_dict()[layout.names[0]], ffa.state_dict()[layout.names[0]])
    _randomize_b(model)  # B = 0 gives A no gradient: one step from a non-zero B reaches both
    loss = model.train_loss(_ids(17))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all((g is not None and float(g.abs().sum()) > 0) == (n in layout.names) for n, g in grads.items())
    assert not LoraConfig().train_a  # FFA-LoRA stays the default
