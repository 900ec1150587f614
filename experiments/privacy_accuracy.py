"""Privacy vs accuracy: an ε sweep over fedkv's DP modes and Flower's DP baseline, repeated over
paired seeds, with the accountant's ε per observer and two empirical audits next to every point.

    python -m experiments.privacy_accuracy            # full digits sweep, 5 seeds (duration printed first)
    python -m experiments.privacy_accuracy --quick    # CI-sized: 2 seeds (and says so)
    python -m experiments.privacy_accuracy --task lm --populations 10 --modes distributed,local

Modes (same seeds, rounds, clients, clip norm, sampler for every point):

* ``distributed``    fedkv: update clipping + distributed Gaussian noise shares, CKKS sum (he=true)
* ``flower-central`` Flower's DifferentialPrivacyClientSideFixedClipping over FedAvg with uniform
                     weights and a per-round shuffle (he=false; ``federation.flower_central``)
* ``local``          every client adds the full noise σC to its own update (he=true)
* ``dp-sgd``         per-sample DP-SGD with Opacus on each client, CKKS sum (he=true, dp-mode none)
* ``flower-adaptive`` Flower's DifferentialPrivacyClientSideAdaptiveClipping (Andrew et al. 2021),
                     otherwise as flower-central; ``--clip-norm`` is the initial norm. Not in --quick.
* ``distributed-adaptive`` fedkv's distributed mode with adaptive clipping under HE (Andrew et al.
                     2021: the noisy clipped count rides in the same ciphertext); σ from the same
                     client-level accountant (the count's noise is paid inside σ, as in
                     flower-adaptive). Not in --quick.

Client sampling (``--client-sampling``, the run-config key ``client-sampling``): ``fixed`` (k of N
without replacement, replace-one adjacency) or ``poisson`` (each client with q = k/N, fixed
denominator); flower-central always samples a fixed k (Flower's FedAvg). The sampler is seeded
with the point's seed here (``sampler-seed``), so the modes see the same draws per seed.

Noise multiplier per point, from the target ε (δ = 1e-5 by default):

* client level (distributed, flower-central, local): the smallest σ whose ε under the sampler's
  accountant (``federation.client_accounting``, Flower's RdpAccountant) after ``rounds`` releases is
  <= the target — exactly what the server charges, so ε spent equals the target up to the
  search tolerance. For ``local`` the *same* σ is used: every update carries σC (the guarantee
  holds even against the server), the sum carries √k·σC — that is the utility cost measured.
* sample level (dp-sgd): a node with L batches per epoch is charged q = 1/L and L·epochs steps
  per round it trains (``CacheNode._train_dp_sgd``); σ is chosen for the worst node and for every
  round, so no node can exceed the target. ε spent = the largest node ε reported. dp-sgd's ε is
  sample-level and is plotted on its own figure, never on the client-level axis.

ε = ∞: no noise (σ = 0), the same clipping — the non-private reference of each mode.

Statistics: every point runs ``--seeds`` paired seeds (seed, seed+1, ...: data split, model
init, sampler); the CSV, summary and plots give the mean and a 95 % Student-t interval over seeds.

Audits, next to the accountant's ε at every point:

* client level: the canary-client one-shot audit (``experiments.canary_audit``, Andrew et al.
  2024) of the point's mechanism — its sampler, clip norm, the noise the sum carries (σ; √k·σ
  for local) and rounds — on the accounted adjacency's worst-case pair (fixed: canary x vs −x,
  poisson: x vs absent): ``audit_epsilon`` (point estimate), ``canary_eps_lower`` (one-sided
  Clopper–Pearson lower bound at ``canary_confidence``, 95 %). Either above the accountant's ε
  is reported as a failure in summary.md (a bug, not a figure).
* sample level (dp-sgd, every run): LiRA (``experiments.lira``, Carlini et al. 2022) of the
  point's per-node mechanism (``experiments.lira_dp_sgd``): ``--lira-models`` digits models
  trained with Opacus DP-SGD at the point's σ, clip norm, q = 1/L and T steps of the node the
  accountant charges most (L and T read from the run's nodes: the steps it was charged, not an
  expectation), on random halves of a ``--lira-pool`` pool drawn only from the training shares of
  clients sampled at least once in that seed's run; leave-one-out attack. Reported: AUC with its
  bootstrap CI, TPR at 0.1 % FPR and the empirical ε lower bound (Clopper–Pearson,
  ``experiments.lira.epsilon_lower_bound``) next to the accountant's sample-level ε; a lower
  bound above the accountant's ε is listed as an audit failure. NaN for client-level modes.
* both levels: the loss-threshold membership-inference AUC (``experiments.mia``) of the final
  global model, members drawn only from clients that were sampled at least once, non-members
  from the global test split, balanced; mean and CI over seeds.

Accuracy is the final global model's accuracy on the digits global test split (never seen by
any client); the federated (clients' held-out shares) metric of the last round is in the CSV as
``fed_metric``. For lm, perplexity on the held-out modules.

ε per observer (``federation.privacy_ledger``): ``epsilon_spent``/``epsilon_accountant`` against
third parties (amplified), ``epsilon_server``, ``epsilon_node`` (a curious key holder) and
``epsilon_colluding`` (run-config colluding-nodes of them), all at δ = target-delta.

Files: ``runs.csv`` (one row per seed), ``points.csv`` (one row per point: means, CIs, ε per
observer and audit ε with its lower bound), ``summary.md``, plots (client-level and sample-level ε apart), JSON last.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from scipy import stats

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
from federation.privacy_ledger import OBSERVERS

SCRIPT = "privacy_accuracy"
MODES = ("distributed", "flower-central", "local", "dp-sgd", "flower-adaptive", "distributed-adaptive")
QUICK_MODES = MODES[:4]
"""--quick leaves the adaptive modes out (time); ``--modes`` adds them."""
CLIENT_LEVEL = ("distributed", "flower-central", "local", "flower-adaptive", "distributed-adaptive")
FLOWER_MODES = ("flower-central", "flower-adaptive")
RUN_COLUMNS = [
    "task", "mode", "population", "clients_per_round", "rounds", "seed", "client_sampling", "target_epsilon",
    "noise_multiplier", "epsilon_spent", *(f"epsilon_{o}" for o in OBSERVERS[1:]), "epsilon_kind", "accuracy",
    "perplexity",
    "fed_metric", "mia_auc", "mia_members", "lira_auc", "lira_auc_ci_low", "lira_auc_ci_high",
    "lira_tpr_at_0.1pct_fpr", "lira_epsilon_lb", "lira_models", "lira_pool", "lira_steps", "lira_sample_rate",
    "lira_s", "lira_train_s", "status", "seconds", "round_s",
]
LIRA_COLUMNS = RUN_COLUMNS[RUN_COLUMNS.index("lira_auc"):RUN_COLUMNS.index("status")]
METRICS = ("accuracy", "perplexity", "mia_auc", "lira_auc")
COLUMNS = [
    "task", "mode", "population", "clients_per_round", "rounds", "client_sampling", "target_epsilon",
    "noise_multiplier", "n_seeds", "accuracy_mean", "accuracy_ci_low", "accuracy_ci_high", "perplexity_mean",
    "perplexity_ci_low", "perplexity_ci_high", "mia_auc_mean", "mia_auc_ci_low", "mia_auc_ci_high",
    "epsilon_accountant", *(f"epsilon_{o}" for o in OBSERVERS[1:]), "epsilon_kind", "audit_epsilon", "audit_kind",
    "canary_eps_lower", "canary_confidence", "lira_auc_mean", "lira_auc_ci_low", "lira_auc_ci_high",
    "lira_tpr_at_0.1pct_fpr_mean", "lira_epsilon_lb_max",
    "lira_models", "completed", "seconds",
]
FULL = {"populations": "10,50,100", "epsilons": "1,2,4,8,inf", "rounds": 25, "seeds": 5, "audit_trials": 1000,
        "clients_per_round": 10, "lira_models": 32, "lira_pool": 256}
QUICK = {"populations": "10", "epsilons": "1,8,inf", "rounds": 5, "seeds": 2, "audit_trials": 300,
         "clients_per_round": 5, "lira_models": 8, "lira_pool": 64}
"""LiRA sizes: 32 models x 256 examples give ~8,000 attack samples (AUC CI about ±0.012, ~4,000
non-members behind the 0.1 % FPR point). Measured here (2 shared cores): one shadow training of a
10-client, 25-round point (150-250 steps) 0.2-0.4 s, one run's LiRA 8-14 s. --quick: 8 x 64."""
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


