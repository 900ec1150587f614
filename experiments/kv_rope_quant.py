"""Pre- vs post-RoPE key quantization (KVQuant) on real text with SmolLM2-135M-Instruct.

The cache stores keys *after* RoPE (a prefix hit reuses them as they are) and quantizes them
KIVI-style: per channel over a block's 16 tokens (keys' outliers live in fixed channels), values
per token, ``log8`` scales (``cache.quant.BlockFormat``). KVQuant (Hooper et al., 2024) observes
that RoPE rotates channel pairs by a position-dependent angle, smearing those fixed-channel
outliers across each pair as the block's positions advance, so per-channel scales fit keys
better *before* RoPE. This measures both on held-out text (the source of a stdlib module, not
in any node's training data here):

* **simulation** (the table): the model's cache-free teacher-forced forward, every layer's K/V
  quantized and dequantized through the cache's own ``BlockFormat`` in 16-token blocks, the key
  either *pre-RoPE* (quantize, then rotate the decoded key) or *post-RoPE* (rotate, then
  quantize: what the cache stores); values identical in both. Every position attends quantized
  K/V for its whole context (no full-precision window: a worst case). Storing pre-RoPE keys in
  the cache would need the read path to rotate keys per read (cache/reads.py, steps.py,
  batch.py: outside ``cache/attention.py``), so the pre-RoPE side is simulated, not served.
* **through the cache** (a check of the simulation): the last ``--decode`` tokens teacher-forced
  one at a time through a ``KVCache`` with ``kv_dtype`` int8/int4 (post-RoPE, fp window 32,
  older blocks read back quantized), against the simulation over the same positions.

Figures per K/V dtype and key placement: Δppl against fp32, top-1 agreement with fp32's argmax,
mean KL(fp32 || quantized) in nats, max |Δlogit|.

    python -m experiments.kv_rope_quant --quick        # 256 tokens, ~1 min on one thread
    python -m experiments.kv_rope_quant                # 1,024 tokens
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from cache import KVCache
from cache.quant import BlockFormat
from experiments.output import (
    add_common_args, make_run_dir, markdown_table, print_results_dir, write_csv, write_json,
)
from node.models.llama import LlamaConfig, LlamaModel, apply_rope

BLOCK = 16
COLUMNS = ["kv_dtype", "keys", "where", "positions", "ppl", "ppl_delta", "top1_agreement",
           "kl_nats", "max_abs_dlogit"]


def held_out_ids(tokenizer, n: int, module: str = "textwrap") -> list[int]:
    """The first ``n`` tokens of a stdlib module's source."""
    mod = __import__(module)
    with open(mod.__file__, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    if len(ids) < n:
        raise ValueError(f"{module} has only {len(ids)} tokens, {n} wanted")
    return list(ids[:n])


def qdq(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat | None, kv_dtype: str):
    """K, V [Hk, N, D] through the cache's block format in 16-token blocks and back (the
    last partial block padded by repeating its last token: the ranges stay its own)."""
    if kv_dtype == "fp32":
        return k, v
    if kv_dtype == "fp16":
        return k.half().float(), v.half().float()
    Hk, N, D = k.shape
    pad = (-N) % BLOCK

    def blocks(x):
        if pad:
            x = torch.cat([x, x[:, -1:].expand(Hk, pad, D)], 1)
        return x.view(Hk, -1, BLOCK, D).transpose(0, 1).contiguous()  # [nb, Hk, B, D]

    kb, vb = fmt.decode(fmt.encode(blocks(k), blocks(v)))

    def back(x):
        return x.transpose(0, 1).reshape(Hk, -1, D)[:, :N]

    return back(kb), back(vb)


@torch.no_grad()
def forward_quantized(model: LlamaModel, ids: list[int], kv_dtype: str, keys: str) -> torch.Tensor:
    """Teacher-forced logits [N, vocab] with every layer's K/V quantized (``keys`` "pre" or
    "post" RoPE); the model's own modules, its cache-free attention otherwise."""
    c = model.cfg
    fmt = None
    if kv_dtype in ("int8", "int4"):
        fmt = BlockFormat(kv_dtype, "kivi", c.num_kv_heads, BLOCK, c.head_dim, scales="log8")
    idx = torch.tensor(ids)
    N = idx.numel()
    cos, sin = model._rope(torch.arange(N))
    x = model.model.embed_tokens(idx)
    for layer in model.model.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)

        def heads(t, n):
            return t.unflatten(-1, (n, c.head_dim)).transpose(0, 1)

        q = apply_rope(heads(at.q_proj(h), c.num_heads), cos, sin)
        k, v = heads(at.k_proj(h), c.num_kv_heads), heads(at.v_proj(h), c.num_kv_heads)
        if keys == "pre":
            k, v = qdq(k, v, fmt, kv_dtype)
            k = apply_rope(k, cos, sin)
        else:
            k, v = qdq(apply_rope(k, cos, sin), v, fmt, kv_dtype)
        q = q.unflatten(0, (c.num_kv_heads, c.group))
        k, v = k[:, None].expand_as(q), v[:, None].expand_as(q)
        x = x + at._out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


