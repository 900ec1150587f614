"""Privacy vs accuracy: an ε sweep over fedkv's DP modes and Flower's DP baseline, with a
membership-inference attack as the empirical privacy measure.

    python -m experiments.privacy_accuracy            # full digits sweep (duration printed first)
    python -m experiments.privacy_accuracy --quick    # CI-sized
    python -m experiments.privacy_accuracy --task lm --populations 10 --modes distributed,local

Modes (same seeds, rounds, clients, clip norm for every point):

* ``distributed``    fedkv: update clipping + distributed Gaussian noise shares, CKKS sum (he=true)
* ``flower-central`` Flower's DifferentialPrivacyClientSideFixedClipping (he=false)
* ``local``          every client adds the full noise σC to its own update (he=true)
* ``dp-sgd``         per-sample DP-SGD with Opacus on each client, CKKS sum (he=true, dp-mode none)

Noise multiplier per point, from the target ε (δ = 1e-5 by default) with Opacus' RDP search
(``crypto.noise_multiplier_for``):

* client level (distributed, flower-central, local): q = clients per round / population,
  steps = rounds — exactly what the server-side accountants (``OpaqueFedAvg._account``,
  ``run_flower_central``) charge, so the spent ε equals the target up to the search tolerance.
  For ``local`` the *same* σ is used: every update carries σC (the guarantee holds even
  against the server), the sum carries √n·σC — that is the utility cost measured.
* sample level (dp-sgd): a node with L batches per epoch is charged q = 1/L and L·epochs steps
  per round it trains (``CacheNode._train_dp_sgd``); σ is chosen for the worst node (the
  largest σ over the nodes' L) and for every round (steps = L·epochs·rounds), so no node can
  exceed the target even if it trains every round. ε spent = the largest node ε reported.

ε = ∞: no noise (σ = 0), the same clipping — the non-private reference of each mode.

Accuracy is the final global model's accuracy on the digits global test split (never seen by
any client); the federated (clients' held-out shares) metric of the last round is in the CSV
as ``fed_metric``. For lm, perplexity on the held-out modules. Membership inference
(``experiments.mia``, loss threshold): members = training samples of the clients, non-members
= the global test split (digits) / held-out modules' windows (lm), balanced.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from experiments.output import (
    add_common_args,
    format_duration,
    make_run_dir,
    markdown_table,
    print_estimate,
    print_results_dir,
    progress,
    write_csv,
    write_json,
)

SCRIPT = "privacy_accuracy"
MODES = ("distributed", "flower-central", "local", "dp-sgd")
COLUMNS = [
    "task", "mode", "population", "clients_per_round", "rounds", "target_epsilon", "noise_multiplier",
    "epsilon_spent", "epsilon_kind", "accuracy", "perplexity", "fed_metric", "mia_auc", "status", "seconds", "round_s",
]
FULL = {"populations": "10,50,100", "epsilons": "1,2,4,8,inf", "rounds": 25}
QUICK = {"populations": "20", "epsilons": "1,8,inf", "rounds": 6}
MIA_SAMPLES = 360


def parse_floats(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        v = math.inf if part in ("inf", "∞", "infinity") else float(part)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"epsilon must be > 0 (or inf), not {part}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def parse_ints(text: str) -> list[int]:
    out = [int(p) for p in text.split(",") if p.strip()]
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError("populations must be >= 2")
    return out


def parse_modes(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {MODES}")
    return out


# -- the points -----------------------------------------------------------------------


def clients_per_round(population: int, max_per_round: int) -> int:
    return max(2, min(population, max_per_round))


def fraction_for(cpr: int, population: int) -> float:
    """fraction-train that makes both samplers (OpaqueFedAvg: ceil, Flower: int) pick ``cpr``."""
    f = cpr / population
    if math.ceil(f * population) != cpr or int(f * population) != cpr:
        raise ValueError(f"no fraction-train gives exactly {cpr} of {population}")
    return f


def digits_train_sizes(population: int, seed: int, alpha: float) -> list[int]:
    """Training examples of each node (the local train share of its partition)."""
    from node import digits

    cfg = digits.DigitsConfig(num_partitions=population, alpha=alpha, seed=seed)
    return [len(digits.load_partition(i, cfg)[0].dataset) for i in range(population)]


def sigma_for(mode: str, eps: float, delta: float, rounds: int, cpr: int, population: int,
              train_sizes: Sequence[int] | None, local_epochs: int, batch_size: int = 32) -> float:
    """Noise multiplier that reaches ``eps`` (see the module docstring); 0 for ε = ∞."""
    from crypto import client_sample_rate, noise_multiplier_for

    if math.isinf(eps):
        return 0.0
    if mode == "dp-sgd":
        if not train_sizes:
            raise ValueError("dp-sgd needs the nodes' training set sizes")
        batches = sorted({max(1, math.ceil(n / batch_size)) for n in train_sizes})
        return max(noise_multiplier_for(eps, delta, 1.0 / b, b * local_epochs * rounds) for b in batches)
    return noise_multiplier_for(eps, delta, client_sample_rate(cpr, population), rounds)


def run_config_for(args: argparse.Namespace, mode: str, population: int, cpr: int, sigma: float,
                   seed: int, max_weight: float) -> dict[str, Any]:
    rc: dict[str, Any] = {
        "task": args.task,
        "num-server-rounds": args.rounds,
        "seed": seed,
        "alpha": args.alpha,
        "clip-norm": args.clip_norm,
        "target-delta": args.delta,
        "local-epochs": args.local_epochs,
        "lr": args.lr,
        "fraction-train": fraction_for(cpr, population),
        "min-clients": cpr,
        "max-clients": max(cpr, 2),
        "noise-multiplier": sigma,
        "dp-sgd": False,
        "round-timeout": 600.0,
    }
    if mode == "distributed":
        rc.update({"he": True, "dp-mode": "distributed"})
    elif mode == "local":
        rc.update({"he": True, "dp-mode": "local"})
    elif mode == "flower-central":
        rc.update({"he": False, "dp-mode": "flower-central"})
    elif mode == "dp-sgd":
        rc.update({"he": True, "dp-mode": "none", "dp-sgd": True, "max-weight": max_weight})
    else:
        raise ValueError(mode)
    return rc


# -- evaluation of the final global model -----------------------------------------------------


def _digits_final(grid, population: int, seed: int, alpha: float, rng: np.random.Generator) -> tuple[float, float]:
    """(accuracy on the global test split, MIA AUC members-vs-global-test)."""
    from experiments.mia import attack_auc
    from node import digits

    model = grid.node(grid.node_ids[0]).model
    cfg = digits.DigitsConfig(num_partitions=population, alpha=alpha, seed=seed)
    test = digits.load_global_test(cfg).dataset.tensors
    _, acc = digits.evaluate(model, digits.load_global_test(cfg))
    xs, ys = [], []
    for i in range(population):
        x, y = digits.load_partition(i, cfg)[0].dataset.tensors
        xs.append(x)
        ys.append(y)
    mx, my = torch.cat(xs), torch.cat(ys)
    pick_m = torch.from_numpy(rng.permutation(len(my))[:MIA_SAMPLES])
    pick_n = torch.from_numpy(rng.permutation(len(test[1]))[:MIA_SAMPLES])
    auc = attack_auc(model, (mx[pick_m], my[pick_m]), (test[0][pick_n], test[1][pick_n]))
    return acc, auc


@torch.no_grad()
def _window_losses(model, data: bytes, seq_len: int, n: int, gen: torch.Generator) -> np.ndarray:
    from node.lm import random_windows

    model.eval()
    out = []
    for start in range(0, n, 16):
        batch = random_windows(data, seq_len, min(16, n - start), gen)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none")
        out.append(loss.reshape(batch.shape[0], -1).mean(dim=1).numpy())
    return np.concatenate(out)


def _lm_final(grid, seed: int) -> tuple[float, float]:
    """(perplexity on the held-out modules, MIA AUC member windows vs held-out windows)."""
    from experiments.mia import loss_threshold_auc

    nodes = [grid.node(n) for n in grid.node_ids]
    model = nodes[0].model
    task = nodes[0].task
    gen = torch.Generator().manual_seed(seed)
    heldout = _window_losses(model, task.heldout, task.seq_len, 64, gen)
    per_node = max(1, 64 // len(nodes))
    members = np.concatenate([_window_losses(model, n.task.share, task.seq_len, per_node, gen) for n in nodes])
    return float(math.exp(heldout.mean())), loss_threshold_auc(members, heldout[: len(members)])


# -- one point ----------------------------------------------------------------------------


def run_point(args: argparse.Namespace, mode: str, population: int, eps: float,
              train_sizes: Sequence[int] | None, run_id: int) -> dict[str, Any]:
    from federation.local import InProcessGrid, run_local

    cpr = clients_per_round(population, args.clients_per_round)
    sigma = sigma_for(mode, eps, args.delta, args.rounds, cpr, population, train_sizes, args.local_epochs)
    max_weight = float(max(train_sizes)) if train_sizes else 1000.0
    rc = run_config_for(args, mode, population, cpr, sigma, args.seed, max_weight)
    t0 = time.perf_counter()
    grid = InProcessGrid(population, rc, run_id=run_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_local(rc, population, grid=grid)
    last = results.rounds[-1] if results.rounds else None
    rng = np.random.default_rng(args.seed)
    acc = ppl = auc = math.nan
    if results.status == "completed":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.task == "digits":
                acc, auc = _digits_final(grid, population, args.seed, args.alpha, rng)
            else:
                ppl, auc = _lm_final(grid, args.seed)
    seconds = time.perf_counter() - t0
    phases = [r.seconds.get("train_phase", math.nan) + r.seconds.get("evaluate_phase", math.nan)
              for r in results.rounds]
    round_s = float(sum(phases)) if phases else math.nan
    if mode == "dp-sgd":
        spent, kind = (last.epsilon_sample if last else math.nan), "sample"
    else:
        spent, kind = (last.epsilon_client if last else math.nan), "client"
    if math.isinf(eps) and (spent is None or math.isnan(spent)):
        spent = math.inf  # no noise: unbounded
    return {
        "task": args.task, "mode": mode, "population": population, "clients_per_round": cpr,
        "rounds": args.rounds, "target_epsilon": eps, "noise_multiplier": sigma,
        "epsilon_spent": float(spent), "epsilon_kind": kind, "accuracy": acc, "perplexity": ppl,
        "fed_metric": float(last.eval_metric) if last else math.nan, "mia_auc": auc,
        "status": results.status.split(":")[0], "seconds": seconds, "round_s": round_s,
    }


# -- estimate -----------------------------------------------------------------------------


def calibrate(args: argparse.Namespace, populations: Sequence[int]) -> tuple[float, str]:
    """Seconds for the whole sweep from one measured 2-round run per (population, mode) at
    ε = 8: per-round cost = the rounds' measured phase times (train + evaluate), the rest of
    the run (node setup, provisioning, final evaluation, MIA) counted once per point. Cost
    is linear in rounds; it hardly depends on ε (noise is drawn either way)."""
    total = 0.0
    sub = argparse.Namespace(**{**vars(args), "rounds": 2})
    for pop in populations:
        sizes = digits_train_sizes(pop, args.seed, args.alpha) if args.task == "digits" else None
        for i, mode in enumerate(args.modes):
            row = run_point(sub, mode, pop, 8.0, sizes, run_id=900_000 + pop * 10 + i)
            per_round = row["round_s"] / 2 if math.isfinite(row["round_s"]) else row["seconds"] / 2
            setup = max(row["seconds"] - 2 * per_round, 0.0)
            total += len(args.epsilons) * (setup + per_round * args.rounds)
    basis = (f"one measured 2-round run per (population, mode) on this machine now, per-round and "
             f"fixed costs extrapolated to {args.rounds} rounds x {len(args.epsilons)} epsilons")
    return total, basis


# -- outputs ------------------------------------------------------------------------------


def _fmt_eps(v: float) -> str:
    return "∞" if math.isinf(v) else f"{v:g}"


def write_outputs(run_dir, rows: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> None:
    from experiments.output import plot_lines

    write_csv(run_dir / "points.csv", rows, COLUMNS)
    if not (meta.get("replot") and (run_dir / "meta.json").exists()):
        write_json(run_dir / "meta.json", meta)
    metric = "accuracy" if args.task == "digits" else "perplexity"
    table_cols = ["mode", "population", "clients_per_round", "target_epsilon", "noise_multiplier",
                  "epsilon_spent", metric, "mia_auc", "seconds"]
    shown = [{**r, "target_epsilon": _fmt_eps(r["target_epsilon"]),
              "epsilon_spent": _fmt_eps(r["epsilon_spent"]) if not math.isnan(r["epsilon_spent"]) else "nan"}
             for r in rows]
    lines = [f"# privacy vs accuracy ({args.task})", "",
             f"rounds={args.rounds}, δ={args.delta}, clip-norm={args.clip_norm}, local-epochs={args.local_epochs}, "
             f"alpha={args.alpha}, seed={args.seed}, {args.clients_per_round} clients per round at most; "
             + ("accuracy = final global model on the digits global test split (no client holds it); "
                if args.task == "digits" else "perplexity = final global model on the held-out modules; ")
             + "MIA = loss-threshold AUC, members = clients' training samples vs held-out (0.5 = no leak). "
             "ε spent: client-level (server accountant) except dp-sgd: sample-level (largest node ε).", "",
             markdown_table(shown, table_cols), ""]
    lines += _targets(rows, args)
    lines += ["", (f"sum of the points' times: {format_duration(meta['wall_s'])}" if meta.get("replot")
                   else f"total wall time: {format_duration(meta['wall_s'])}")]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")

    for pop in sorted({r["population"] for r in rows}):
        sub = [r for r in rows if r["population"] == pop]
        for key, fname, ylabel in ((metric, f"{metric}_vs_epsilon_pop{pop}.png", metric),
                                   ("mia_auc", f"mia_auc_vs_epsilon_pop{pop}.png", "membership-inference AUC")):
            series, styles = {}, {}
            finite = sorted({r["target_epsilon"] for r in sub if math.isfinite(r["target_epsilon"])})
            for k, mode in enumerate(args.modes):
                color = f"C{MODES.index(mode) if mode in MODES else k}"
                styles[mode] = {"color": color}
                pts = sorted((r["target_epsilon"], r[key]) for r in sub if r["mode"] == mode
                             and math.isfinite(r["target_epsilon"]))
                if pts:
                    series[mode] = ([p[0] for p in pts], [p[1] for p in pts])
                ref = [r[key] for r in sub if r["mode"] == mode and math.isinf(r["target_epsilon"])]
                if ref and finite:
                    label = f"{mode} ε=∞"
                    series[label] = ([finite[0], finite[-1]], [ref[0], ref[0]])
                    styles[label] = {"linestyle": "--", "marker": "", "color": color}
            if key == "mia_auc" and finite:
                series["chance (0.5)"] = ([finite[0], finite[-1]], [0.5, 0.5])
                styles["chance (0.5)"] = {"linestyle": ":", "marker": "", "color": "gray"}
            if not finite:  # only ε=∞ points: plot them at x=1 so the file still exists
                series = {r["mode"]: ([1.0], [r[key]]) for r in sub}
            plot_lines(run_dir / fname, series, xlabel="target ε (log; dashed = ε=∞)", ylabel=ylabel,
                       title=f"{args.task}, {pop} clients, {sub[0]['clients_per_round']} per round",
                       logx=True, logy=False, styles=styles)


def _targets(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The issue's targets, evaluated on this run's points (digits)."""
    if args.task != "digits":
        return []
    out = ["## targets (measured on this run)", ""]
    by = {(r["mode"], r["population"], r["target_epsilon"]): r for r in rows}
    pops = sorted({r["population"] for r in rows})
    eps_finite = sorted({r["target_epsilon"] for r in rows if math.isfinite(r["target_epsilon"])})
    for pop in pops:
        for eps in eps_finite:
            d, f, loc = (by.get((m, pop, eps)) for m in ("distributed", "flower-central", "local"))
            if d and f:
                gap = 100 * (d["accuracy"] - f["accuracy"])
                line = f"- pop {pop}, ε={eps:g}: distributed − flower-central = {gap:+.1f} pt"
                if loc:
                    line += f"; distributed − local = {100 * (d['accuracy'] - loc['accuracy']):+.1f} pt"
                out.append(line)
    for pop in pops:
        e8 = [r for r in rows if r["population"] == pop and r["target_epsilon"] == 8]
        inf = [r for r in rows if r["population"] == pop and math.isinf(r["target_epsilon"])]
        if e8 and inf:
            best = max(e8, key=lambda r: r["accuracy"])
            ref = max(r["accuracy"] for r in inf)
            out.append(f"- pop {pop}, ε=8: best mode {best['mode']} {100 * best['accuracy']:.1f} % vs best "
                       f"non-private {100 * ref:.1f} % ({100 * (best['accuracy'] - ref):+.1f} pt)")
    aucs = [r["mia_auc"] for r in rows if math.isfinite(r["target_epsilon"]) and r["target_epsilon"] <= 8]
    if aucs:
        out.append(f"- max MIA AUC at ε ≤ 8: {max(aucs):.3f}")
    return out


