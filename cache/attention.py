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

Grouped-query attention (GQA): the cache holds the K/V heads only. A model whose query heads
share K/V heads passes its queries with a group axis, ``[kv_heads, G, T, dim]`` (query head
``h`` is ``[h // G, h % G]``, the order of Llama's ``repeat_kv``), and gets the same shape
back; no K/V is ever repeated per query head. The G queries of a group are multiplied as
``G * T`` rows against the shared K/V in place; the causal mask ``[T, n]`` is broadcast over
the group axis (each of the G copies of position ``j`` sees the same keys). Multi-head
attention is ``[heads, T, dim]`` as before, and a group axis of 1 takes exactly that path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

Run = tuple[torch.Tensor, torch.Tensor]  # K, V: [heads, n, dim]


@dataclass(frozen=True)
class Spans:
    """One layer's context as the arena holds it, for a kernel that reads rows in place
    (``node.models.kernels``' ``prefill_attention_spans``): no view per run is made -- in a
    churned arena a context lies in dozens of one-block runs, and a Python view of each cost
    more than attending a short one."""

    k: torch.Tensor
    """The layer's keys, [heads, arena tokens, dim]."""
    v: torch.Tensor
    """Its values, the same shape."""
    runs: torch.Tensor
    """int64 [runs, 2]: (arena start, length) of each run of the context, in position order."""

@dataclass(frozen=True)
class ArenaStep:
    """Where a kernel that runs every layer of a session's one-token step itself (``node.models.
    kernels``' ``decode_layers_int8``) writes and reads: the arena in place, no view made."""

    kv: torch.Tensor
    """The whole arena, [layers, 2 (K, V), heads, arena tokens, dim]."""
    row: int
    """The arena row the reserved token's K and V go to, in every layer."""
    runs: list[tuple[int, int]]
    """(arena start, length) of each run of the context, the new token's row included, in
    position order (Python ints: a tensor of them cost the step two more torch calls)."""


ARENA_STEP_DTYPES = (torch.float32, torch.bfloat16)
"""Arenas an ``ArenaStep`` is offered over (the kernel reads bf16 rows as fp32)."""

NO_ROWS = torch.zeros(0, dtype=torch.long)
"""An empty int64 index: a kernel's tail-slot arguments where no tail is written."""


GATHER_RUN_TOKENS = 32
"""A decode step gathers a context's runs into one copy when there are at least
``GATHER_MIN_RUNS`` of them averaging at most this many tokens: a context scattered block by
block over the arena, as a long-running server's churned prefix cache leaves a new sequence
(``experiments.serve_soak``). Two matmuls per run cost more than the copy there (SmolLM2's
heads, 544 tokens, 1 thread: 34 one-block runs 2.5 ms per layer in place, 0.6 ms gathered,
one run 0.2 ms); runs of whole sessions and prefixes stay in place."""
GATHER_MIN_RUNS = 4


def scattered(lengths: Sequence[int]) -> bool:
    """Runs of these token counts are many and short: one copy beats attending each in place
    (see ``GATHER_RUN_TOKENS``)."""
    return len(lengths) >= GATHER_MIN_RUNS and sum(lengths) <= GATHER_RUN_TOKENS * len(lengths)


def fewer_runs(runs: Sequence[Run]) -> Sequence[Run]:
    """``runs``, or one run holding all of them when they are ``scattered``."""
    if not scattered([k.shape[1] for k, _ in runs]):
        return runs
    return [(torch.cat([k for k, _ in runs], 1), torch.cat([v for _, v in runs], 1))]


def causal_mask(t: int, n: int) -> torch.Tensor | None:
    """bool [t, n]: query j (position n - t + j) sees keys up to its own position. Shared,
    not to be written: every layer of a forward asks for the same one, built once."""
    if t <= 1:
        return None
    return _causal_mask(t, n)


@functools.lru_cache(maxsize=4)
def _causal_mask(t: int, n: int) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
        return torch.ones(t, n, dtype=torch.bool).tril(diagonal=n - t)


def compute_dtype(q: torch.Tensor, kv: torch.Tensor | None, rows: int = 1) -> torch.dtype:
    """The precision attention runs in, for ``rows`` query positions per head: decode (one
    row) runs in the wider of the queries' and the cache's dtypes (``torch.promote_types``) --
    a bf16 model over an fp32 cache casts its query up, not the whole context down every
    layer; a prefill of bf16 queries over an fp32 cache runs in bf16 -- its rows x context
    products on the CPU's bf16 units (SDPA's flash kernel) outweigh casting the context once.
    An fp16 cache under an fp32 model is cast up."""
    if kv is None:
        return q.dtype
    if rows > 1 and q.dtype == torch.bfloat16 and kv.dtype == torch.float32:
        return q.dtype
    return torch.promote_types(q.dtype, kv.dtype)


def _in_dtype(runs: Sequence[Run], dtype: torch.dtype) -> Sequence[Run]:
    """An fp16 cache's runs in the queries' precision."""
    if runs and runs[0][0].dtype != dtype:
        return [(k.to(dtype), v.to(dtype)) for k, v in runs]
    return runs


def attend(q: torch.Tensor, runs: Sequence[Run], keep: torch.Tensor | None = None,
           weights: bool = False):
    """q: [heads, t, dim], the newest t positions' queries -> [heads, t, dim]; or, grouped
    (GQA), [kv_heads, G, t, dim] over runs of [kv_heads, n, dim] -> [kv_heads, G, t, dim].

    ``keep`` (bool [n]) leaves positions out (a sparsity policy's mask); with ``weights``
    the softmax weights [heads, t, n] (grouped: [kv_heads, G, t, n]) come back too, for the
    policy to observe."""
    dt = compute_dtype(q, runs[0][0] if runs else None, q.shape[-2])
    if dt != q.dtype:
        out = attend(q.to(dt), runs, keep, weights)
        return (out[0].to(q.dtype), out[1]) if weights else out.to(q.dtype)
    if q.dim() == 4:
        if q.shape[1] == 1:  # one query head per KV head: multi-head attention
            out = attend(q[:, 0], runs, keep, weights)
            return (out[0][:, None], out[1][:, None]) if weights else out[:, None]
        return _attend_grouped(q, runs, keep, weights)
    runs = fewer_runs(_in_dtype(runs, q.dtype))
    n = sum(k.shape[1] for k, _ in runs)
    if len(runs) == 1 and keep is None and not weights and n == q.shape[1] > 1:
        k, v = runs[0]  # prefill of the whole context: SDPA's causal kernel, no mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = causal_mask(q.shape[1], n)
    if keep is not None:
        mask = keep.expand(q.shape[1], -1) if mask is None else mask & keep
    if len(runs) == 1 and mask is not None and not weights:  # prefill: SDPA's fused kernel
        k, v = runs[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # decode: two matmuls and a softmax beat CPU SDPA for one query (bench_kv's profile
    # section: micro_per_layer attend_one_query_us vs sdpa_one_query_us) and take the runs
    # in place
    scores = _scores(q, runs)
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


def _scores(rows: torch.Tensor, runs: Sequence[Run]) -> torch.Tensor:
    """rows @ K^T over every run, concatenated (no concatenation copy for a single run)."""
    if len(runs) == 1:
        return torch.matmul(rows, runs[0][0].transpose(-1, -2))
    return torch.cat([torch.matmul(rows, k.transpose(-1, -2)) for k, _ in runs], dim=-1)


def _attend_grouped(q: torch.Tensor, runs: Sequence[Run], keep: torch.Tensor | None,
                    weights: bool):
    """``attend`` for q [Hk, G, T, D], G > 1.

    - prefill (T > 1, no weights wanted): SDPA over K/V *expanded* with stride 0 to
      [Hk, G, n, D] (several runs are concatenated first), ``is_causal`` when the T queries
      are the whole context, else the [T, n] mask. Measured (1 thread, 2,048 tokens,
      SmolLM2's 3x3x64 heads): 0.15-0.24 s per layer, against 0.67 s for the flattened
      [Hk, G*T, D] form with a tiled mask and 0.6-0.7 s for ``enable_gqa`` or
      ``repeat_interleave`` (neither reaches the fused kernel);
    - otherwise (decode, a sparsity mask with weights): the group's G*T queries as rows of
      one matmul against each run in place, one softmax over the concatenated scores, the
      mask broadcast over the group axis."""
    Hk, G, T, D = q.shape
    runs = fewer_runs(_in_dtype(runs, q.dtype))
    n = sum(k.shape[1] for k, _ in runs)
    if T > 1 and not weights:
        k = runs[0][0] if len(runs) == 1 else torch.cat([k for k, _ in runs], 1)
        v = runs[0][1] if len(runs) == 1 else torch.cat([v for _, v in runs], 1)
        k, v = k[:, None].expand(Hk, G, n, D), v[:, None].expand(Hk, G, n, D)
        if keep is None and n == T:  # the whole context: no mask to build or read
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = causal_mask(T, n)
        mask = mask if keep is None else mask & keep
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mask = causal_mask(T, n)
    if keep is not None:
        mask = keep.expand(T, -1) if mask is None else mask & keep
    rows = q.reshape(Hk, G * T, D)
    if len(runs) == 1 and mask is None and not weights:  # one query, one run: no copies
        k, v = runs[0]
        p = torch.softmax(torch.matmul(rows, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(D)), -1)
        return torch.matmul(p, v).view(Hk, G, T, D)
    scores = _scores(rows, runs)
    scores = scores.mul_(1.0 / math.sqrt(D)).view(Hk, G, T, n)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    pr = p.view(Hk, G * T, n)
    out, a = None, 0
    for k, v in runs:
        part = torch.matmul(pr[..., a : a + k.shape[1]], v)
        out = part if out is None else out.add_(part)
        a += k.shape[1]
    out = out.view(Hk, G, T, D)
    return (out, p) if weights else out


def attend_shared(q: torch.Tensor, prefix: Sequence[Run], tail_k: torch.Tensor,
                  tail_v: torch.Tensor, tail_valid: torch.Tensor) -> torch.Tensor:
    """One decode step of B sessions sharing ``prefix``.

    q: [heads, B, dim] (one new token per session); prefix: runs of the shared K/V, each
    [heads, n, dim]; tail_k/tail_v: [heads, B, T, dim], each session's own tokens padded to T;
    tail_valid: bool [B, T]. Returns [heads, B, dim]. Grouped (GQA): q [kv_heads, G, B, dim]
    over K/V of kv_heads heads -> [kv_heads, G, B, dim]; the prefix is read once for all
    G * B rows. Runs in :func:`compute_dtype`; the result has q's dtype. bf16 tails
    (``CacheConfig.batch_tail_dtype``) are a storage format: read as fp32, as the arena's.
    """
    if tail_k.dtype == torch.bfloat16:
        tail_k, tail_v = tail_k.float(), tail_v.float()
    dt = compute_dtype(q, tail_k)
    if dt != q.dtype or tail_k.dtype != dt:
        prefix = [(k.to(dt), v.to(dt)) for k, v in prefix]
        return attend_shared(q.to(dt), prefix, tail_k.to(dt), tail_v.to(dt), tail_valid).to(q.dtype)
    if q.dim() == 4:
        if q.shape[1] == 1:
            return attend_shared(q[:, 0], prefix, tail_k, tail_v, tail_valid)[:, None]
        return _attend_shared_grouped(q, prefix, tail_k, tail_v, tail_valid)
    prefix = fewer_runs(prefix)
    scale = 1.0 / math.sqrt(q.shape[-1])
    parts = [torch.matmul(q, k.transpose(-1, -2)) for k, _ in prefix]  # [H, B, n_i]
    tail = _tail_scores(q.unsqueeze(1), tail_k).squeeze(1)  # [H, B, T]
    tail = tail.masked_fill(~tail_valid, float("-inf"))
    p = torch.softmax(torch.cat(parts + [tail], dim=-1).mul_(scale), dim=-1)
    n_tail = tail.shape[-1]
    out = _tail_values(p[None, ..., p.shape[-1] - n_tail :].transpose(0, 1), tail_v).squeeze(1)
    a = 0
    for k, v in prefix:
        out.add_(torch.matmul(p[..., a : a + k.shape[1]], v))
        a += k.shape[1]
    return out


def _tail_scores(q: torch.Tensor, tail_k: torch.Tensor) -> torch.Tensor:
    """q [Hk, G, B, D] . tail_k [Hk, B, T, D] -> [Hk, G, B, T]: a matmul batched over
    (session, head), the order in which a slot-major tail buffer's views fold into one batch
    axis without a copy (an einsum over [H, B] copied and transposed the tails every layer)."""
    return torch.matmul(q.permute(2, 0, 1, 3), tail_k.transpose(0, 1).transpose(-1, -2)
                        ).permute(1, 2, 0, 3)


def _tail_values(p: torch.Tensor, tail_v: torch.Tensor) -> torch.Tensor:
    """p [Hk, G, B, T] . tail_v [Hk, B, T, D] -> [Hk, G, B, D] (batched as ``_tail_scores``)."""
    return torch.matmul(p.permute(2, 0, 1, 3), tail_v.transpose(0, 1)).permute(1, 2, 0, 3)


def _attend_shared_grouped(q: torch.Tensor, prefix: Sequence[Run], tail_k: torch.Tensor,
                           tail_v: torch.Tensor, tail_valid: torch.Tensor) -> torch.Tensor:
    """``attend_shared`` for q [Hk, G, B, D], G > 1: the prefix as one [Hk, G*B, n] matmul
    per run, each session's tail against its G query heads."""
    Hk, G, B, D = q.shape
    prefix = fewer_runs(prefix)
    rows = q.reshape(Hk, G * B, D)
    parts = [torch.matmul(rows, k.transpose(-1, -2)).view(Hk, G, B, -1) for k, _ in prefix]
    tail = _tail_scores(q, tail_k)
    tail = tail.masked_fill(~tail_valid, float("-inf"))
    p = torch.softmax(torch.cat(parts + [tail], dim=-1).mul_(1.0 / math.sqrt(D)), dim=-1)
    n_tail = tail.shape[-1]
    out = _tail_values(p[..., p.shape[-1] - n_tail :], tail_v)
    a = 0
    for k, v in prefix:
        w = p[..., a : a + k.shape[1]].reshape(Hk, G * B, k.shape[1])
        out.add_(torch.matmul(w, v).view(Hk, G, B, D))
        a += k.shape[1]
    return out
