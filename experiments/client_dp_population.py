"""Client-level DP where it is meaningful: a large population of small clients.

With 5-10 organisations, client-level DP drowns the mean update in noise (the noise on the mean
of k clipped updates has norm σ·C·√d / k against a signal of at most C); it becomes useful when
k -- the clients per round -- is large. This script simulates that regime on the ``lm`` task:
a population of ``--population`` clients, each holding a contiguous slice of the training
corpus, Poisson-sampled at q = k / N each round (no round is skipped: whatever was sampled is
aggregated, divided by the fixed expected count k). Each sampled client runs the ``lm`` task's
local AdamW training from the global model; its update is clipped to C; the server adds
Gaussian noise of std σ·C to the sum (the total of fedkv's distributed noise shares). σ comes
from the server's own client-level accountant (``federation.client_accounting``, Poisson,
add/remove-one: a client's whole data set is the unit) for the target ε after ``--rounds``.
The sum is computed in plaintext: CKKS would add only its encoding error, and 100 encryptions a
round are what make the federated run slow, not what it measures.

Reported per ε: held-out perplexity (mean and 95 % CI over paired seeds: a seed fixes the
initialisation, the sampler, the noise and the evaluation windows) and its ratio to the same
seed's ε = ∞ run (mean and CI of the paired ratios), σ, the measured norm of the clipped mean update (the
signal), and the noise-to-signal ratio σ·C·√d / (k·‖signal‖). ``populations`` adds, without
training, σ and the same ratio for other populations at the ε = 8 point (k = N / 10).

    python -m experiments.client_dp_population            # N 1000, k 100, 20 rounds, 2 seeds
    python -m experiments.client_dp_population --quick    # N 100, k 20, 3 rounds (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch

from experiments.output import add_common_args, make_run_dir, print_results_dir, progress, write_json
from experiments.privacy_accuracy import mean_ci_json
from federation.client_accounting import ClientAccountant, sigma_for_epsilon
from node.tasks.corpus import split_corpus
from node.tasks.lm import eval_loss, train_lm
from node.tasks.tasks import LmTask, lm_model

EPSILONS = (1.0, 3.0, 8.0, math.inf)


@dataclass(frozen=True)
class PopulationConfig:
    population: int = 1000
    per_round: int = 100
    """k: the expected clients per round (q = k / N)."""
    rounds: int = 20
    local_steps: int = 2
    batch: int = 8
    seq_len: int = LmTask.seq_len
    lr: float = LmTask.default_lr
    clip: float = 0.5
    """C, the bound on each client's update (L2)."""
    delta: float = 1e-5
    eval_windows: int = 64

    def __post_init__(self) -> None:
        if not 2 <= self.per_round <= self.population:
            raise ValueError(f"per_round must be in [2, population], got {self.per_round} of {self.population}")