# -- main ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.privacy_accuracy", description=__doc__.split("\n\n")[0])
    add_common_args(p, quick_help=f"CI-sized run: populations {QUICK['populations']}, epsilons "
                                  f"{QUICK['epsilons']}, {QUICK['rounds']} rounds (< 5 min on 2 cores)")
    p.add_argument("--task", choices=("digits", "lm"), default="digits")
    p.add_argument("--modes", type=parse_modes, default=None,
                   help=f"comma list of {','.join(MODES)} (default all; lm: dp-sgd is skipped)")
    p.add_argument("--epsilons", type=parse_floats, default=None,
                   help=f"target ε list, 'inf' = no noise (default {FULL['epsilons']})")
    p.add_argument("--populations", type=parse_ints, default=None,
                   help=f"clients in the federation (default {FULL['populations']})")
    p.add_argument("--rounds", type=int, default=None, help=f"server rounds (default {FULL['rounds']})")
    p.add_argument("--clients-per-round", type=int, default=10,
                   help="clients sampled per round (capped at the population; default 10)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.0, help="local learning rate, 0 = the task default")
    p.add_argument("--alpha", type=float, default=10.0,
                   help="Dirichlet concentration of the digits split (default 10: 100 partitions of >= 10 "
                        "samples are not feasible at alpha=1)")
    p.add_argument("--no-estimate", action="store_true", help="skip the calibration runs")
    p.add_argument("--replot", metavar="RUN_DIR", default=None,
                   help="only rewrite summary.md and the plots of RUN_DIR from its points.csv "
                        "(e.g. an interrupted run; its points are kept as they are)")
    return p


def read_rows(path) -> list[dict[str, Any]]:
    """points.csv back into typed rows (the inverse of write_csv for this script's columns)."""
    import csv

    ints = {"population", "clients_per_round", "rounds"}
    strs = {"task", "mode", "epsilon_kind", "status"}
    rows = []
    with open(path, newline="") as fh:
        for raw in csv.DictReader(fh):
            row: dict[str, Any] = {}
            for k, v in raw.items():
                row[k] = v if k in strs else int(v) if k in ints else float(v)
            row.setdefault("round_s", math.nan)
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        from pathlib import Path

        run_dir = Path(args.replot)
        rows = read_rows(run_dir / "points.csv")
        if not rows:
            print(f"{run_dir / 'points.csv'} has no points", file=sys.stderr)
            return 2
        args.task = rows[0]["task"]
        args.rounds = int(rows[0]["rounds"])
        args.modes = list(dict.fromkeys(r["mode"] for r in rows))
        write_outputs(run_dir, rows, args, {"replot": True, "wall_s": sum(r["seconds"] for r in rows)})
        print((run_dir / "summary.md").read_text())
        print_results_dir(run_dir)
        return 0
    preset = QUICK if args.quick else FULL
    args.populations = args.populations or parse_ints(preset["populations"])
    args.epsilons = args.epsilons or parse_floats(preset["epsilons"])
    args.rounds = args.rounds or preset["rounds"]
    args.modes = args.modes or list(MODES)
    if args.task == "lm" and "dp-sgd" in args.modes:
        args.modes = [m for m in args.modes if m != "dp-sgd"]
        print("note: dp-sgd is offered for digits only (the lm node has no per-sample loader); skipped")
        if not args.modes:
            print("no mode left to run", file=sys.stderr)
            return 2
    if args.rounds < 1 or args.clients_per_round < 2:
        print("--rounds must be >= 1 and --clients-per-round >= 2", file=sys.stderr)
        return 2
    import federation.local  # noqa: F401  (imports flwr, which configures its logger)
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)  # one progress bar, not a log line per round
    torch.manual_seed(args.seed)

    points = [(m, pop, eps) for pop in args.populations for m in args.modes for eps in args.epsilons]
    if not args.no_estimate:
        est, basis = calibrate(args, args.populations)
        print_estimate(est, basis, label=f"{len(points)} points")
    t_start = time.perf_counter()
    run_dir = make_run_dir(args.out, SCRIPT)
    rows: list[dict[str, Any]] = []
    sizes = {pop: digits_train_sizes(pop, args.seed, args.alpha) if args.task == "digits" else None
             for pop in args.populations}
    for i, (mode, pop, eps) in enumerate(progress(points, total=len(points), desc=SCRIPT)):
        rows.append(run_point(args, mode, pop, eps, sizes[pop], run_id=10_000 + i))
        write_csv(run_dir / "points.csv", rows, COLUMNS)  # partial results survive an interrupt
    meta = {"args": {k: v for k, v in vars(args).items()}, "wall_s": time.perf_counter() - t_start,
            "torch_threads": torch.get_num_threads()}
    write_outputs(run_dir, rows, args, meta)
    print((run_dir / "summary.md").read_text())
    print_results_dir(run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
