import pytest
import torch

from cache import KVCache, StaleSessionError
from node.models.byte_model import ModelConfig, TinyTransformer

CFG = ModelConfig(n_layers=2, n_heads=4, d_model=64, context_len=512)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CFG).eval()


def _decode(model, seq, kv, chunk=37):
    s = kv.open_session()
    out = [model.forward_cached(seq[:chunk], kv, s)]
    out += [model.forward_cached(seq[i : i + 1], kv, s) for i in range(chunk, len(seq))]
    return torch.cat(out), s


def _greedy(model, kv, sid, token, n):
    out = [token]
    for _ in range(n):
        out.append(int(model.forward_cached(out[-1:], kv, sid)[-1].argmax()))
    return out[1:]


def test_fp32_cached_decoding_matches_full_recomputation(model):
    seq = torch.randint(0, 256, (320,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(seq[None])[0]
    cached, _ = _decode(model, seq, KVCache(CFG.cache_config(kv_dtype="fp32")))
    assert (cached - full).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype,tol", [("fp16", 0.02), ("int8", 0.1), ("int4", 0.5)])
def test_quantized_decoding_stays_close(model, dtype, tol):
    seq = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(seq[None])[0]
    kv = KVCache(CFG.cache_config(kv_dtype=dtype, fp_window=16))
    cached, _ = _decode(model, seq, kv)
    assert kv.stats()["quantized_blocks"] > 0 or dtype == "fp16"
    assert 0 < (cached - full).abs().max() <= tol


def test_prefix_reuse_gives_the_same_logits(model):
    kv = KVCache(CFG.cache_config())
    prompt = list(range(40, 110))
    a, b = kv.open_session(), kv.open_session()
    la = model.prefill(prompt, kv, a)
    assert kv.stats()["prefix_hit_blocks"] == 0
    lb = model.prefill(prompt, kv, b)
    assert kv.stats()["prefix_hit_tokens"] == 64  # 4 full blocks of 16 reused
    assert (la - lb).abs().max() <= 1e-5


def test_forks_sample_independently(model):
    kv = KVCache(CFG.cache_config())
    s = kv.open_session()
    model.prefill(list(range(20)), kv, s)
    f = kv.fork(s)
    ref = _greedy(model, kv, s, 7, 10)
    assert _greedy(model, kv, f, 7, 10) == ref  # same greedy path, separate tables
    assert kv.tokens(s) == kv.tokens(f)


def test_stale_kv_not_served_after_weight_update(model):
    kv = KVCache(CFG.cache_config())
    s = kv.open_session()
    model.prefill(list(range(30)), kv, s)
    kv.bump_version()
    with pytest.raises(StaleSessionError):
        model.forward_cached([1], kv, s)
    history = kv.reset_session(s)
    assert len(history) == 30
    model.prefill(history, kv, s)
    assert kv.length(s) == 30


def test_context_limit(model):
    with pytest.raises(ValueError, match="context_len"):
        model(torch.zeros(1, 513, dtype=torch.long))
