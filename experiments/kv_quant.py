"""KV quantization: memory vs quality in a decode loop.

For fp32/fp16/int8/int4 (KIVI scales, and the article's per-layer scales for int8/int4) and a
few full-precision window sizes, a briefly trained TinyTransformer is teacher-forced through
held-out stdlib text one token at a time, so every step reads quantized blocks. Measured per
point: bytes per token actually stored at the end of each sequence (scales, window and
partial blocks included; the decoded read buffer of the active session is not counted -- it
is bounded by ``read_buffer_fraction`` and released when the session goes idle), top-1 agreement with fp32, and the perplexity delta.

    python -m experiments.kv_quant --quick
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from cache import KVCache
from experiments.output import (
    add_common_args, make_run_dir, markdown_table, plot_lines, print_estimate,
    print_results_dir, progress, write_csv, write_json,
)
from node.tasks.corpus import random_windows, split_corpus
from node.tasks.lm import pretrained_tiny
from node.models.byte_model import ModelConfig, TinyTransformer

COLUMNS = ["kv_dtype", "scheme", "fp_window", "block_size", "bytes_per_token",
           "bytes_vs_fp16", "top1_agreement", "ppl", "ppl_delta", "quantized_blocks",
           "kept_fp_blocks", "mean_block_error", "seconds"]


def decode_loop(model: TinyTransformer, seqs: list[list[int]], kv: KVCache) -> dict:
    """Teacher-forced decode through ``kv``: per-position cross-entropy and argmax, plus the
    allocated bytes per token measured when each sequence is complete."""
    ce: list[float] = []
    top: list[int] = []
    alloc: list[float] = []
    for seq in seqs:
        sid = kv.open_session()
        for t in range(len(seq) - 1):
            logits = model.forward_cached([seq[t]], kv, sid)[-1]
            ce.append(float(F.cross_entropy(logits[None], torch.tensor([seq[t + 1]]))))
            top.append(int(logits.argmax()))
        alloc.append(kv.stats()["bytes_stored"] / kv.length(sid))
        kv.close_session(sid)
        kv.bump_version()  # drop it from the prefix cache: the next sequence starts empty
    return {"ce": ce, "top": top, "bytes_per_token": sum(alloc) / len(alloc)}


def points(quick: bool) -> list[tuple[str, str, int]]:
    windows = [0, 32, 128] if quick else [0, 32, 64, 128, 256]
    pts = [("fp32", "kivi", 0), ("fp16", "kivi", 0)]
    for dtype in ("int8", "int4"):
        pts += [(dtype, "kivi", w) for w in windows]
        pts.append((dtype, "per_layer", windows[1]))
    return pts


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    p.add_argument("--seqs", type=int, default=None, help="held-out sequences")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seq_len = args.seq_len or (96 if args.tiny else 384 if args.quick else 768)
    n_seqs = args.seqs or (1 if args.tiny else 3 if args.quick else 8)
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=64, context_len=256) if args.tiny \
        else ModelConfig(n_layers=4, n_heads=4, d_model=256)
    steps = 5 if args.tiny else args.train_steps
    pts = points(args.quick or args.tiny)
    # a per-token cost measured on this machine for the bench model, in a quiet moment
    per_token_s = 0.004 if not args.tiny else 0.001
    print_estimate(len(pts) * n_seqs * seq_len * per_token_s + (0 if args.tiny else 60),
                   f"{len(pts)} points x {n_seqs} x {seq_len} tokens at ~{per_token_s*1e3:.0f} ms "
                   "per decode step, plus up to 60 s of one-off training")
    model = pretrained_tiny(cfg, steps=steps, seed=args.seed,
                            max_bytes=2_000_000 if args.tiny else None).eval()
    split = split_corpus(1, seed=args.seed, max_bytes=2_000_000 if args.tiny else None)
    g = torch.Generator().manual_seed(args.seed + 11)
    seqs = random_windows(split.heldout, seq_len, n_seqs, g).tolist()
    pool = 2 * n_seqs * (seq_len + 2 * args.block_size) * int(cfg.cache_config(
        block_size=args.block_size).block_bytes_fp32 / args.block_size) + (16 << 20)

    runs: dict[tuple[str, str, int], dict] = {}
    for dtype, scheme, window in progress(pts, desc="kv_quant"):
        t0 = time.perf_counter()
        kv = KVCache(cfg.cache_config(block_size=args.block_size, kv_dtype=dtype,
                                      quant_scheme=scheme, fp_window=window, pool_bytes=pool))
        r = decode_loop(model, seqs, kv)
        st = kv.stats()
        r.update(seconds=time.perf_counter() - t0, quantized=st["quantized_blocks"],
                 kept=st["kept_full_precision_blocks"], err=st["mean_quant_error"])
        runs[(dtype, scheme, window)] = r
    base = runs[("fp32", "kivi", 0)]
    fp16_bytes = runs[("fp16", "kivi", 0)]["bytes_per_token"]
    base_ce = sum(base["ce"]) / len(base["ce"])
    rows = []
    for (dtype, scheme, window), r in runs.items():
        ce = sum(r["ce"]) / len(r["ce"])
        rows.append({
            "kv_dtype": dtype, "scheme": scheme, "fp_window": window,
            "block_size": args.block_size, "bytes_per_token": r["bytes_per_token"],
            "bytes_vs_fp16": r["bytes_per_token"] / fp16_bytes,
            "top1_agreement": sum(a == b for a, b in zip(r["top"], base["top"])) / len(base["top"]),
            "ppl": math.exp(ce), "ppl_delta": math.exp(ce) - math.exp(base_ce),
            "quantized_blocks": r["quantized"], "kept_fp_blocks": r["kept"],
            "mean_block_error": r["err"], "seconds": r["seconds"],
        })
    out = make_run_dir(args.out, "kv_quant")
    write_csv(out / "points.csv", rows, COLUMNS)
    write_json(out / "config.json", {"model": cfg.__dict__, "seq_len": seq_len, "seqs": n_seqs,
                                     "block_size": args.block_size, "seed": args.seed,
                                     "train_steps": steps})
    (out / "summary.md").write_text(
        f"# KV quantization: memory vs quality ({n_seqs} held-out sequences x {seq_len} tokens, "
        f"decode loop)\n\nbytes_per_token = slot bytes allocated / tokens at the end of each "
        f"sequence (scales, full-precision window and partial last block included).\n\n"
        + markdown_table(rows, COLUMNS) + "\n")
    series = {}
    for dtype in ("int8", "int4"):
        pts_d = sorted((r["bytes_per_token"], max(1e-4, 1 - r["top1_agreement"]))
                       for r in rows if r["kv_dtype"] == dtype and r["scheme"] == "kivi")
        series[f"{dtype} (KIVI, windows)"] = ([x for x, _ in pts_d], [y for _, y in pts_d])
    series["fp16"] = ([fp16_bytes], [max(1e-4, 1 - next(
        r["top1_agreement"] for r in rows if r["kv_dtype"] == "fp16"))])
    plot_lines(out / "memory_vs_quality.png", series, xlabel="bytes per token (allocated)",
               ylabel="1 - top-1 agreement with fp32 (floored at 1e-4)",
               title="KV quantization: memory vs quality", logx=True, logy=True)
    print(markdown_table(rows, ["kv_dtype", "scheme", "fp_window", "bytes_vs_fp16",
                                "top1_agreement", "ppl_delta"]))
    print_results_dir(out)
    return str(out)


if __name__ == "__main__":
    main()
