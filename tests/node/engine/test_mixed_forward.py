"""``forward_mixed``: a scheduler step's decode rows and prefill chunks in one forward.

The packed forward must give the same logits (and leave the cache holding the same K/V) as
the separate forwards it replaces -- one ``forward_batch`` of the decode rows, then one
``forward_cached`` per chunk -- for both model families, and the scheduler must make exactly
one forward a step.
"""

from __future__ import annotations

import pytest
import torch

from cache import KVCache
from node.engine.generation import GenerationRequest
from node.models.byte_model import ModelConfig, TinyTransformer
from node.models.interface import MixedBatch
from node.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 8


@pytest.fixture(scope="module", autouse=True)
def _single_thread(one_thread):
    yield


@pytest.fixture(params=["byte", "llama", "llama-bfloat16", "llama-int8"], scope="module")
def model(request):
    if request.param == "byte":
        torch.manual_seed(0)
        return TinyTransformer(ModelConfig(n_layers=2, n_heads=2, d_model=32, context_len=256)).eval()
    pytest.importorskip("transformers")
    from node.models.precision import convert
    from tests.tiny_models import ours_from_hf, tiny_hf_llama
    dtype = request.param.partition("-")[2] or "float32"
    return convert(ours_from_hf(tiny_hf_llama()), dtype).eval()


def _close(a: torch.Tensor, b: torch.Tensor, model) -> None:
    """fp32: equal to rounding. A reduced-precision model rounds differently when rows are
    packed into other GEMM shapes (bf16 keeps 8 bits of mantissa; int8 weights take the
    one-row int8 kernel for up to 8 rows and dequantized bf16 above): logits of O(1) within
    0.15, where a misplaced row or position would differ by far more."""
    fp32 = next(model.parameters()).dtype == torch.float32
    tol = dict(rtol=1e-4, atol=1e-5) if fp32 else dict(rtol=0.05, atol=0.15)
    torch.testing.assert_close(a, b, **tol)


def _cache(model) -> KVCache:
    probe = model.cache_config(block_size=BLOCK, tail_granule=0)
    return KVCache(model.cache_config(block_size=BLOCK, tail_granule=0,
                                      pool_bytes=128 * probe.block_bytes_fp32,
                                      managed_block_bytes=probe.block_bytes_fp32))


def _sessions(model, kv: KVCache, prompts: list[list[int]]) -> list[int]:
    sids = []
    for p in prompts:
        sid = kv.open_session()
        model.forward_cached(p, kv, sid)
        sids.append(sid)
    return sids


@torch.no_grad()
def test_mixed_forward_equals_the_separate_forwards(model):
    g = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    decoding = [tok(13), tok(21), tok(8)]      # sessions past their prefill
    prefilling = [tok(5), tok(9)]              # sessions part-way into a prompt
    new_dec, chunks = tok(3), [tok(11), tok(17)]
    results = []
    for mixed in (False, True):
        kv = _cache(model)
        dsids, psids = _sessions(model, kv, decoding), _sessions(model, kv, prefilling)
        if mixed:
            step = kv.begin_batch(dsids, new_dec)
            for sid, c in zip(psids, chunks):
                kv.reserve(sid, c)
            batch = MixedBatch(step, tuple(new_dec), tuple((s, tuple(c)) for s, c in zip(psids, chunks)))
            logits = model.forward_mixed(batch, kv)
        else:
            rows = [model.forward_batch(new_dec, kv, dsids)]
            rows += [model.forward_cached(c, kv, s)[-1:] for s, c in zip(psids, chunks)]
            logits = torch.cat(rows)
        after = [model.forward_batch([7] * 5, kv, dsids + psids)]  # what the cache now holds
        results.append((logits, after[0], [kv.length(s) for s in dsids + psids]))
    (l0, a0, n0), (l1, a1, n1) = results
    assert l1.shape == (len(decoding) + len(chunks), l0.shape[-1])
    _close(l1, l0, model)
    _close(a1, a0, model)
    assert n1 == n0


@torch.no_grad()
def test_only_chunks_or_only_decode_rows(model):
    kv = _cache(model)
    sid = kv.open_session()
    kv.reserve(sid, [1, 2, 3])
    out = model.forward_mixed(MixedBatch(None, (), ((sid, (1, 2, 3)),)), kv)
    ref_kv = _cache(model)
    ref = model.forward_cached([1, 2, 3], ref_kv, ref_kv.open_session())[-1:]
    _close(out, ref, model)
    step = kv.begin_batch([sid], [4])
    _close(model.forward_mixed(MixedBatch(step, (4,), ()), kv), model.forward_cached([4], ref_kv, 0),
           model)


class _Counting:
    """Counts the forwards a scheduler makes."""

    def __init__(self, model):
        self._m, self.calls = model, {"forward_mixed": 0, "forward_batch": 0, "forward_cached": 0}

    def __getattr__(self, name):
        attr = getattr(self._m, name)
        if name in self.calls:
            def counted(*a, **k):
                self.calls[name] += 1
                return attr(*a, **k)
            return counted
        return attr


def test_a_step_with_decode_rows_and_several_prefills_is_one_forward(model):
    counting = _Counting(model)
    kv = _cache(model)
    s = Scheduler(counting, kv, SchedulerConfig(token_budget=64))
    s.add(GenerationRequest(tuple(range(1, 10)), 6))
    s.step()                                  # its prefill
    assert counting.calls["forward_mixed"] == 1
    s.add(GenerationRequest(tuple(range(20, 31)), 4))
    s.add(GenerationRequest(tuple(range(40, 47)), 4))
    before = dict(s.counters)
    s.step()                                  # one decode row and two whole prompts
    assert counting.calls == {"forward_mixed": 2, "forward_batch": 0, "forward_cached": 0}
    assert s.counters["decode_rows"] - before["decode_rows"] == 1
    assert s.counters["prefill_chunks"] - before["prefill_chunks"] == 2
    assert s.counters["forwards"] == 2
    total, longest = s.forward_seconds  # both forwards timed: a stalled step would show here
    assert 0 < longest < total
