"""What example-level DP costs the chat task: SmolLM2-135M-Instruct fine-tuned by 5 nodes under
CKKS with FFA-LoRA (A frozen from a public seed, B trained) or plain LoRA (A and B trained), at
example-level ε ∈ {1, 3, 8, ∞} (δ 1e-5, over the whole run), plus the base model without
adapters, over paired seeds (a seed fixes the data split and the public A; DP-SGD's noise and
batches come from OS entropy). Reported per method and ε: held-out answer perplexity (mean and
95 % CI over seeds), the share of the fine-tuning gain kept, the ε spent, one node's CKKS upload
per round, and a general-question probe (``experiments.general_probe``) of base vs fine-tuned.
One point = ``experiments.finetune_points.run_point``.

    python -m experiments.private_finetune                 # ~1 h on 2 cores (the estimate prints first)
    python -m experiments.private_finetune --resume results/private_finetune/<stamp>
    python -m experiments.private_finetune --quick --json  # chat:tiny, a minute (tests)

Every point is written to ``<run dir>/points/<method>-eps<e>-seed<s>.json`` (the base model's to
``base-seed<s>.json``) as soon as it is done, and skipped when ``--resume`` finds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

from experiments.finetune_points import METHODS, PointConfig, base_point, run_point
from experiments.output import (add_common_args, make_run_dir, markdown_table, plot_lines, print_estimate,
                                print_results_dir, progress, write_csv, write_json)
from experiments.privacy_accuracy import mean_ci, mean_ci_json

EPSILONS = ("1", "3", "8", "inf")
"""The ε keys of the results (``inf``: no DP-SGD)."""
QUICK = dict(chat_model="tiny", nodes=3, rounds=1, steps=2, batch=4, eval_examples=2)
"""``--quick``: the random 2-layer ``chat:tiny``, one round of two steps (every output, tests)."""
EXAMPLE_S = {"smollm2": 0.3, "tiny": 0.02}
"""Seconds per DP-SGD example (forward + backward) on 2 free cores. SmolLM2: a point of 5 nodes x
2 rounds x 3 steps x batch 8 (240 examples) trained in 62-68 s on this machine, nothing else
running (2026-12-05)."""
NON_PRIVATE_SHARE = 0.66


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Infinity: None stands for 'not defined' (one seed's CI, no gain)."""
    return x if x is not None and math.isfinite(x) else None


def gain_kept(base: float, private: float, non_private: float) -> float:
    """(base − private) / (base − non-private): 1 = DP kept all of the fine-tuning's perplexity
    gain, 0 = none, < 0 = worse than the base; NaN when fine-tuning gained nothing."""
    gain = base - non_private
    return (base - private) / gain if gain > 0 and math.isfinite(gain) else math.nan


def _epsilon_entry(pts: list[dict], base_ppl: float, np_ppl: float, delta: float) -> dict:
    ppl, ci = mean_ci_json([p["perplexity"] for p in pts])
    spent = [p["epsilon_example"] for p in pts if p["epsilon_example"] is not None]
    return {"perplexity_mean": _finite(ppl), "perplexity_ci95": ci,
            "gain_kept": _finite(gain_kept(base_ppl, ppl, np_ppl)),
            "epsilon_example": max(spent) if spent else None, "delta": delta,
            "upload_bytes": max(p["upload_bytes"] for p in pts), "upload_values": pts[0]["upload_values"],
            "probe_score_mean": _finite(mean_ci([p["probe_accuracy"] for p in pts])[0]),
            "probe_margin_mean": _finite(mean_ci([p["probe_margin"] for p in pts])[0]),
            "noise_multiplier": max(p["noise_multiplier"] for p in pts),
            "seeds": sorted(p["seed"] for p in pts), "perplexities": [p["perplexity"] for p in pts]}


