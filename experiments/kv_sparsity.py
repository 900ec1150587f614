"""KV sparsification: memory kept vs quality in a decode loop.

A briefly trained TinyTransformer is teacher-forced through held-out stdlib text one token at a
time. The loop runs the model's layers itself, with explicit per-layer K/V tensors and explicit
softmax weights, so each ``cache.sparsity`` policy (sliding window, H2O top-k, time decay) can
observe the attention and drop positions; dropped positions are masked out of every later
attention and count as freed memory. The full cache runs in the same process on the same
sequences, so every figure is paired.

Measured per (policy, kept fraction): the fraction of K/V positions live at the end of each
sequence (what the policy was sized for) and averaged over the decode steps, top-1 agreement
with the full cache, perplexity and its delta, each with a 95 % t interval over sequences; and
the delta over only the steps at which something had been dropped.

    python -m experiments.kv_sparsity --quick
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy import stats  # installed with opacus

from cache.sparsity import POLICY_NAMES, SparsityPolicy, policy_for
from experiments.output import (
    add_common_args, make_run_dir, markdown_table, plot_lines, print_estimate,
    print_results_dir, progress, write_csv, write_json,
)
from node.tasks.corpus import random_windows, split_corpus
from node.tasks.lm import pretrained_tiny
from node.models.byte_model import ModelConfig, TinyTransformer

COLUMNS = ["policy", "kept_fraction", "kept_measured", "kept_mean_steps", "top1_agreement",
           "top1_ci95", "ppl", "ppl_delta", "ppl_delta_ci95", "sparse_steps",
           "ppl_delta_sparse", "seqs", "context", "seconds"]
TABLE = ["policy", "kept_fraction", "kept_measured", "top1_agreement", "top1_ci95",
         "ppl_delta", "ppl_delta_ci95", "ppl_delta_sparse"]
TRAIN_CONTEXT = inspect.signature(pretrained_tiny).parameters["seq_len"].default
"""The window length pretrained_tiny trains on: the default context here."""
FULL = "full"
"""The name of the no-drop baseline in the results."""

PolicyFactory = Callable[[], SparsityPolicy | None]


@dataclass
class SequenceRun:
    """One teacher-forced sequence: logits of every step and what the cache held."""

    logits: torch.Tensor
    """[steps, vocab]: the prediction made after feeding each token."""
    targets: torch.Tensor
    """[steps]: the next tokens."""
    kept_final: float
    """Live positions / cached positions after the last step, averaged over layers."""
    kept_mean: float
    """The same ratio averaged over every step (memory integrated over the decode)."""
    sparse: torch.Tensor
    """bool [steps]: whether some position was masked out of that step's attention."""


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [H, T, D], keys/values: [H, n, D], live: bool [n] -> (output [H, T, D], softmax
    weights [H, T, n]). Written out (not SDPA) so the weights exist for the policy; dropped
    positions get weight exactly 0. The T queries are the newest positions, so a causal mask
    over them applies when T > 1."""
    T, n = q.shape[1], keys.shape[1]
    scores = (q @ keys.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    allowed = live.expand(T, n)
    if T > 1:
        allowed = allowed & torch.ones(T, n, dtype=torch.bool).tril(diagonal=n - T)
    attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return attn @ values, attn


class ExplicitKV:
    """Per-layer K/V tensors for one sequence plus each layer's live mask: the stand-in for the
    cache engine, so this experiment does not depend on the engine's internals."""

    def __init__(self, cfg: ModelConfig, capacity: int):
        shape = (cfg.n_heads, capacity, cfg.head_dim)
        self.keys = [torch.zeros(shape) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape) for _ in range(cfg.n_layers)]
        self.live = [torch.ones(0, dtype=torch.bool) for _ in range(cfg.n_layers)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the newest tokens' K/V ([H, T, D]); returns the cached length n."""
        start, T = self.live[layer].numel(), k.shape[1]
        self.keys[layer][:, start:start + T] = k
        self.values[layer][:, start:start + T] = v
        self.live[layer] = torch.cat([self.live[layer], torch.ones(T, dtype=torch.bool)])
        return start + T

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.live[layer].numel()
        return self.keys[layer][:, :n], self.values[layer][:, :n], self.live[layer]

    def drop(self, layer: int, keep: torch.Tensor) -> None:
        """Apply a policy's keep mask; a policy that revives a dropped position is a bug."""
        live = self.live[layer]
        if keep.shape != live.shape or keep.dtype != torch.bool:
            raise ValueError(f"keep mask must be bool {tuple(live.shape)}, got "
                             f"{keep.dtype} {tuple(keep.shape)}")
        if (keep & ~live).any():
            raise RuntimeError(f"layer {layer}: the policy revived dropped positions")
        self.live[layer] = keep.clone()

    def kept_ratio(self) -> float:
        return statistics.fmean(float(m.float().mean()) for m in self.live)

    def any_dropped(self) -> bool:
        return any(not bool(m.all()) for m in self.live)


def block_step(blk: torch.nn.Module, x: torch.Tensor, kv: ExplicitKV, layer: int,
               policy: SparsityPolicy | None) -> torch.Tensor:
    """One transformer block over the newest tokens x: [T, d_model], attention through ``kv``;
    the policy sees this step's weights and prunes the layer afterwards."""
    q, k, v = blk._qkv(x)  # [H, T, D]
    n = kv.append(layer, k, v)
    keys, values, live = kv.view(layer)
    out, attn = attend(q, keys, values, live)
    if policy is not None:
        policy.observe(layer, attn)
        kv.drop(layer, policy.keep(layer, n))
    x = x + blk.proj(out.transpose(0, 1).flatten(-2))
    return x + blk.mlp(blk.ln2(x))


@torch.no_grad()
def model_step(model: TinyTransformer, tokens: torch.Tensor, start: int, kv: ExplicitKV,
               policy: SparsityPolicy | None) -> torch.Tensor:
    """Feed ``tokens`` ([T] ids at positions start..start+T-1); returns logits [T, vocab]."""
    x = model.tok(tokens) + model.pos(torch.arange(start, start + tokens.numel()))
    for layer, blk in enumerate(model.blocks):
        x = block_step(blk, x, kv, layer, policy)
    return model.head(model.ln_f(x))


@torch.no_grad()
def decode_sequence(model: TinyTransformer, seq: Sequence[int],
                    policy: SparsityPolicy | None) -> SequenceRun:
    """Teacher-force ``seq`` one token at a time: feed seq[t], predict seq[t+1]."""
    steps = len(seq) - 1
    if steps < 1:
        raise ValueError(f"a sequence needs at least 2 tokens, got {len(seq)}")
    tokens = torch.as_tensor(list(seq), dtype=torch.long)
    kv = ExplicitKV(model.cfg, steps)
    logits, kept, sparse = [], [], []
    for t in range(steps):
        sparse.append(kv.any_dropped())  # what this step's attention will not see
        logits.append(model_step(model, tokens[t:t + 1], t, kv, policy)[-1])
        kept.append(kv.kept_ratio())
    return SequenceRun(logits=torch.stack(logits), targets=tokens[1:], kept_final=kept[-1],
                       kept_mean=statistics.fmean(kept),
                       sparse=torch.tensor(sparse, dtype=torch.bool))


def decode_loop(model: TinyTransformer, seqs: Sequence[Sequence[int]],
                make_policy: PolicyFactory) -> list[SequenceRun]:
    """Every sequence with a fresh policy (policies hold per-session state)."""
    return [decode_sequence(model, seq, make_policy()) for seq in seqs]


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t interval (nan with a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, float(half)


def cross_entropy(run: SequenceRun, where: torch.Tensor | None = None) -> float:
    """Mean next-token cross-entropy (nats) over all steps, or over the ``where`` steps."""
    ce = F.cross_entropy(run.logits, run.targets, reduction="none")
    return float(ce.mean() if where is None else ce[where].mean())


def paired_metrics(runs: Sequence[SequenceRun], base: Sequence[SequenceRun]) -> dict:
    """Quality of ``runs`` against the full-cache ``base`` on the same sequences."""
    top1 = [float((r.logits.argmax(-1) == b.logits.argmax(-1)).float().mean())
            for r, b in zip(runs, base)]
    ppl = [math.exp(cross_entropy(r)) for r in runs]
    delta = [p - math.exp(cross_entropy(b)) for p, b in zip(ppl, base)]
    sparse_delta = [math.exp(cross_entropy(r, r.sparse)) - math.exp(cross_entropy(b, r.sparse))
                    for r, b in zip(runs, base) if r.sparse.any()]
    top1_mean, top1_half = mean_ci95(top1)
    delta_mean, delta_half = mean_ci95(delta)
    return {
        "kept_measured": statistics.fmean(r.kept_final for r in runs),
        "kept_mean_steps": statistics.fmean(r.kept_mean for r in runs),
        "top1_agreement": top1_mean, "top1_ci95": top1_half,
        "ppl": statistics.fmean(ppl), "ppl_delta": delta_mean, "ppl_delta_ci95": delta_half,
        "sparse_steps": statistics.fmean(float(r.sparse.float().mean()) for r in runs),
        "ppl_delta_sparse": statistics.fmean(sparse_delta) if sparse_delta else 0.0,
        "seqs": len(runs),
    }


def sweep_points(quick: bool, policies: Sequence[str] | None = None,
                 fractions: Sequence[float] | None = None) -> list[tuple[str, float]]:
    """(policy, kept fraction) pairs: 50 % and 80 % always (the issue's points), more in a
    full run."""
    fractions = fractions or ((0.5, 0.8) if quick else (0.3, 0.5, 0.65, 0.8))
    return [(name, f) for name in (policies or POLICY_NAMES) for f in fractions]


def run_points(model: TinyTransformer, seqs: list[list[int]], points: list[tuple[str, float]],
               context: int) -> list[dict]:
    """The full-cache baseline, then every point, on the same sequences."""
    t0 = time.perf_counter()
    base = decode_loop(model, seqs, lambda: None)
    rows = [{"policy": FULL, "kept_fraction": 1.0, **paired_metrics(base, base),
             "context": context, "seconds": time.perf_counter() - t0}]
    for name, fraction in progress(points, desc="kv_sparsity"):
        t0 = time.perf_counter()
        runs = decode_loop(model, seqs, lambda: policy_for(name, fraction, context))
        rows.append({"policy": name, "kept_fraction": fraction, **paired_metrics(runs, base),
                     "context": context, "seconds": time.perf_counter() - t0})
    return rows


def plot_results(out, rows: list[dict]) -> None:
    """Delta-ppl and top-1 agreement vs the measured kept fraction, one line per policy, each
    ending at the full cache (1, 0) / (1, 1)."""
    full = next(r for r in rows if r["policy"] == FULL)
    for column, path, label in (("ppl_delta", "ppl_delta_vs_kept.png", "Δppl vs full cache"),
                                ("top1_agreement", "top1_vs_kept.png",
                                 "top-1 agreement with the full cache")):
        series = {}
        for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] != FULL):
            pts = sorted((r["kept_measured"], r[column]) for r in rows if r["policy"] == name)
            pts.append((full["kept_measured"], full[column]))
            series[name] = ([x for x, _ in pts], [y for _, y in pts])
        plot_lines(out / path, series, xlabel="fraction of K/V kept (end of sequence)",
                   ylabel=label, title=f"KV sparsification: {label}", logx=False, logy=False)


