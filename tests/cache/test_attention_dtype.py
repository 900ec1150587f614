"""Attention runs in the wider of the queries' and the cache's dtypes (cache.attention.compute_dtype):
a bf16 model over an fp32 cache casts its queries up, not the context down."""

import torch

from cache.attention import attend, attend_shared, compute_dtype


def test_bf16_queries_over_an_fp32_cache_are_attended_in_fp32():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 1, 8, generator=g).to(torch.bfloat16)
    runs = [(torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g))]
    assert compute_dtype(q, runs[0][0]) == torch.float32
    out = attend(q, runs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, attend(q.float(), runs).to(torch.bfloat16))
    assert runs[0][0].dtype == torch.float32  # the context was not cast


def test_a_batch_step_of_bf16_queries_is_attended_in_fp32():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 8, generator=g).to(torch.bfloat16)
    prefix = [(torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g))]
    tk, tv = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 4, 3, 8, generator=g)
    valid = torch.ones(4, 3, dtype=torch.bool)
    out = attend_shared(q, prefix, tk, tv, valid)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, attend_shared(q.float(), prefix, tk, tv, valid).to(torch.bfloat16))


def test_a_bf16_prefill_over_an_fp32_cache_runs_on_the_bf16_units():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 6, 8, generator=g).to(torch.bfloat16)  # 6 new positions
    runs = [(torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g))]
    assert compute_dtype(q, runs[0][0], rows=6) == torch.bfloat16
    bf = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in runs]
    assert torch.equal(attend(q, runs), attend(q, bf))
    assert compute_dtype(q.float(), runs[0][0].half(), rows=6) == torch.float32  # fp16 cache