@torch.no_grad()
def through_cache(model: LlamaModel, ids: list[int], kv_dtype: str, decode: int) -> torch.Tensor:
    """Logits [decode, vocab] predicting the last ``decode`` tokens: the rest prefilled, then
    teacher-forced one token per step through a KVCache of ``kv_dtype``."""
    kv = KVCache(model.cache_config(kv_dtype=kv_dtype, pool_bytes=256 << 20))
    sid = kv.open_session()
    split = len(ids) - decode
    rows = [model.forward_cached(ids[:split], kv, sid, last_only=True)[-1]]
    for t in ids[split:-1]:
        rows.append(model.forward_cached([t], kv, sid)[-1])
    if kv_dtype in ("int8", "int4"):
        assert kv.stats()["quantized_blocks"] > 0
    return torch.stack(rows)


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """ref/got: logits [n, V] predicting ``targets`` [n]."""
    ppl_ref = math.exp(float(F.cross_entropy(ref, targets)))
    ppl = math.exp(float(F.cross_entropy(got, targets)))
    lr, lg = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    kl = float((lr.exp() * (lr - lg)).sum(-1).mean())
    return {"positions": int(targets.numel()), "ppl": round(ppl, 4),
            "ppl_delta": round(ppl - ppl_ref, 4),
            "top1_agreement": round(float((ref.argmax(-1) == got.argmax(-1)).float().mean()), 4),
            "kl_nats": round(kl, 5), "max_abs_dlogit": round(float((ref - got).abs().max()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, quick_help="256 tokens, 32 decoded through the cache (~1 min)")
    parser.add_argument("--tokens", type=int, default=None, help="held-out tokens (1,024)")
    parser.add_argument("--decode", type=int, default=None,
                        help="tokens teacher-forced through the cache at the end (128)")
    parser.add_argument("--module", default="textwrap", help="stdlib module whose source is read")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-cache-check", action="store_true")
    args = parser.parse_args()
    n = args.tokens or (256 if args.quick else 1024)
    decode = args.decode or (32 if args.quick else 128)
    torch.set_num_threads(args.threads)
    from node.models import smollm2 as models

    t0 = time.perf_counter()
    loaded = models.load(verify_hashes=False)
    model = LlamaModel.from_state_dict(LlamaConfig.from_hf(loaded.config), loaded.state_dict)
    ids = held_out_ids(loaded.tokenizer(), n, args.module)
    targets = torch.tensor(ids[1:])
    ref = forward_quantized(model, ids, "fp32", "post")[:-1]
    rows = []
    for kv_dtype in ("fp16", "int8", "int4"):
        for keys in (("post",) if kv_dtype == "fp16" else ("pre", "post")):
            got = forward_quantized(model, ids, kv_dtype, keys)[:-1]
            rows.append({"kv_dtype": kv_dtype, "keys": f"{keys}-RoPE", "where": "simulated",
                         **compare(ref, got, targets)})
            if kv_dtype != "fp16" and not args.no_cache_check:  # the same tail positions
                rows.append({"kv_dtype": kv_dtype, "keys": f"{keys}-RoPE",
                             "where": f"simulated, last {decode}",
                             **compare(ref[-decode:], got[-decode:], targets[-decode:])})
            del got
    if not args.no_cache_check:
        for kv_dtype in ("int8", "int4"):
            got = through_cache(model, ids, kv_dtype, decode)
            rows.append({"kv_dtype": kv_dtype, "keys": "post-RoPE",
                         "where": f"KVCache, last {decode}",
                         **compare(ref[-decode:], got, targets[-decode:])})
    ppl_ref = math.exp(float(F.cross_entropy(ref, targets)))
    result = {"model": "SmolLM2-135M-Instruct", "text": f"{args.module}.py source",
              "tokens": n, "decode": decode, "threads": args.threads, "block_size": BLOCK,
              "ppl_fp32": round(ppl_ref, 4), "seconds": round(time.perf_counter() - t0, 1),
              "rows": rows}
    run_dir = make_run_dir(args.out, "kv_rope_quant")
    write_csv(run_dir / "points.csv", rows, COLUMNS)
    write_json(run_dir / "result.json", result)
    (run_dir / "summary.md").write_text(
        f"# Pre- vs post-RoPE key quantization, SmolLM2, {n} tokens of {args.module}.py "
        f"(fp32 ppl {ppl_ref:.3f})\n\n" + markdown_table(rows, COLUMNS) + "\n")
    print(markdown_table(rows, COLUMNS))
    print_results_dir(run_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