def client_slices(data: bytes, population: int, seq_len: int) -> list[bytes]:
    """``population`` contiguous, disjoint slices of ``data`` (each at least one window)."""
    size = len(data) // population
    if size < seq_len + 1:
        raise ValueError(f"{len(data)} bytes give {size} per client: fewer than one window of {seq_len + 1}")
    return [data[i * size:(i + 1) * size] for i in range(population)]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def _load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the parameters (``vector_to_parameters`` would make them views of it)."""
    torch.nn.utils.vector_to_parameters(flat.clone(), model.parameters())


def _round(cfg: PopulationConfig, slices: list[bytes], model: torch.nn.Module, weights: torch.Tensor,
           sigma: float, gen: torch.Generator) -> tuple[torch.Tensor, float, int]:
    """One round: Poisson sample, local training, clip, noisy sum / k. (new weights, the clipped
    mean's norm, clients sampled)."""
    q = cfg.per_round / cfg.population
    sampled = torch.nonzero(torch.rand(cfg.population, generator=gen) < q).flatten().tolist()
    total = torch.zeros_like(weights)
    for c in sampled:
        _load_flat(model, weights)
        train_lm(model, slices[c], cfg.local_steps, cfg.batch, cfg.seq_len, cfg.lr, gen)
        update = _flat(model) - weights
        total += update * min(1.0, cfg.clip / (float(update.norm()) + 1e-12))
    signal = float((total / cfg.per_round).norm())
    noise = torch.randn(weights.shape, generator=gen, dtype=weights.dtype) * sigma * cfg.clip
    return weights + (total + noise) / cfg.per_round, signal, len(sampled)


def run_point(cfg: PopulationConfig, epsilon: float, seed: int) -> dict:
    """One federated run at client-level ``epsilon`` (inf: σ 0) from ``seed``."""
    t0 = time.perf_counter()
    split = split_corpus(1, seed=seed)
    slices = client_slices(split.shares[0], cfg.population, cfg.seq_len)
    sigma = 0.0 if math.isinf(epsilon) else sigma_for_epsilon(
        epsilon, "poisson", cfg.population, cfg.per_round, cfg.rounds, cfg.delta)
    gen = torch.Generator().manual_seed(seed)
    model = lm_model(seed)
    weights = _flat(model).clone()
    signals, sampled = [], []
    for _ in range(cfg.rounds):
        weights, signal, n = _round(cfg, slices, model, weights, sigma, gen)
        signals.append(signal)
        sampled.append(n)
    _load_flat(model, weights)
    loss = eval_loss(model, split.heldout, cfg.seq_len, cfg.eval_windows, torch.Generator().manual_seed(10_000 + seed))
    spent = None
    if sigma > 0:
        acc = ClientAccountant("poisson", cfg.population, cfg.delta)
        acc.step(sigma, cfg.per_round, cfg.rounds)
        spent = acc.epsilon()
    dim = weights.numel()
    signal = sum(signals) / len(signals)
    return {"epsilon": epsilon_key(epsilon), "seed": seed, "perplexity": math.exp(loss), "noise_multiplier": sigma,
            "epsilon_spent": spent, "signal_norm": signal, "dim": dim,
            "noise_to_signal": sigma * cfg.clip * math.sqrt(dim) / (cfg.per_round * signal) if signal else None,
            "clients_sampled_mean": sum(sampled) / len(sampled), "wall_s": time.perf_counter() - t0}


def population_table(cfg: PopulationConfig, dim: int, signal: float, epsilon: float = 8.0) -> list[dict]:
    """σ and the noise-to-signal ratio at ``epsilon`` for populations of 10 to 10⁶ (k = N / 10,
    the same rounds and δ), using the measured signal norm: no training."""
    rows = []
    for n in (10, 100, 1_000, 10_000, 100_000, 1_000_000):
        k = max(2, n // 10)
        sigma = sigma_for_epsilon(epsilon, "poisson", n, k, cfg.rounds, cfg.delta)
        rows.append({"population": n, "per_round": k, "noise_multiplier": sigma,
                     "noise_to_signal": sigma * cfg.clip * math.sqrt(dim) / (k * signal)})
    return rows


def epsilon_key(epsilon: float) -> str:
    """The JSON key of an ε (JSON has no Infinity)."""
    return "inf" if math.isinf(epsilon) else f"{epsilon:g}"


def _paired_ratios(points: list[dict], pts: list[dict]) -> list[float]:
    """Each point's perplexity over the same seed's ε = ∞ point (the seeds differ more than DP does)."""
    free = {p["seed"]: p["perplexity"] for p in points if p["epsilon"] == "inf"}
    return [p["perplexity"] / free[p["seed"]] for p in pts if p["seed"] in free]


def summarise(points: list[dict]) -> dict:
    """Per ε key: perplexity mean and CI over seeds, σ, ε spent, noise-to-signal (mean over seeds)."""
    by_eps = {}
    for e in [epsilon_key(x) for x in EPSILONS]:
        pts = [p for p in points if p["epsilon"] == e]
        if not pts:
            continue
        m, ci = mean_ci_json([p["perplexity"] for p in pts])
        ratios = [p["noise_to_signal"] for p in pts if p["noise_to_signal"] is not None]
        paired = _paired_ratios(points, pts)
        r_m, r_ci = mean_ci_json(paired)
        by_eps[e] = {
            "perplexity_ratio_mean": r_m if paired else None, "perplexity_ratio_ci95": r_ci,
            "perplexity_mean": m, "perplexity_ci95": ci,
            "noise_multiplier": pts[0]["noise_multiplier"], "epsilon_spent": pts[0]["epsilon_spent"],
            "noise_to_signal": sum(ratios) / len(ratios) if ratios else None, "seeds": [p["seed"] for p in pts]}
    return by_eps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.client_dp_population", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick_help="N 100, k 20, 3 rounds, 2 seeds (tests)")
    d = PopulationConfig()
    p.add_argument("--population", type=int, default=d.population)
    p.add_argument("--per-round", type=int, default=d.per_round)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    cfg = (PopulationConfig(population=100, per_round=20, rounds=3, eval_windows=8) if args.quick else
           PopulationConfig(population=args.population, per_round=args.per_round, rounds=args.rounds))
    seeds = [args.seed + s for s in range(2 if args.quick else args.seeds)]
    plan = [(e, s) for s in seeds for e in EPSILONS]
    points = [run_point(cfg, e, s) for e, s in progress(plan, desc="client_dp_population")]
    free = [p for p in points if p["epsilon"] == "inf"]
    signal = sum(p["signal_norm"] for p in free) / len(free)
    out = {"settings": asdict(cfg) | {"seeds": seeds}, "by_epsilon": summarise(points),
           "populations": population_table(cfg, points[0]["dim"], signal),
           "signal_norm": signal, "wall_s": time.perf_counter() - t0}
    run_dir = make_run_dir(args.out, "client_dp_population")
    write_json(run_dir / "results.json", out | {"points": points})
    print(json.dumps(out, indent=1) if args.json else "\n".join(
        f"ε {e:>3s}: perplexity {v['perplexity_mean']:.3f} ({v['perplexity_ratio_mean']:.3f}x non-private, paired), "
        f"σ {v['noise_multiplier']:.3f}" for e, v in out["by_epsilon"].items()))
    print_results_dir(run_dir)
    return out


if __name__ == "__main__":
    main()