def sampling_of(mode: str, client_sampling: str) -> str:
    """The sampler a mode runs with: Flower's FedAvg always samples a fixed k."""
    return "fixed" if mode in FLOWER_MODES else client_sampling


def digits_train_sizes(population: int, seed: int, alpha: float) -> list[int]:
    """Training examples of each node (the local train share of its partition)."""
    from node.tasks import digits

    cfg = digits.DigitsConfig(num_partitions=population, alpha=alpha, seed=seed)
    return [len(digits.load_partition(i, cfg)[0].dataset) for i in range(population)]


@functools.lru_cache(maxsize=None)
def _client_sigma(eps: float, sampling: str, population: int, cpr: int, rounds: int, delta: float) -> float:
    from federation.client_accounting import sigma_for_epsilon

    return sigma_for_epsilon(eps, sampling, population, cpr, rounds, delta)


@functools.lru_cache(maxsize=None)
def _sample_sigma(eps: float, delta: float, batches: int, steps: int) -> float:
    """σ of one node's DP-SGD (q = 1/L, T steps); cached: Opacus' search takes seconds and the
    seeds of a point share most batch counts."""
    from crypto import dp_sgd_noise_multiplier  # the accountant the node reports with

    return dp_sgd_noise_multiplier(eps, delta, 1.0 / batches, steps)


def sigma_for(mode: str, eps: float, delta: float, rounds: int, cpr: int, population: int,
              train_sizes: Sequence[int] | None, local_epochs: int, batch_size: int = 32,
              client_sampling: str = "fixed") -> float:
    """Noise multiplier that reaches ``eps`` (see the module docstring); 0 for ε = ∞."""
    if math.isinf(eps):
        return 0.0
    if mode == "dp-sgd":
        if not train_sizes:
            raise ValueError("dp-sgd needs the nodes' training set sizes")
        batches = sorted({max(1, math.ceil(n / batch_size)) for n in train_sizes})
        return max(_sample_sigma(eps, delta, b, b * local_epochs * rounds) for b in batches)
    return _client_sigma(eps, sampling_of(mode, client_sampling), population, cpr, rounds, delta)


