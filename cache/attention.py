"""Attention over a session's K/V runs (views into the TokenArena), without gathering them.

A session's context is a few runs: its shared prefix, its own blocks. Runs are attended in
place: the scores of every run are concatenated
(``n`` floats per head and query, not ``n x dim`` of K/V), one softmax, and each run's values
are summed in with its slice of the weights -- the same result as attention over the
concatenated K/V, without copying them.

``attend_shared`` is the batched form for B sessions that share a prefix (cascade attention,
as in Hydragen and FlashInfer): one matmul of all B queries against the prefix's K/V, so the
prefix is read once per step for the whole batch, plus each session's own tail; both parts are
merged inside one softmax per session row.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

Run = tuple[torch.Tensor, torch.Tensor]  # K, V: [heads, n, dim]


def causal_mask(t: int, n: int) -> torch.Tensor | None:
    """bool [t, n]: query j (position n - t + j) sees keys up to its own position."""
    if t <= 1:
        return None
    return torch.ones(t, n, dtype=torch.bool).tril(diagonal=n - t)


def attend(q: torch.Tensor, runs: Sequence[Run], keep: torch.Tensor | None = None,
           weights: bool = False):
    """q: [heads, t, dim], the newest t positions' queries -> [heads, t, dim].

    ``keep`` (bool [n]) leaves positions out (a sparsity policy's mask); with ``weights``
    the softmax weights [heads, t, n] come back too, for the policy to observe."""
    if runs and runs[0][0].dtype != q.dtype:  # an fp16 cache: attend in q's precision
        runs = [(k.to(q.dtype), v.to(q.dtype)) for k, v in runs]
    n = sum(k.shape[1] for k, _ in runs)
    mask = causal_mask(q.shape[1], n)
    if keep is not None:
        mask = keep.expand(q.shape[1], -1) if mask is None else mask & keep
    if len(runs) == 1 and mask is not None and not weights:  # prefill: SDPA's fused kernel
        k, v = runs[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # decode: two matmuls and a softmax beat CPU SDPA for one query (bench_kv's profile
    # section: micro_per_layer attend_one_query_us vs sdpa_one_query_us) and take the runs
    # in place
    scores = torch.cat([torch.matmul(q, k.transpose(-1, -2)) for k, _ in runs], dim=-1)
    scores.mul_(1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out, a = None, 0
    for k, v in runs:
        part = torch.matmul(p[..., a : a + k.shape[1]], v)
        out = part if out is None else out.add_(part)
        a += k.shape[1]
    return (out, p) if weights else out


def attend_shared(q: torch.Tensor, prefix: Sequence[Run], tail_k: torch.Tensor,
                  tail_v: torch.Tensor, tail_valid: torch.Tensor) -> torch.Tensor:
    """One decode step of B sessions sharing ``prefix``.

    q: [heads, B, dim] (one new token per session); prefix: runs of the shared K/V, each
    [heads, n, dim]; tail_k/tail_v: [heads, B, T, dim], each session's own tokens padded to T;
    tail_valid: bool [B, T]. Returns [heads, B, dim].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    parts = [torch.matmul(q, k.transpose(-1, -2)) for k, _ in prefix]  # [H, B, n_i]
    tail = torch.einsum("hbd,hbtd->hbt", q, tail_k)
    tail = tail.masked_fill(~tail_valid, float("-inf"))
    p = torch.softmax(torch.cat(parts + [tail], dim=-1).mul_(scale), dim=-1)
    n_tail = tail.shape[-1]
    out = torch.einsum("hbt,hbtd->hbd", p[..., p.shape[-1] - n_tail :], tail_v)
    a = 0
    for k, v in prefix:
        out.add_(torch.matmul(p[..., a : a + k.shape[1]], v))
        a += k.shape[1]
    return out