def summarise(points: Sequence[dict], bases: Sequence[dict], delta: float) -> dict:
    """The results' ``base``, ``non_private`` and ``by_method`` from the point results (each
    ``run_point``'s / ``base_point``'s dict; ``epsilon`` inf = no DP). Means over seeds;
    ``gain_kept`` from the means against the same method's ε = ∞."""
    base_ppl, base_ci = mean_ci_json([b["perplexity"] for b in bases])
    by_method: dict[str, dict] = {}
    for method in METHODS:
        mine = [p for p in points if p["method"] == method]
        at = {e: [p for p in mine if _eps_key(p["epsilon"]) == e] for e in EPSILONS}
        np_ppl = mean_ci([p["perplexity"] for p in at["inf"]])[0]
        by_method[method] = {"by_epsilon": {e: _epsilon_entry(pts, base_ppl, np_ppl, delta)
                                            for e, pts in at.items() if pts}}
    ffa_np = by_method["ffa_lora"]["by_epsilon"].get("inf", {})
    return {"base": {"perplexity": _finite(base_ppl), "perplexity_ci95": base_ci,
                     "probe_score_mean": _finite(mean_ci([b["probe_accuracy"] for b in bases])[0]),
                     "probe_margin_mean": _finite(mean_ci([b["probe_margin"] for b in bases])[0])},
            "non_private": {"method": "ffa_lora", "perplexity": ffa_np.get("perplexity_mean"),
                            "perplexity_ci95": ffa_np.get("perplexity_ci95")},
            "by_method": by_method}


def _eps_key(epsilon: float) -> str:
    return "inf" if math.isinf(epsilon) else f"{epsilon:g}"


def point_name(method: str, epsilon: float, seed: int) -> str:
    return f"{method}-eps{_eps_key(epsilon)}-seed{seed}.json"


def _save(path: Path, obj: dict) -> None:
    """Written whole or not at all (a run killed mid-write leaves no half point to resume from)."""
    tmp = path.with_suffix(".tmp")
    write_json(tmp, obj)
    os.replace(tmp, path)


def _load_or_run(path: Path, make) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    result = make()
    _save(path, result)
    return result


def _open_run_dir(args: argparse.Namespace, settings: dict) -> Path:
    """A fresh run directory, or ``--resume``'s after checking it was made with these settings."""
    if not args.resume:
        run_dir = make_run_dir(args.out, "private_finetune")
    else:
        run_dir = Path(args.resume)
        saved = run_dir / "settings.json"
        if not saved.is_file():
            raise SystemExit(f"--resume {run_dir}: no settings.json there (not a private_finetune run directory)")
        old = json.loads(saved.read_text())
        if old != json.loads(json.dumps(settings)):
            diff = sorted(k for k in old.keys() | settings.keys() if old.get(k) != settings.get(k))
            raise SystemExit(f"--resume {run_dir}: it was run with other settings ({', '.join(diff)}); "
                             "pass the same flags or start a new run")
    (run_dir / "points").mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "settings.json", settings)
    return run_dir


def _plan(seeds: Sequence[int], epsilons: Sequence[str]) -> list[tuple[str, float, int]]:
    return [(m, float(e), s) for s in seeds for m in METHODS for e in epsilons]


def _estimate(cfg: PointConfig, todo: list[tuple[str, float, int]], bases: int) -> None:
    examples = cfg.nodes * cfg.rounds * cfg.epochs * cfg.steps * cfg.batch
    smol = cfg.chat_model == "smollm2"
    seconds = sum(examples * EXAMPLE_S[cfg.chat_model] * (1.0 if math.isfinite(e) else NON_PRIVATE_SHARE)
                  + 15 * smol for _, e, _ in todo) + bases * (15 if smol else 2)
    print_estimate(seconds, f"{len(todo)} points to run, each {cfg.nodes} nodes x {cfg.rounds} "
                   f"rounds x {cfg.epochs * cfg.steps} steps x batch {cfg.batch} at ~{EXAMPLE_S[cfg.chat_model]} s "
                   "per example backward on 2 free cores, plus loading and evaluation")


