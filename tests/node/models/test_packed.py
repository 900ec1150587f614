"""oneDNN-packed bf16 linears (node/models/packed.py): the packed copy is derived, so it must
follow every change of the parameters it came from and step aside where it does not apply."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from node.models import packed
from node.models.packed import PackedProjection

pytestmark = pytest.mark.skipif(not packed.available(), reason="no oneDNN bf16 on this CPU")


class Owner(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 24, bias=False).to(torch.bfloat16)
        self.b = nn.Linear(32, 8, bias=False).to(torch.bfloat16)
        self.proj = PackedProjection(self, ("a", "b"))


def reference(o: Owner, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(x.float(), o.a.weight.float()), F.linear(x.float(), o.b.weight.float())], -1)


def close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return y.dtype == torch.bfloat16 and bool((y.float() - ref).abs().max() <= 0.02 * ref.abs().max())


@torch.no_grad()
def test_the_packed_product_is_the_fused_linears():
    o = Owner()
    for rows in (1, 16, 300):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        assert close(o.proj(x), reference(o, x))


@torch.no_grad()
def test_the_layout_follows_the_thread_count_and_the_product_does_not():
    """oneDNN's blocking is chosen for the thread count (``batch_hint``); a change of it
    repacks, and either layout gives the fused linears."""
    o = Owner()
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        for threads, hint in ((1, None), (2, 1), (1, None)):
            torch.set_num_threads(threads)
            assert packed.batch_hint() == hint
            assert close(o.proj(x), reference(o, x))
            assert o.proj.key[-1] == hint  # packed for this layout, not left from the last
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def test_a_weight_written_in_place_is_repacked_not_served_stale():
    """A follower's write-back (load_state_dict, copy_) changes values, not storage."""
    o = Owner()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    before = o.proj(x)
    o.load_state_dict({"a.weight": torch.randn(24, 32), "b.weight": o.b.weight.clone()})
    after = o.proj(x)
    assert close(after, reference(o, x)) and not torch.equal(after, before)
    o.b.weight.mul_(2)
    assert close(o.proj(x), reference(o, x))


@torch.no_grad()
def test_replaced_storage_is_repacked():
    o = Owner()
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    o.proj(x)
    o.a.weight.data = torch.randn(24, 32, dtype=torch.bfloat16)
    assert close(o.proj(x), reference(o, x))


def test_it_steps_aside_for_autograd_an_adapter_and_other_dtypes():
    o = Owner()
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    assert o.proj(x) is None  # grad enabled: training uses the modules
    with torch.no_grad():
        assert o.proj(x.float()) is None
        o.b = nn.Sequential(o.b)  # an adapter wrapping a module
        assert o.proj(x) is None


@torch.no_grad()
def test_a_copy_repacks_from_its_own_parameters():
    o = Owner()
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    o.proj(x)  # packed: an opaque oneDNN tensor that cannot be copied
    c = copy.deepcopy(o)
    c.a.weight.zero_()
    assert close(c.proj(x), reference(c, x)) and close(o.proj(x), reference(o, x))


def test_a_bf16_llama_prefills_through_the_packed_linears():
    import transformers

    from cache import KVCache
    from node.models.llama import LlamaConfig, LlamaModel
    from node.models.precision import convert
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    m = convert(LlamaModel.from_state_dict(LlamaConfig.from_hf(cfg), hf.state_dict()), "bfloat16")
    kv = KVCache(m.cache_config(pool_bytes=1 << 20))
    logits = m.prefill(list(range(10)), kv, kv.open_session())
    layer = m.model.layers[0]  # 10 rows through each (the last layer's o_proj and MLP, and the
    # head, take the sampled row alone: a decode step's few rows go through the row stacks)
    assert all(p.packed.packed is not None for p in (layer.self_attn.qkv, layer.self_attn.o,
                                                     layer.mlp.gate_up, layer.mlp.down))
    with torch.no_grad():
        ref = hf(torch.arange(10)[None]).logits[0, -1]
    assert int(logits.argmax()) == int(ref.argmax())


@pytest.mark.parametrize("rows", [1, packed.EXACT_ROWS, packed.EXACT_ROWS + 1, 40, 64, 100])
def test_padded_row_counts_give_the_unpadded_product(rows):
    """Past the decode sizes the rows are padded to a bucket (one oneDNN kernel per bucket,
    not per length): the result is the product of the real rows, nothing of the padding."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 24, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 24, generator=g).to(torch.bfloat16)
    got = packed.linear(x, packed.pack(w))
    assert got.shape == (rows, 48)
    assert close(got, x.float() @ w.float().T)
    assert close(packed.linear(x[None], packed.pack(w))[0], got)  # leading dims kept