@dataclass
class Setting:
    """What a run measures on: the model, its held-out sequences and how they were made."""

    cfg: ModelConfig
    model: TinyTransformer
    seqs: list[list[int]]
    context: int
    train_steps: int


def load_setting(args: argparse.Namespace) -> Setting:
    """The model (as kv_quant loads it) and held-out sequences of ``context + 1`` tokens, so the
    cache holds exactly ``context`` positions at the end of each. The default context is the
    length the model was trained on (``pretrained_tiny``'s windows): later positions have
    untrained position embeddings, which would measure noise rather than sparsification."""
    context = args.context or (64 if args.tiny else TRAIN_CONTEXT)
    n_seqs = args.seqs or (2 if args.tiny else 4 if args.quick else 16)
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=64, context_len=256) if args.tiny \
        else ModelConfig(n_layers=4, n_heads=4, d_model=256)
    if not 2 <= context <= cfg.context_len:
        raise ValueError(f"--context must be in [2, {cfg.context_len}] (the model's positions), "
                         f"got {context}")
    max_bytes = 2_000_000 if args.tiny else None
    steps = 5 if args.tiny else args.train_steps
    model = pretrained_tiny(cfg, steps=steps, seed=args.seed, max_bytes=max_bytes).eval()
    split = split_corpus(1, seed=args.seed, max_bytes=max_bytes)
    g = torch.Generator().manual_seed(args.seed + 11)
    seqs = random_windows(split.heldout, context, n_seqs, g).tolist()  # context + 1 tokens
    return Setting(cfg, model, seqs, context, steps)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, quick_help="CI-sized run (< 1 min on 2 cores once the model is cached)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens fed per sequence = K/V positions at its end "
                   f"(default {TRAIN_CONTEXT}, the model's training length; 64 with --tiny)")
    p.add_argument("--seqs", type=int, default=None,
                   help="held-out sequences (default 4 quick, 16 full)")
    p.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=None)
    p.add_argument("--fractions", nargs="+", type=float, default=None,
                   help="target kept fractions (default 0.5 0.8; full run adds 0.3 0.65)")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    return p.parse_args(argv)


