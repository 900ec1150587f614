"""What example-level DP-SGD costs the main job's task: 5 ``lm`` nodes in one process, each round
every node trains from the global model (with and without ``dp-sgd``), its update is clipped to
the run's C = 1 and the plain mean is written back (the aggregation CKKS computes exactly; the
client-level noise is left out so the two arms differ only by DP-SGD). Paired seeds: both arms
start from the same model and data split per seed; DP-SGD's noise and batches come from OS entropy.

    python -m experiments.example_dp_lm --seeds 3 --batch 256 --json
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from experiments.output import add_common_args, make_run_dir, print_results_dir, progress, write_json
from experiments.privacy_accuracy import mean_ci
from node.cache_node import CacheNode, DpConfig, NodeSpec


def run_arm(seed: int, private: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    """Perplexity after each round (mean over the nodes' held-out scores) and the ε reported."""
    nodes = [CacheNode(NodeSpec(i, args.nodes, task="lm", seed=seed)) for i in range(args.nodes)]
    for n in nodes:
        n.task.steps_per_epoch = args.steps
    dp = DpConfig(dp_sgd=private, target_epsilon=args.epsilon, planned_rounds=args.rounds,
                  expected_batch=args.batch, target_delta=1e-5)
    ppl, eps = [], []
    for _ in range(args.rounds):
        outs = [n.train_round(args.epochs, 0.0, dp) for n in nodes]
        mean = np.mean([o.delta * min(1.0, 1.0 / (o.delta_norm + 1e-12)) for o in outs], axis=0)
        for n in nodes:
            n.apply_mean_update(mean, n.version + 1)
        ppl.append(float(np.mean([n.evaluate()[1] for n in nodes])))
        eps.append(max(o.epsilon for o in outs) if private else math.inf)
    return {"perplexity": ppl, "epsilon_example": eps}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick_help="2 nodes, 2 rounds, 2 steps, batch 16 (tests)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2, help="local epochs (the main job's 2)")
    p.add_argument("--steps", type=int, default=8, help="steps per epoch (the lm task's 8)")
    p.add_argument("--batch", type=int, default=256, help="DP-SGD's expected Poisson batch")
    p.add_argument("--epsilon", type=float, default=8.0, help="example-level ε over the run (δ 1e-5)")
    p.add_argument("--json", action="store_true", help="print the results JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.nodes, args.rounds, args.steps, args.batch = 2, 2, 2, 2, 16
    runs = {arm: [run_arm(args.seed + s, arm == "dp_sgd", args) for s in progress(range(args.seeds), desc=arm)]
            for arm in ("non_private", "dp_sgd")}
    final = {arm: [r["perplexity"][-1] for r in rs] for arm, rs in runs.items()}
    m, lo, hi = mean_ci([d / n for d, n in zip(final["dp_sgd"], final["non_private"])])
    out = {"settings": vars(args) | {"delta": 1e-5},
           "by_arm": {arm: dict(zip(("perplexity_mean", "ci_low", "ci_high"), mean_ci(v)), runs=runs[arm])
                      for arm, v in final.items()},
           "perplexity_ratio": {"mean": m, "ci_low": lo, "ci_high": hi},
           "epsilon_example": max(r["epsilon_example"][-1] for r in runs["dp_sgd"])}
    run_dir = make_run_dir(args.out, "example_dp_lm")
    write_json(run_dir / "results.json", out)
    print(json.dumps(out, indent=1, default=str) if args.json else
          f"perplexity non-private {out['by_arm']['non_private']['perplexity_mean']:.1f}, DP-SGD "
          f"{out['by_arm']['dp_sgd']['perplexity_mean']:.1f} (ratio {m:.3f} [{lo:.3f}, {hi:.3f}]) at "
          f"example-level ε {out['epsilon_example']:.2f}, δ 1e-5")
    print_results_dir(run_dir)
    return out


if __name__ == "__main__":
    main()