def _outputs(run_dir: Path, out: dict, points: list[dict]) -> None:
    write_json(run_dir / "results.json", out)
    write_csv(run_dir / "points.csv", [{k: v for k, v in p.items()} for p in points])
    rows = [{"method": m, "epsilon": e} | {k: v.get(k) for k in ("perplexity_mean", "gain_kept", "epsilon_example",
                                                                 "probe_score_mean", "upload_bytes")}
            for m, d in out["by_method"].items() for e, v in d["by_epsilon"].items()]
    (run_dir / "summary.md").write_text(
        f"# private_finetune\n\nbase perplexity {out['base']['perplexity']}, probe "
        f"{out['base']['probe_score_mean']}\n\n" + markdown_table(rows))
    series, styles = {}, {}
    for m, d in out["by_method"].items():
        finite = [(float(e), v["perplexity_mean"]) for e, v in d["by_epsilon"].items() if e != "inf"]
        if finite:
            series[m] = ([x for x, _ in finite], [y for _, y in finite])
        if "inf" in d["by_epsilon"] and finite:
            series[f"{m} non-private"] = ([finite[0][0], finite[-1][0]], [d["by_epsilon"]["inf"]["perplexity_mean"]] * 2)
            styles[f"{m} non-private"] = {"linestyle": "--", "marker": ""}
    if out["base"]["perplexity"] is not None and series:
        xs = [x for v in series.values() for x in v[0]]
        series["base (no adapters)"] = ([min(xs), max(xs)], [out["base"]["perplexity"]] * 2)
        styles["base (no adapters)"] = {"linestyle": ":", "marker": "", "color": "black"}
    plot_lines(run_dir / "perplexity_vs_epsilon.png", series, xlabel="example-level ε (δ 1e-5)",
               ylabel="held-out answer perplexity", logy=False, styles=styles,
               title="private fine-tuning: utility vs ε")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.private_finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick_help="chat:tiny (random 2-layer Llama), 1 round of 2 steps, 2 seeds (tests)")
    d = PointConfig()
    p.add_argument("--seeds", type=int, default=3, help="paired seeds (default 3)")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"nodes, 5-10 (default {d.nodes})")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"federated rounds (default {d.rounds})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"DP-SGD/AdamW steps per round (default {d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"expected Poisson batch (default {d.batch})")
    p.add_argument("--clip", type=float, default=d.example_clip, help="per-example L2 bound (default 1)")
    p.add_argument("--epsilons", default=",".join(EPSILONS), help="subset of 1,3,8,inf (default all)")
    p.add_argument("--methods", default=",".join(METHODS), help="subset of ffa_lora,lora (default both)")
    p.add_argument("--aggregation", choices=("ckks", "plaintext"), default=d.aggregation,
                   help="ckks: encrypt/aggregate/decrypt every round (default); plaintext: numpy mean, bytes measured")
    p.add_argument("--resume", default="", help="finish the run in this directory (skips its written points)")
    p.add_argument("--json", action="store_true", help="print the results JSON")
    return p


def _config(args: argparse.Namespace) -> tuple[PointConfig, list[int], list[str], list[str]]:
    eps = [e.strip() for e in args.epsilons.split(",") if e.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if bad := [e for e in eps if e not in EPSILONS] + [m for m in methods if m not in METHODS]:
        raise SystemExit(f"unknown --epsilons/--methods value(s) {bad}; use {EPSILONS} and {METHODS}")
    if args.quick:
        cfg = PointConfig(**QUICK, aggregation=args.aggregation)
        seeds = 2
    else:
        if not 5 <= args.nodes <= 10:
            raise SystemExit(f"--nodes must be 5-10, not {args.nodes}")
        cfg = PointConfig(nodes=args.nodes, rounds=args.rounds, steps=args.steps, batch=args.batch,
                          example_clip=args.clip, aggregation=args.aggregation)
        seeds = args.seeds
    return cfg, [args.seed + s for s in range(seeds)], eps, methods


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    cfg, seeds, eps, methods = _config(args)
    settings = dataclasses.asdict(cfg) | {"seeds": seeds, "epsilons": eps, "methods": methods, "quick": args.quick}
    run_dir = _open_run_dir(args, settings)
    pdir = run_dir / "points"
    plan = [pt for pt in _plan(seeds, eps) if pt[0] in methods]
    todo = [pt for pt in plan if not (pdir / point_name(*pt)).is_file()]
    _estimate(cfg, todo, sum(not (pdir / f"base-seed{s}.json").is_file() for s in seeds))
    bases = [_load_or_run(pdir / f"base-seed{s}.json", lambda s=s: base_point(cfg, s)) for s in seeds]
    points = [_load_or_run(pdir / point_name(*pt), lambda pt=pt: run_point(cfg, *pt))
              for pt in progress(plan, desc="private_finetune")]
    out = summarise(points, bases, cfg.delta) | {
        "aggregation": "ckks" if cfg.aggregation == "ckks" else "plaintext (ckks bytes measured)",
        "wall_s": time.perf_counter() - t0,
        "points_wall_s": sum(p["wall_s"] for p in points) + sum(b["wall_s"] for b in bases),
        "settings": settings}
    _outputs(run_dir, out, points)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for m, d in out["by_method"].items():
            for e, v in d["by_epsilon"].items():
                print(f"{m:8s} ε {e:>3s}: perplexity {v['perplexity_mean']:.3f} (base {out['base']['perplexity']:.3f}), "
                      f"gain kept {v['gain_kept']}, probe {v['probe_score_mean']}, upload {v['upload_bytes']:,} B")
    print_results_dir(run_dir)
    return out


if __name__ == "__main__":
    main()