def write_results(out, rows: list[dict], setting: Setting, args: argparse.Namespace,
                  points: list[tuple[str, float]]) -> None:
    write_csv(out / "points.csv", rows, COLUMNS)
    write_json(out / "points.json", rows)
    write_json(out / "config.json", {"model": setting.cfg.__dict__, "context": setting.context,
                                     "seqs": len(setting.seqs), "seed": args.seed,
                                     "points": points, "train_steps": setting.train_steps})
    (out / "summary.md").write_text(
        f"# KV sparsification: kept K/V vs quality ({len(setting.seqs)} held-out sequences x "
        f"{setting.context} tokens, decode loop)\n\nkept_measured = live K/V positions / cached "
        f"positions at the end of each sequence (the policy's size); kept_mean_steps = the same "
        f"averaged over every step. ppl_delta and top1 are paired with the full cache; ci95 is "
        f"the half-width of the 95 % t interval over sequences; ppl_delta_sparse counts only "
        f"steps after the first drop.\n\n" + markdown_table(rows, COLUMNS) + "\n")
    plot_results(out, rows)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    setting = load_setting(args)
    points = sweep_points(args.quick or args.tiny, args.policies, args.fractions)
    # a per-step cost measured on this machine for the bench model (4 layers, d=256)
    per_step_s = 0.0006 if args.tiny else 0.0025
    runs = (len(points) + 1) * len(setting.seqs)
    print_estimate(runs * setting.context * per_step_s,
                   f"{len(points) + 1} runs x {len(setting.seqs)} seqs x {setting.context} steps "
                   f"at ~{per_step_s * 1e3:.1f} ms per decode step, plus any one-off training")
    rows = run_points(setting.model, setting.seqs, points, setting.context)
    out = make_run_dir(args.out, "kv_sparsity")
    write_results(out, rows, setting, args, points)
    print(markdown_table(rows, TABLE))
    print(f"wall time: {time.perf_counter() - t_start:.1f} s (model load/training included)")
    print_results_dir(out)
    return str(out)


if __name__ == "__main__":
    main()
