"""cache.attention with a group axis (GQA) against dense attention over repeated K/V.

Random shapes: K/V heads, group size G, new queries T, runs of the context; the reference
repeats each K/V head G times (Llama's ``repeat_kv``), concatenates the runs and runs plain
softmax attention with the causal mask of the newest T positions. ``attend_shared`` (the
cascade path of batched decode) is checked against the same reference per session, over its
shared prefix plus its own valid tail. G = 1 must be today's multi-head path to the bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cache.attention import attend, attend_shared, causal_mask

TOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hk, G, T, D] over k, v [Hk, n, D] repeated per query head; (out, weights)."""
    Hk, G, T, D = q.shape
    n = k.shape[1]
    kr, vr = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)  # [Hk*G, n, D]
    qf = q.reshape(Hk * G, T, D).double()
    s = qf @ kr.double().transpose(-1, -2) / math.sqrt(D)
    pos = torch.arange(n - T, n)
    allowed = torch.arange(n)[None, :] <= pos[:, None]
    if keep is not None:
        allowed = allowed & keep
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    out = (p @ vr.double()).float()
    return out.view(Hk, G, T, D), p.float().view(Hk, G, T, n)


def split_runs(k: torch.Tensor, v: torch.Tensor, cuts: list[int]):
    edges = [0, *cuts, k.shape[1]]
    return [(k[:, a:b], v[:, a:b]) for a, b in zip(edges, edges[1:]) if b > a]


def random_case(g: torch.Generator):
    Hk = int(torch.randint(1, 4, (1,), generator=g))
    G = int(torch.randint(2, 5, (1,), generator=g))
    D = [8, 16, 32][
        int(torch.randint(0, 3, (1,), generator=g))]
    n = int(torch.randint(1, 70, (1,), generator=g))
    T = int(torch.randint(1, n + 1, (1,), generator=g))
    q = torch.randn(Hk, G, T, D, generator=g)
    k, v = torch.randn(Hk, n, D, generator=g), torch.randn(Hk, n, D, generator=g)
    n_cuts = int(torch.randint(0, 3, (1,), generator=g))
    cuts = sorted(torch.randint(1, n + 1, (n_cuts,), generator=g).tolist()) if n > 1 else []
    return q, k, v, cuts