def run_config_for(args: argparse.Namespace, mode: str, population: int, cpr: int, sigma: float,
                   seed: int, max_weight: float) -> dict[str, Any]:
    rc: dict[str, Any] = {
        "task": args.task,
        "num-server-rounds": args.rounds,
        "seed": seed,
        "sampler-seed": seed,  # experiments seed the sampler: the modes see the same draws per seed
        "client-sampling": sampling_of(mode, args.client_sampling),
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
    if rc["client-sampling"] == "poisson":
        rc.update(poisson_bounds(cpr, population))
    if mode == "distributed":
        rc.update({"he": True, "dp-mode": "distributed"})
    elif mode == "distributed-adaptive":
        rc.update({"he": True, "dp-mode": "distributed", "adaptive-clipping": True})
    elif mode == "local":
        rc.update({"he": True, "dp-mode": "local"})
    elif mode in FLOWER_MODES:
        rc.update({"he": False, "dp-mode": "flower-central", "adaptive-clipping": mode == "flower-adaptive"})
    elif mode == "dp-sgd":
        # sigma is the sweep's (dp-sgd-epsilon 0), the per-example bound the sweep's clip-norm
        rc.update({"he": True, "dp-mode": "none", "dp-sgd": True, "max-weight": max_weight,
                   "dp-sgd-epsilon": 0.0, "dp-sgd-clip": args.clip_norm})
    else:
        raise ValueError(mode)
    return rc


def poisson_bounds(cpr: int, population: int) -> dict[str, int]:
    """min-/max-clients around a Poisson draw of mean k = cpr: k/2 .. k + 3 sd (a draw outside
    is a skipped round, still charged). max-clients is the HE packing headroom, so it is kept
    near k rather than N (every extra slot costs precision per value)."""
    q = cpr / population
    hi = math.ceil(cpr + 3 * math.sqrt(cpr * (1 - q)))
    return {"min-clients": max(1, cpr // 2), "max-clients": max(2, min(population, hi))}


# -- evaluation of the final global model -----------------------------------------------------


def trained_partitions(grid) -> list[int]:
    """Partitions of the nodes that received at least one train message (were sampled)."""
    nodes = {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type.startswith("train")}
    return sorted(grid.partition_of(n) for n in nodes)


def _digits_final(grid, population: int, seed: int, alpha: float,
                  rng: np.random.Generator) -> tuple[float, float, int]:
    """(accuracy on the global test split, MIA AUC sampled clients' members vs global test, members)."""
    from experiments.mia import attack_auc
    from node.tasks import digits

    model = grid.node(grid.node_ids[0]).model
    cfg = digits.DigitsConfig(num_partitions=population, alpha=alpha, seed=seed)
    test = digits.load_global_test(cfg).dataset.tensors
    _, acc = digits.evaluate(model, digits.load_global_test(cfg))
    mx, my = sampled_train_data(grid, population, seed, alpha)
    n = min(MIA_SAMPLES, len(my), len(test[1]))
    pick_m = torch.from_numpy(rng.permutation(len(my))[:n])
    pick_n = torch.from_numpy(rng.permutation(len(test[1]))[:n])
    auc = attack_auc(model, (mx[pick_m], my[pick_m]), (test[0][pick_n], test[1][pick_n]))
    return acc, auc, n


def sampled_train_data(grid, population: int, seed: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The training shares of the clients sampled at least once (a never-sampled client's data
    cannot leak, so it is no member)."""
    from node.tasks import digits

    cfg = digits.DigitsConfig(num_partitions=population, alpha=alpha, seed=seed)
    xs, ys = zip(*(digits.load_partition(i, cfg)[0].dataset.tensors for i in trained_partitions(grid)))
    return torch.cat(xs), torch.cat(ys)


def audited_mechanism(grid, sigma: float, clip_norm: float, lr: float, seed: int, delta: float):
    """The DP-SGD mechanism of the node the accountant charges most (largest ε, then most steps),
    with the sample rate and steps that node was charged in this run."""
    from experiments.lira_dp_sgd import DpSgdMechanism, MechanismError

    charged = {(round(1 / n.dp_sample_rate), n.dp_steps)
               for n in map(grid.node, grid.node_ids) if n.dp_steps > 0 and n.dp_sample_rate > 0}
    if not charged:
        raise MechanismError("no node ran DP-SGD in this run: nothing to audit")
    mechs = [DpSgdMechanism(sigma, clip_norm, batches=b, steps=t, lr=lr, init_seed=seed) for b, t in charged]
    return max(mechs, key=lambda m: (m.epsilon(delta), m.steps))


def lira_of_run(grid, args: argparse.Namespace, population: int, sigma: float, seed: int) -> dict[str, Any]:
    """The LiRA columns of one dp-sgd run (see the module docstring), timed."""
    from experiments.lira import lira_attack
    from experiments.lira_dp_sgd import MechanismError, train_dp_sgd

    t0 = time.perf_counter()
    lr = args.lr if args.lr > 0 else grid.node(grid.node_ids[0]).task.default_lr
    mech = audited_mechanism(grid, sigma, args.clip_norm, lr, seed, args.delta)
    x, y = sampled_train_data(grid, population, seed, args.alpha)
    pick = torch.from_numpy(np.random.default_rng([seed, 7]).permutation(len(y))[: args.lira_pool])
    if len(pick) < 4 * mech.batches:  # a random half below L examples cannot run at q = 1/L
        raise MechanismError(f"LiRA pool of {len(pick)} examples is too small for q = 1/{mech.batches}: "
                             f"use --lira-pool >= {4 * mech.batches}")
    train_s = [0.0]

    def timed_train(xs: torch.Tensor, ys: torch.Tensor, s: int) -> torch.nn.Module:
        t = time.perf_counter()
        model = train_dp_sgd(mech, xs, ys, s)
        train_s[0] += time.perf_counter() - t
        return model

    res = lira_attack(timed_train, x[pick], y[pick], n_models=args.lira_models, seed=seed, delta=args.delta)
    return {"lira_auc": res.auc, "lira_auc_ci_low": res.auc_ci_low, "lira_auc_ci_high": res.auc_ci_high,
            "lira_tpr_at_0.1pct_fpr": res.tpr_at_0_1pct_fpr, "lira_epsilon_lb": res.epsilon_lb,
            "lira_models": args.lira_models, "lira_pool": len(pick), "lira_steps": mech.steps,
            "lira_sample_rate": mech.sample_rate, "lira_s": time.perf_counter() - t0, "lira_train_s": train_s[0]}


def no_lira() -> dict[str, Any]:
    """The LiRA columns of a run that has no sample-level audit (client-level modes, lm, failed)."""
    return {**{k: math.nan for k in LIRA_COLUMNS}, "lira_models": 0, "lira_pool": 0, "lira_steps": 0,
            "lira_s": 0.0, "lira_train_s": 0.0}


@torch.no_grad()
def _window_losses(model, data: bytes, seq_len: int, n: int, gen: torch.Generator) -> np.ndarray:
    from node.tasks.lm import random_windows

    model.eval()
    out = []
    for start in range(0, n, 16):
        batch = random_windows(data, seq_len, min(16, n - start), gen)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none")
        out.append(loss.reshape(batch.shape[0], -1).mean(dim=1).numpy())
    return np.concatenate(out)


def _lm_final(grid, seed: int) -> tuple[float, float, int]:
    """(perplexity on the held-out modules, MIA AUC sampled nodes' windows vs held-out, members)."""
    from experiments.mia import loss_threshold_auc

    trained = set(trained_partitions(grid))
    nodes = [grid.node(n) for n in grid.node_ids if grid.partition_of(n) in trained]
    model = grid.node(grid.node_ids[0]).model
    task = nodes[0].task
    gen = torch.Generator().manual_seed(seed)
    heldout = _window_losses(model, task.heldout, task.seq_len, 64, gen)
    per_node = max(1, 64 // len(nodes))
    members = np.concatenate([_window_losses(model, n.task.share, task.seq_len, per_node, gen) for n in nodes])
    return float(math.exp(heldout.mean())), loss_threshold_auc(members, heldout[: len(members)]), len(members)


# -- one run (one seed of one point) ----------------------------------------------------------


def run_point(args: argparse.Namespace, mode: str, population: int, eps: float,
              train_sizes: Sequence[int] | None, run_id: int, seed: int | None = None) -> dict[str, Any]:
    """One federated run; a row of runs.csv."""
    from federation.local import InProcessGrid, run_local

    seed = args.seed if seed is None else seed
    cpr = clients_per_round(population, args.clients_per_round)
    sigma = sigma_for(mode, eps, args.delta, args.rounds, cpr, population, train_sizes, args.local_epochs,
                      client_sampling=args.client_sampling)
    max_weight = float(max(train_sizes)) if train_sizes else 1000.0
    rc = run_config_for(args, mode, population, cpr, sigma, seed, max_weight)
    t0 = time.perf_counter()
    grid = InProcessGrid(population, rc, run_id=run_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_local(rc, population, grid=grid)
    last = results.rounds[-1] if results.rounds else None
    rng = np.random.default_rng(seed)
    acc = ppl = auc = math.nan
    members = 0
    lira = no_lira()
    if results.status == "completed":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.task == "digits":
                acc, auc, members = _digits_final(grid, population, seed, args.alpha, rng)
            else:
                ppl, auc, members = _lm_final(grid, seed)
            if mode == "dp-sgd" and args.lira_models > 0:
                lira = lira_of_run(grid, args, population, sigma, seed)
    seconds = time.perf_counter() - t0
    phases = [r.seconds.get("train_phase", math.nan) + r.seconds.get("evaluate_phase", math.nan)
              for r in results.rounds]
    round_s = float(sum(phases)) if phases else math.nan
    spent, observers, kind = _spent(mode, eps, last)
    return {
        "task": args.task, "mode": mode, "population": population, "clients_per_round": cpr,
        "rounds": args.rounds, "seed": seed, "client_sampling": rc["client-sampling"], "target_epsilon": eps,
        "noise_multiplier": sigma, "epsilon_spent": spent, **observers,
        "epsilon_kind": kind, "accuracy": acc, "perplexity": ppl,
        "fed_metric": float(last.eval_metric) if last else math.nan, "mia_auc": auc, "mia_members": members,
        **lira, "status": results.status.split(":")[0], "seconds": seconds, "round_s": round_s,
    }


def _spent(mode: str, eps: float, last: Any) -> tuple[float, dict[str, float], str]:
    """(ε spent against third parties, {"epsilon_<observer>": ε} for the server, a node and
    colluding nodes, kind) from the last round record (``federation.privacy_ledger``). DP-SGD's
    sample-level ε is a node's own guarantee: the other observers' columns are null there."""
    keys = [f"epsilon_{o}" for o in OBSERVERS[1:]]
    if last is None or mode == "dp-sgd":
        spent = math.nan if last is None else float(last.epsilon_sample)
        return spent, dict.fromkeys(keys, math.nan), "sample" if mode == "dp-sgd" else "client"
    spent = float(last.epsilon_client)
    others = {k: float(getattr(last, k)) for k in keys}
    if math.isinf(eps):  # no noise: unbounded against everyone
        spent = math.inf if math.isnan(spent) else spent
        others = {k: math.inf if math.isnan(v) else v for k, v in others.items()}
    return spent, others, "client"


# -- points: statistics over seeds and the audit --------------------------------------------


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and Student-t interval over seeds (NaN interval for fewer than 2 finite values)."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return math.nan, math.nan, math.nan
    m = float(v.mean())
    if v.size < 2:
        return m, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return m, m - half, m + half


def mean_ci_json(values: Sequence[float], level: float = 0.95) -> tuple[float, list[float | None]]:
    """``mean_ci`` for a results JSON: (mean, [low, high]) with None where the interval is not
    defined (fewer than two finite values: JSON has no NaN)."""
    m, lo, hi = mean_ci(values, level)
    return m, [x if math.isfinite(x) else None for x in (lo, hi)]


def audit_sigma(mode: str, sigma: float, cpr: int) -> float:
    """Noise multiplier the *sum* carries: σ (distributed, flower-central), √k·σ (local)."""
    return sigma * math.sqrt(cpr) if mode == "local" else sigma


def audit_point(args: argparse.Namespace, mode: str, population: int, cpr: int, sigma: float,
                dim: int) -> tuple[float, str, float, float]:
    """(audit ε point estimate, kind, its one-sided lower bound, the bound's confidence): the
    canary audit for client-level modes; dp-sgd has no client-level audit (NaN)."""
    from experiments.canary_audit import AuditConfig, run_canary_audit

    if mode not in CLIENT_LEVEL:
        return math.nan, "none (sample-level: see mia_auc)", math.nan, math.nan
    cfg = AuditConfig(dim=dim, population=population, fraction=cpr / population,
                      sampling=sampling_of(mode, args.client_sampling), rounds=args.rounds,
                      sigma=audit_sigma(mode, sigma, cpr), clip_norm=args.clip_norm, trials=args.audit_trials,
                      delta=args.delta, seed=args.seed)
    res = run_canary_audit(cfg)
    return res.epsilon, f"canary one-shot ({res.pair})", res.epsilon_lower, res.confidence


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace, dim: int) -> list[dict[str, Any]]:
    """One row per (mode, population, ε): means and CIs over the seeds, ε, audit ε."""
    keys = list(dict.fromkeys((r["mode"], r["population"], r["target_epsilon"]) for r in runs))
    points = []
    for mode, pop, eps in keys:
        rs = [r for r in runs if (r["mode"], r["population"], r["target_epsilon"]) == (mode, pop, eps)]
        first = rs[0]
        row: dict[str, Any] = {k: first[k] for k in ("task", "mode", "population", "clients_per_round", "rounds",
                                                       "client_sampling", "target_epsilon", "noise_multiplier",
                                                       "epsilon_kind")}
        row["n_seeds"] = len(rs)
        for metric in METRICS:
            row[f"{metric}_mean"], row[f"{metric}_ci_low"], row[f"{metric}_ci_high"] = mean_ci(
                [r.get(metric, math.nan) for r in rs])  # runs.csv of older runs has no LiRA columns
        row["lira_tpr_at_0.1pct_fpr_mean"] = mean_ci([r.get("lira_tpr_at_0.1pct_fpr", math.nan) for r in rs])[0]
        lbs = [r.get("lira_epsilon_lb", math.nan) for r in rs]
        row["lira_epsilon_lb_max"] = max((v for v in lbs if math.isfinite(v)), default=math.nan)
        row["lira_models"] = int(max(r.get("lira_models", 0) for r in rs))
        row["epsilon_accountant"] = max(r["epsilon_spent"] for r in rs)
        for o in OBSERVERS[1:]:
            row[f"epsilon_{o}"] = max(r[f"epsilon_{o}"] for r in rs)
        (row["audit_epsilon"], row["audit_kind"], row["canary_eps_lower"],
         row["canary_confidence"]) = audit_point(args, mode, pop, first["clients_per_round"],
                                                              first["noise_multiplier"], dim)
        row["completed"] = sum(r["status"] == "completed" for r in rs)
        row["seconds"] = float(np.mean([r["seconds"] for r in rs]))
        points.append(row)
    return points


def audit_failures(points: list[dict[str, Any]]) -> list[str]:
    """Points whose audit ε (canary point estimate or lower bound, or LiRA's lower bound) exceeds
    the accountant's: a bug, never a result."""
    out = []
    for p in points:
        for key, name in (("audit_epsilon", "canary audit"), ("canary_eps_lower", "canary audit ε lower bound"),
                          ("lira_epsilon_lb_max", "LiRA ε lower bound")):
            v, acc = p.get(key, math.nan), p["epsilon_accountant"]
            if math.isfinite(v) and math.isfinite(acc) and v > acc:
                out.append(f"{p['mode']} pop {p['population']} ε={_fmt_eps(p['target_epsilon'])}: {name} "
                           f"{v:.3g} > accountant {acc:.3g}")
    return out


def model_dim(task: str, seed: int) -> int:
    from node.cache_node import build_model

    return int(sum(p.numel() for p in build_model(task, seed).parameters()))


# -- estimate -----------------------------------------------------------------------------


def calibrate(args: argparse.Namespace, populations: Sequence[int]) -> tuple[float, str]:
    """Seconds for the whole sweep from one measured 2-round run per (population, mode) at
    ε = 8: per-round cost = the rounds' measured phase times (train + evaluate), the rest of
    the run (node setup, provisioning, final evaluation, MIA) counted once per run, and for
    dp-sgd its LiRA (``lira_estimate``). Cost is linear in rounds and seeds; it hardly depends
    on ε (noise is drawn either way). The canary audits and σ searches are not included."""
    total = 0.0
    sub = argparse.Namespace(**{**vars(args), "rounds": 2})
    for pop in populations:
        sizes = digits_train_sizes(pop, args.seed, args.alpha) if args.task == "digits" else None
        for i, mode in enumerate(args.modes):
            row = run_point(sub, mode, pop, 8.0, sizes, run_id=900_000 + pop * 10 + i)
            total += len(args.epsilons) * args.seeds * run_estimate(row, args.rounds, args.local_epochs)
    basis = (f"one measured 2-round run per (population, mode) on this machine now, per-round and "
             f"fixed costs extrapolated to {args.rounds} rounds x {len(args.epsilons)} epsilons x "
             f"{args.seeds} seeds; LiRA ({args.lira_models} models) included, its training scaled to a node "
             "trained every round; canary audits not included")
    return total, basis


def run_estimate(row: dict[str, Any], rounds: int, local_epochs: int) -> float:
    """Seconds of one run at ``rounds`` from a measured 2-round ``row`` of run_point."""
    per_round = row["round_s"] / 2 if math.isfinite(row["round_s"]) else row["seconds"] / 2
    setup = max(row["seconds"] - 2 * per_round - row["lira_s"], 0.0)
    return setup + per_round * rounds + lira_estimate(row, rounds, local_epochs)


def lira_estimate(row: dict[str, Any], rounds: int, local_epochs: int) -> float:
    """Seconds of a run's LiRA at ``rounds``: the measured training time per DP-SGD step times
    models x L x epochs x rounds (an upper bound: the audited node trained every round), plus
    the measured attack time (scoring, bootstrap), which does not grow with the steps."""
    if not row["lira_models"] or not row["lira_steps"]:
        return 0.0
    per_step = row["lira_train_s"] / (row["lira_models"] * row["lira_steps"])
    steps = round(1 / row["lira_sample_rate"]) * local_epochs * rounds
    return per_step * row["lira_models"] * steps + max(row["lira_s"] - row["lira_train_s"], 0.0)


# -- outputs ------------------------------------------------------------------------------


def _fmt_eps(v: float) -> str:
    return "∞" if math.isinf(v) else "nan" if math.isnan(v) else f"{v:.3g}"


def _fmt_ci(p: dict[str, Any], metric: str) -> str:
    m, lo, hi = p[f"{metric}_mean"], p[f"{metric}_ci_low"], p[f"{metric}_ci_high"]
    if math.isnan(m):
        return "nan"
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if math.isfinite(lo) else f"{m:.3f}"


def write_outputs(run_dir, runs: list[dict[str, Any]], points: list[dict[str, Any]], args: argparse.Namespace,
                  meta: dict[str, Any]) -> None:
    write_csv(run_dir / "runs.csv", runs, RUN_COLUMNS)
    write_csv(run_dir / "points.csv", points, COLUMNS)
    if not (meta.get("replot") and (run_dir / "meta.json").exists()):
        write_json(run_dir / "meta.json", meta)
    (run_dir / "summary.md").write_text("\n".join(summary_lines(runs, points, args, meta)) + "\n")
    plot_points(run_dir, points, args)


def summary_lines(runs: list[dict[str, Any]], points: list[dict[str, Any]], args: argparse.Namespace,
                  meta: dict[str, Any]) -> list[str]:
    metric = "accuracy" if args.task == "digits" else "perplexity"
    seeds = sorted({r["seed"] for r in runs})
    shown = [{"mode": p["mode"], "population": p["population"], "clients_per_round": p["clients_per_round"],
              "target_epsilon": _fmt_eps(p["target_epsilon"]), "noise_multiplier": p["noise_multiplier"],
              "n_seeds": p["n_seeds"], f"{metric} mean [95% CI]": _fmt_ci(p, metric),
              "ε 3rd party": _fmt_eps(p["epsilon_accountant"]), "ε server": _fmt_eps(p["epsilon_server"]),
              "ε a node": _fmt_eps(p["epsilon_node"]), "ε t nodes": _fmt_eps(p["epsilon_colluding"]),
              "ε kind": p["epsilon_kind"], "audit ε": _fmt_eps(p["audit_epsilon"]),
              "audit ε lb": _fmt_eps(p.get("canary_eps_lower", math.nan)),
              "LiRA ε lb": _fmt_eps(p.get("lira_epsilon_lb_max", math.nan)),
              "LiRA AUC [95% CI]": _fmt_ci(p, "lira_auc"),
              "LiRA TPR@0.1%FPR": f"{p.get('lira_tpr_at_0.1pct_fpr_mean', math.nan):.3g}",
              "MIA AUC [95% CI]": _fmt_ci(p, "mia_auc")} for p in points]
    few = len(seeds) < 5
    quick = (f" — **{'quick mode: ' if args.quick else ''}only {len(seeds)} seed(s), fewer than the 5 a result "
             "needs; the CIs are wide**" if few else "")
    lines = [f"# privacy vs accuracy ({args.task})", "",
             f"{len(seeds)} paired seeds {seeds}{quick}; mean and 95 % Student-t CI over seeds.", "",
             f"rounds={args.rounds}, δ={args.delta}, clip-norm={args.clip_norm}, local-epochs={args.local_epochs}, "
             f"alpha={args.alpha}, client-sampling={args.client_sampling} (flower-central: fixed), sampler seeded "
             f"per seed; at most {args.clients_per_round} clients per round. "
             + ("accuracy = final global model on the digits global test split (no client holds it). "
                if args.task == "digits" else "perplexity = final global model on the held-out modules. ")
             + "ε 3rd party: client-level against third parties (Flower RdpAccountant for the sampler, "
             "amplified) except dp-sgd: sample-level (largest node ε, Opacus). ε server / a node / t nodes: the "
             "same releases without amplification, at the noise each does not know (the server knows the "
             "sample; key-holding nodes also their own noise shares; t = colluding-nodes; "
             "federation.privacy_ledger). audit ε: canary one-shot audit of the client-level mechanism, the "
             "accounted adjacency's worst-case pair (fixed: canary x vs −x, poisson: x vs absent), point "
             f"estimate ({args.audit_trials} trials per world; capped at 50 = the canary is plainly visible); audit "
             "ε lb: its one-sided Clopper–Pearson lower bound at 95 % (canary_confidence). LiRA (dp-sgd only): "
             f"{args.lira_models} DP-SGD models of the most-charged node's mechanism (its σ, q, steps) on halves of "
             f"up to {args.lira_pool} examples of sampled clients (runs.csv: lira_pool, lira_steps), leave-one-out; "
             "AUC mean and CI over seeds, TPR at 0.1 % FPR mean, ε lb = the largest Clopper–Pearson lower bound "
             "over seeds, to set against the sample-level ε accountant. MIA = loss-threshold AUC, members only "
             "from sampled clients vs the global test split (0.5 = no leak).", "",
             markdown_table(shown), ""]
    if args.client_sampling == "poisson" and any(m in FLOWER_MODES for m in args.modes):
        lines += ["Not like for like: the Flower modes sample a fixed k (replace-one ε), fedkv's modes here "
                  "Poisson (add-or-remove-one ε); the same ε number is a stronger guarantee under replace-one. "
                  "Compare the modes with --client-sampling fixed.", ""]
    failures = audit_failures(points)
    lines += (["## audit check: FAILED (an empirical ε above the accountant's is a bug)", ""]
              + [f"- {f}" for f in failures] if failures else
              ["audit check: every audit ε is at or below its accountant ε."])
    lines += [""] + _targets(points, args)
    lines += ["", (f"sum of the runs' times: {format_duration(meta['wall_s'])}" if meta.get("replot")
                   else f"total wall time: {format_duration(meta['wall_s'])}")]
    return lines


def _series(points: list[dict[str, Any]], mode: str, key: str, xkey: str) -> tuple[list, list, list, list]:
    pts = sorted((p for p in points if p["mode"] == mode and math.isfinite(p[xkey])
                  and math.isfinite(p["target_epsilon"])), key=lambda p: p[xkey])
    return ([p[xkey] for p in pts], [p[f"{key}_mean"] for p in pts], [p[f"{key}_ci_low"] for p in pts],
            [p[f"{key}_ci_high"] for p in pts])


def plot_points(run_dir, points: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Per population: client-level modes against client-level ε, dp-sgd against sample-level ε
    (separate figures), each for the task metric and the MIA AUC, with 95 % CIs."""
    from experiments.output import plot_lines

    metric = "accuracy" if args.task == "digits" else "perplexity"
    for pop in sorted({p["population"] for p in points}):
        sub = [p for p in points if p["population"] == pop]
        for level, modes in (("client", [m for m in args.modes if m in CLIENT_LEVEL]),
                             ("sample", [m for m in args.modes if m == "dp-sgd"])):
            if not modes:
                continue
            keys = [(metric, metric), ("mia_auc", "membership-inference AUC")]
            keys += [("lira_auc", "LiRA AUC (sample-level audit)")] if level == "sample" else []
            for key, ylabel in keys:
                series, styles, bands = {}, {}, {}
                xs_all = []
                for mode in modes:
                    color = f"C{MODES.index(mode)}"
                    xs, ys, lo, hi = _series(sub, mode, key, "epsilon_accountant")
                    if xs:
                        series[mode], bands[mode], styles[mode] = (xs, ys), (lo, hi), {"color": color}
                        xs_all += xs
                    ref = [p for p in sub if p["mode"] == mode and math.isinf(p["target_epsilon"])]
                    if ref and xs_all:
                        label = f"{mode} ε=∞"
                        series[label] = ([min(xs_all), max(xs_all)], [ref[0][f"{key}_mean"]] * 2)
                        styles[label] = {"linestyle": "--", "marker": "", "color": color}
                if not series:  # only ε=∞ points: plot them at x=1 so the file still exists
                    series = {p["mode"]: ([1.0], [p[f"{key}_mean"]]) for p in sub if p["mode"] in modes}
                if key in ("mia_auc", "lira_auc") and xs_all:
                    series["chance (0.5)"] = ([min(xs_all), max(xs_all)], [0.5, 0.5])
                    styles["chance (0.5)"] = {"linestyle": ":", "marker": "", "color": "gray"}
                fname = f"{key}_vs_{level}_epsilon_pop{pop}.png"
                plot_lines(run_dir / fname, series, xlabel=f"{level}-level ε spent (log; dashed = ε=∞)",
                           ylabel=ylabel, logx=True, logy=False, styles=styles, bands=bands,
                           title=f"{args.task}, {pop} clients, {sub[0]['clients_per_round']} per round, "
                                 f"{sub[0]['n_seeds']} seeds (95 % CI)")


def _targets(points: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The issue's targets, evaluated on this run's points (digits, means over seeds)."""
    if args.task != "digits":
        return []
    n_seeds = min((p["n_seeds"] for p in points), default=0)
    out = ["## targets (measured on this run, means over seeds)", ""]
    if n_seeds < 5:
        out += [f"(only {n_seeds} seed(s): the issue's targets need >= 5 paired seeds and the full sweep; "
                "the lines below are not evidence either way)", ""]
    by = {(p["mode"], p["population"], p["target_epsilon"]): p for p in points}
    pops = sorted({p["population"] for p in points})
    eps_finite = sorted({p["target_epsilon"] for p in points if math.isfinite(p["target_epsilon"])})
    for pop in pops:
        for eps in eps_finite:
            d = by.get(("distributed", pop, eps))
            f = max((by[k] for k in by if k[0] in FLOWER_MODES and k[1:] == (pop, eps)),
                    key=lambda p: p["accuracy_mean"], default=None)
            if d and f:
                gap = 100 * (d["accuracy_mean"] - f["accuracy_mean"])
                overlap = not (d["accuracy_ci_low"] > f["accuracy_ci_high"] or f["accuracy_ci_low"] > d["accuracy_ci_high"])
                out.append(f"- pop {pop}, ε={eps:g}: distributed − {f['mode']} = {gap:+.1f} pt "
                           f"(target within 0.5 pt: {'met' if abs(gap) <= 0.5 else 'NOT met'}; CIs "
                           f"{'overlap' if overlap else 'do not overlap'})")
    for pop in pops:
        e8 = [p for p in points if p["population"] == pop and p["target_epsilon"] == 8 and p["epsilon_kind"] == "client"]
        inf = [p for p in points if p["population"] == pop and math.isinf(p["target_epsilon"])]
        if e8 and inf:
            best = max(e8, key=lambda p: p["accuracy_mean"])
            ref = max(p["accuracy_mean"] for p in inf)
            gap = 100 * (best["accuracy_mean"] - ref)
            out.append(f"- pop {pop}, client-level ε=8: best mode {best['mode']} {100 * best['accuracy_mean']:.1f} % "
                       f"vs best non-private {100 * ref:.1f} % ({gap:+.1f} pt; target within 2 pt: "
                       f"{'met' if gap >= -2 else 'NOT met'})")
    return out


# -- main ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.privacy_accuracy", description=__doc__.split("\n\n")[0])
    add_common_args(p, quick_help=f"CI-sized run: populations {QUICK['populations']}, epsilons "
                                  f"{QUICK['epsilons']}, {QUICK['rounds']} rounds, {QUICK['seeds']} seeds")
    p.add_argument("--task", choices=("digits", "lm"), default="digits")
    p.add_argument("--modes", type=parse_modes, default=None,
                   help=f"comma list of {','.join(MODES)} (default all; lm: dp-sgd is skipped)")
    p.add_argument("--epsilons", type=parse_floats, default=None,
                   help=f"target ε list, 'inf' = no noise (default {FULL['epsilons']})")
    p.add_argument("--populations", type=parse_ints, default=None,
                   help=f"clients in the federation (default {FULL['populations']})")
    p.add_argument("--rounds", type=int, default=None, help=f"server rounds (default {FULL['rounds']})")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"paired seeds per point: --seed, --seed+1, ... (default {FULL['seeds']}, quick {QUICK['seeds']})")
    p.add_argument("--client-sampling", choices=("fixed", "poisson"), default="fixed",
                   help="fedkv's client sampler (flower-central always samples a fixed k)")
    p.add_argument("--audit-trials", type=int, default=None,
                   help=f"canary audit trials per point (default {FULL['audit_trials']}, quick {QUICK['audit_trials']})")
    p.add_argument("--clients-per-round", type=int, default=None,
                   help=f"clients sampled per round (capped at the population; default {FULL['clients_per_round']}, "
                        f"quick {QUICK['clients_per_round']})")
    p.add_argument("--lira-models", type=int, default=None,
                   help=f"LiRA models per dp-sgd run, 0 = no LiRA (default {FULL['lira_models']}, quick "
                        f"{QUICK['lira_models']})")
    p.add_argument("--lira-pool", type=int, default=None,
                   help=f"examples of sampled clients the LiRA models train on halves of (default "
                        f"{FULL['lira_pool']}, quick {QUICK['lira_pool']})")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.0, help="local learning rate, 0 = the task default")
    p.add_argument("--alpha", type=float, default=10.0,
                   help="Dirichlet concentration of the digits split (default 10: 100 partitions of >= 10 "
                        "samples are not feasible at alpha=1)")
    p.add_argument("--no-estimate", action="store_true", help="skip the calibration runs")
    p.add_argument("--replot", metavar="RUN_DIR", default=None,
                   help="only rewrite points.csv, summary.md and the plots of RUN_DIR from its runs.csv "
                        "(e.g. an interrupted run; its runs are kept as they are)")
    return p


def read_rows(path) -> list[dict[str, Any]]:
    """runs.csv back into typed rows (the inverse of write_csv for RUN_COLUMNS)."""
    import csv

    ints = {"population", "clients_per_round", "rounds", "seed", "mia_members", "lira_models", "lira_pool",
            "lira_steps"}
    strs = {"task", "mode", "epsilon_kind", "status", "client_sampling"}
    rows = []
    with open(path, newline="") as fh:
        for raw in csv.DictReader(fh):
            rows.append({k: v if k in strs else int(v) if k in ints else float(v) for k, v in raw.items()})
    return rows


def _replot(args: argparse.Namespace) -> int:
    from pathlib import Path

    run_dir = Path(args.replot)
    runs = read_rows(run_dir / "runs.csv")
    if not runs:
        print(f"{run_dir / 'runs.csv'} has no runs", file=sys.stderr)
        return 2
    first = runs[0]
    args.task, args.rounds, args.client_sampling = first["task"], int(first["rounds"]), first["client_sampling"]
    args.modes = list(dict.fromkeys(r["mode"] for r in runs))
    args.seeds = len({r["seed"] for r in runs})
    args.seed = min(r["seed"] for r in runs)
    args.audit_trials = args.audit_trials or QUICK["audit_trials"]
    args.clients_per_round = args.clients_per_round or max(r["clients_per_round"] for r in runs)
    args.lira_models = max((int(r.get("lira_models", 0)) for r in runs), default=0)
    args.lira_pool = max((int(r.get("lira_pool", 0)) for r in runs), default=0)
    points = summarise(runs, args, model_dim(args.task, args.seed))
    write_outputs(run_dir, runs, points, args, {"replot": True, "wall_s": sum(r["seconds"] for r in runs)})
    print((run_dir / "summary.md").read_text())
    print_results_dir(run_dir)
    return 0


def _resolve(args: argparse.Namespace) -> str | None:
    """Fill preset defaults; the problem with the arguments, or None."""
    preset = QUICK if args.quick else FULL
    args.populations = args.populations or parse_ints(preset["populations"])
    args.epsilons = args.epsilons or parse_floats(preset["epsilons"])
    args.rounds = args.rounds or preset["rounds"]
    args.seeds = args.seeds or preset["seeds"]
    args.audit_trials = args.audit_trials or preset["audit_trials"]
    args.clients_per_round = args.clients_per_round or preset["clients_per_round"]
    args.lira_models = preset["lira_models"] if args.lira_models is None else args.lira_models
    args.lira_pool = args.lira_pool or preset["lira_pool"]
    args.modes = args.modes or list(QUICK_MODES if args.quick else MODES)
    if args.task == "lm" and "dp-sgd" in args.modes:
        args.modes = [m for m in args.modes if m != "dp-sgd"]
        print("note: dp-sgd is offered for digits only (the lm node has no per-sample loader); skipped")
        if not args.modes:
            return "no mode left to run"
    if args.rounds < 1 or args.clients_per_round < 2 or args.seeds < 1 or args.audit_trials < 20:
        return "--rounds and --seeds must be >= 1, --clients-per-round >= 2, --audit-trials >= 20"
    if args.lira_models != 0 and args.lira_models < 4 or args.lira_pool < 8:
        return "--lira-models must be 0 (no LiRA) or >= 4, --lira-pool >= 8"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        return _replot(args)
    problem = _resolve(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import federation.local  # noqa: F401  (imports flwr, which configures its logger)
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)  # one progress bar, not a log line per round
    torch.manual_seed(args.seed)
    seeds = [args.seed + i for i in range(args.seeds)]
    runs_todo = [(m, pop, eps, s) for pop in args.populations for m in args.modes for eps in args.epsilons
                 for s in seeds]
    if not args.no_estimate:
        est, basis = calibrate(args, args.populations)
        print_estimate(est, basis, label=f"{len(runs_todo) // len(seeds)} points x {len(seeds)} seeds")
    t_start = time.perf_counter()
    run_dir = make_run_dir(args.out, SCRIPT)
    runs: list[dict[str, Any]] = []
    for i, (mode, pop, eps, seed) in enumerate(progress(runs_todo, total=len(runs_todo), desc=SCRIPT)):
        sizes = digits_train_sizes(pop, seed, args.alpha) if args.task == "digits" else None
        runs.append(run_point(args, mode, pop, eps, sizes, run_id=10_000 + i, seed=seed))
        write_csv(run_dir / "runs.csv", runs, RUN_COLUMNS)  # partial results survive an interrupt
    points = summarise(runs, args, model_dim(args.task, args.seed))
    meta = {"args": {k: v for k, v in vars(args).items()}, "wall_s": time.perf_counter() - t_start,
            "torch_threads": torch.get_num_threads()}
    write_outputs(run_dir, runs, points, args, meta)
    print((run_dir / "summary.md").read_text())
    print_results_dir(run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
