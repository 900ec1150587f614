"""Does fine-tuning keep the chat model's manners? The chat task fine-tuned on docstrings alone
(``general_mix`` 0) against the same run rehearsing public general pairs (``node.tasks.general_data``,
the task's default share), on paired seeds, with the base model beside them: the general-question
probe (``experiments.general_probe``: likelihood preference, and whether the greedy reply
contains the expected answer, asked without a system prompt as a chat user asks) and the
held-out docstring perplexity (the task the fine-tuning is for). Each point is
``experiments.finetune_points.run_point`` (nodes in one process, CKKS aggregation).

    python -m experiments.general_mix                 # SmolLM2, the README's chat recipe, 2 seeds
    python -m experiments.general_mix --quick --json  # chat:tiny (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import time

from experiments.finetune_points import PointConfig, base_point, run_point
from experiments.output import add_common_args, make_run_dir, print_results_dir, progress, write_json
from experiments.privacy_accuracy import mean_ci, mean_ci_json
from node.tasks.tasks import ChatTask

QUICK = dict(chat_model="tiny", nodes=3, rounds=1, steps=2, batch=4, eval_examples=2)
KEYS = ("perplexity", "probe_accuracy", "probe_margin", "probe_greedy")


def _arm(points: list[dict]) -> dict:
    out: dict = {}
    for k in KEYS:
        out[f"{k}_mean"], out[f"{k}_ci95"] = mean_ci_json([p[k] for p in points])
    out["first_replies"] = [p["probe_replies"][0] for p in points]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.general_mix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick_help="chat:tiny, 1 round of 2 steps, 2 seeds (tests)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="federated rounds (default 5: the chat run's)")
    p.add_argument("--steps", type=int, default=ChatTask.steps_per_epoch, help="steps per round (the task's)")
    p.add_argument("--batch", type=int, default=ChatTask.batch_size, help="batch (the task's non-private batch)")
    p.add_argument("--mix", type=float, default=ChatTask.general_mix, help="the rehearsing arm's general_mix")
    p.add_argument("--epsilon", type=float, default=math.inf, help="example-level ε of both arms (default inf)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    common = QUICK if args.quick else dict(rounds=args.rounds, steps=args.steps, batch=args.batch)
    arms = {"docstrings_only": 0.0, "with_general_mix": args.mix}
    seeds = [args.seed + s for s in range(2 if args.quick else args.seeds)]
    plan = [(name, s) for s in seeds for name in arms]
    cfgs = {name: PointConfig(**common, general_mix=mix) for name, mix in arms.items()}
    bases = [base_point(cfgs["docstrings_only"], s) for s in seeds]
    points = {name: [] for name in arms}
    for name, s in progress(plan, desc="general_mix"):
        points[name].append(run_point(cfgs[name], "ffa_lora", args.epsilon, s))
    out = {"base": _arm(bases), "arms": {n: _arm(p) | {"general_mix": arms[n]} for n, p in points.items()},
           "probe_greedy_ratio": _ratio(points, "probe_greedy"), "perplexity_ratio": _ratio(points, "perplexity"),
           "settings": {**common, "seeds": seeds, "epsilon": None if math.isinf(args.epsilon) else args.epsilon,
                        "chat_model": cfgs["docstrings_only"].chat_model},
           "wall_s": time.perf_counter() - t0}
    run_dir = make_run_dir(args.out, "general_mix")
    write_json(run_dir / "results.json", out | {"points": points, "bases": bases})
    if args.json:
        print(json.dumps(out, indent=1))
    for name, arm in [("base", out["base"]), *out["arms"].items()]:
        print(f"{name:17s} probe {arm['probe_accuracy_mean']:.2f} (greedy {arm['probe_greedy_mean']:.2f}), "
              f"held-out perplexity {arm['perplexity_mean']:.2f}; 'capital of France?' -> {arm['first_replies'][0]!r}")
    print_results_dir(run_dir)
    return out


def _ratio(points: dict[str, list[dict]], key: str) -> float | None:
    """Mean of the rehearsing arm over the docstrings-only arm's (None when the latter is 0)."""
    a = mean_ci([p[key] for p in points["with_general_mix"]])[0]
    b = mean_ci([p[key] for p in points["docstrings_only"]])[0]
    return a / b if b else None


if __name__ == "__main__":
    main()