@pytest.mark.parametrize("seed", range(40))
def test_grouped_attend_equals_dense_over_repeated_kv(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cuts = random_case(g)
    out = attend(q, split_runs(k, v, cuts))
    ref, _ = dense(q, k, v)
    assert out.shape == q.shape
    assert (out - ref).abs().max() < TOL


@pytest.mark.parametrize("seed", range(12))
def test_grouped_attend_with_keep_mask_and_weights(seed):
    g = torch.Generator().manual_seed(100 + seed)
    q, k, v, cuts = random_case(g)
    n, T = k.shape[1], q.shape[2]
    keep = torch.rand(n, generator=g) < 0.7
    keep[n - T :] = True  # the new positions are always kept (as the sparsity policy does)
    out, w = attend(q, split_runs(k, v, cuts), keep=keep, weights=True)
    ref, ref_w = dense(q, k, v, keep)
    assert (out - ref).abs().max() < TOL and (w - ref_w).abs().max() < TOL
    assert w.shape == (*q.shape[:3], n)
    # without weights the prefill path (SDPA over stride-0 expanded K/V) gives the same
    assert (attend(q, split_runs(k, v, cuts), keep=keep) - ref).abs().max() < TOL


def test_grouped_prefill_of_a_whole_context_is_causal():
    """T = n (an empty session's prefill): the is_causal fast path; the first query sees only
    the first key, the last sees all of them."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 3, 40, 64, generator=g)
    k, v = torch.randn(3, 40, 64, generator=g), torch.randn(3, 40, 64, generator=g)
    out = attend(q, [(k, v)])
    ref, _ = dense(q, k, v)
    assert (out - ref).abs().max() < TOL
    assert torch.allclose(out[:, :, 0], v[:, None, 0].expand(3, 3, 64), atol=1e-6)


def test_fp16_runs_are_attended_in_the_queries_precision():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 3, 1, 16, generator=g)
    k, v = torch.randn(2, 20, 16, generator=g), torch.randn(2, 20, 16, generator=g)
    out = attend(q, [(k.half(), v.half())])
    ref, _ = dense(q, k.half().float(), v.half().float())
    assert out.dtype == torch.float32 and (out - ref).abs().max() < TOL


@pytest.mark.parametrize("T,n", [(1, 17), (5, 17), (17, 17), (33, 64)])
def test_group_of_one_is_the_multi_head_path_bit_for_bit(T, n):
    g = torch.Generator().manual_seed(T * 100 + n)
    q = torch.randn(4, T, 16, generator=g)
    k, v = torch.randn(4, n, 16, generator=g), torch.randn(4, n, 16, generator=g)
    for runs in ([(k, v)], split_runs(k, v, [n // 3, n // 2])):
        assert torch.equal(attend(q[:, None], runs)[:, 0], attend(q, runs))
    if T > 1:  # today's masked SDPA call and the is_causal fast path agree to the bit
        old = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, n))
        assert torch.equal(attend(q, [(k, v)]), old)


def shared_case(seed: int, G: int):
    g = torch.Generator().manual_seed(seed)
    Hk = int(torch.randint(1, 4, (1,), generator=g))
    B = int(torch.randint(1, 6, (1,), generator=g))
    D = 16
    n_prefix = int(torch.randint(0, 40, (1,), generator=g))
    lengths = torch.randint(1, 9, (B,), generator=g).tolist()
    T = max(lengths)
    q = torch.randn(Hk, G, B, D, generator=g)
    pk, pv = torch.randn(Hk, n_prefix, D, generator=g), torch.randn(Hk, n_prefix, D, generator=g)
    tk, tv = torch.randn(Hk, B, T, D, generator=g), torch.randn(Hk, B, T, D, generator=g)
    valid = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    cuts = [n_prefix // 2] if n_prefix > 1 else []
    prefix = split_runs(pk, pv, cuts) if n_prefix else []
    return q, prefix, (pk, pv), tk, tv, valid


@pytest.mark.parametrize("seed", range(25))
def test_grouped_shared_prefix_equals_dense_per_session(seed):
    q, prefix, (pk, pv), tk, tv, valid = shared_case(seed, G=2 + seed % 3)
    out = attend_shared(q, prefix, tk, tv, valid)
    assert out.shape == q.shape
    for b in range(q.shape[2]):
        k = torch.cat([pk, tk[:, b, valid[b]]], 1)
        v = torch.cat([pv, tv[:, b, valid[b]]], 1)
        ref, _ = dense(q[:, :, b : b + 1], k, v)  # one new token: it sees its whole context
        assert (out[:, :, b] - ref[:, :, 0]).abs().max() < TOL


@pytest.mark.parametrize("seed", range(5))
def test_shared_group_of_one_is_the_multi_head_path_bit_for_bit(seed):
    q, prefix, _, tk, tv, valid = shared_case(1000 + seed, G=1)
    assert torch.equal(attend_shared(q, prefix, tk, tv, valid)[:, 0],
                       attend_shared(q[:, 0], prefix, tk, tv, valid))


@pytest.mark.parametrize("n", [1, 17, 64])
def test_one_query_over_one_run_equals_the_runs_path_and_dense(n):
    """Decode's common case (one query, the whole context one run, here a strided view of a
    larger arena as the cache hands out) takes a copy-free path; it equals the same context
    split into runs (the general path) and dense attention over repeated K/V."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(3, 3, 1, 64, generator=g)
    arena_k, arena_v = torch.randn(3, 100, 64, generator=g), torch.randn(3, 100, 64, generator=g)
    k, v = arena_k[:, 10 : 10 + n], arena_v[:, 10 : 10 + n]
    one = attend(q, [(k, v)])
    ref, _ = dense(q, k, v)
    assert (one - ref).abs().max() < TOL
    if n > 1:
        assert (one - attend(q, split_runs(k, v, [n // 2]))).abs().max() < TOL
    assert (attend(q[:, :1], [(k, v)])[:, 0] - attend(q[:, 0], [(k, v)])).abs().max() == 0
