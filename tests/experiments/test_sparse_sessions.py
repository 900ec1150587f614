"""Per-session sparsification in the engine (issue 9 item 6): a session opened with a policy
attends to the positions it keeps, frees blocks it dropped, and decodes exactly like the
explicit masked loop that experiments.kv_sparsity measures (so this test lives with the
experiment's tests: node and cache tests never import experiments)."""

import pytest
import torch

from cache import KVCache, ReservationError
from cache.sparsity import policy_for
from experiments.kv_sparsity import decode_sequence
from node.models.byte_model import ModelConfig, TinyTransformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TinyTransformer(ModelConfig(n_layers=2, n_heads=2, d_model=32, context_len=256)).eval()
    with torch.no_grad():  # sharper attention than the default init, so drops matter
        for blk in m.blocks:
            blk.qkv.weight.mul_(8)
    return m


def engine_logits(model, seq, policy, kv):
    s = kv.open_session(sparsity=policy)
    return torch.stack([model.forward_cached([t], kv, s)[-1] for t in seq[:-1]]), s


@pytest.mark.parametrize("name", ["window", "topk", "decay"])
def test_a_sparse_session_decodes_like_the_explicit_masked_loop(model, name):
    seq = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    kv = KVCache(model.cfg.cache_config(block_size=4, pool_bytes=4 << 20))
    got, s = engine_logits(model, seq, policy_for(name, 0.5, len(seq)), kv)
    ref = decode_sequence(model, seq, policy_for(name, 0.5, len(seq))).logits
    assert (got - ref).abs().max() <= 1e-4
    full = decode_sequence(model, seq, None).logits
    assert (got - full).abs().max() > 1e-3  # the drops really changed attention
    st = kv.stats()
    assert st["sparsity_dropped_blocks"] >= 0.35 * len(seq) / 4
    assert st["blocks_referenced"] <= 0.6 * (len(seq) / 4) + 2  # about half is held


def test_sparse_sessions_cannot_be_forked_or_batched(model):
    kv = KVCache(model.cfg.cache_config(block_size=4, pool_bytes=4 << 20))
    s = kv.open_session(sparsity=policy_for("window", 0.5, 64))
    model.prefill(list(range(10)), kv, s)
    with pytest.raises(ReservationError, match="cannot be forked"):
        kv.fork(s)
    with pytest.raises(ReservationError, match="cannot be batched"):
        kv.begin_batch([s], [1])
