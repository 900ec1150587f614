"""Baseline ``dp-mode=flower-central``: Flower's own FedAvg + client-side fixed clipping.

Made like for like with fedkv's DP modes: uniform weights (every reply reports
``unit-weight`` = 1 and FedAvg weighs by it, so σC/n noise on the mean is σC on the sum, the
mechanism accounted), the same accountant as ``client-sampling=fixed`` (Flower samples k nodes
without replacement: replace-one adjacency, ``federation.client_accounting``), and a local shuffle
that changes every round (the node seeds its loader with the server round).

Plaintext weights travel as Flower ArrayRecords (default ``train``/``evaluate``
message types, ``fixedclipping_mod`` on the client's train handler), and the server
adds Gaussian noise σ·C/n to the mean. It is the yardstick for our DP modes, not a
private-from-the-server setup: the server sees every clipped update.

Note Flower's behaviour (1.42): if ANY train reply carries an error, the DP wrapper
skips aggregation for that round (the global model stays as it was).
"""

from __future__ import annotations

import math
import random
from typing import Any

from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    FedAvg,
)

from federation.client_accounting import ClientAccountant
from federation.config import RunConfig
from federation.results import METRIC_NAMES, RoundRecord, RunResults, mean, weighted_mean
from federation.sampling import evaluation_size
from node.cache_node import build_model


UNIT_WEIGHT = "unit-weight"
"""Reply metric FedAvg weighs by: 1 for every client (uniform weights, as under fedkv's DP)."""


def _train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Means over clients (not example-weighted) except the loss, plus the count."""
    m = [next(iter(r.metric_records.values())) for r in records]
    n = [float(x["num-examples"]) for x in m]  # reported means by examples; the model mean is uniform
    return MetricRecord(
        {
            "num-clients": len(m),
            "train-loss": weighted_mean([float(x["train-loss"]) for x in m], n),
            "clipped": mean([float(x["clipped"]) for x in m]),
            "upload-bytes": mean([float(x["upload-bytes"]) for x in m]),
            "train-s": mean([float(x["train-s"]) for x in m]),
            # DP-SGD: the largest example-level ε any node reported (each node's own budget)
            **({"epsilon-sample": max(float(x["epsilon-sample"]) for x in m)}
               if m and all("epsilon-sample" in x for x in m) else {}),
        }
    )


def _eval_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    m = [next(iter(r.metric_records.values())) for r in records]
    n = [float(x["num-examples"]) for x in m]  # reported means by examples; the model mean is uniform
    return MetricRecord(
        {
            "num-clients": len(m),
            "eval-loss": weighted_mean([float(x["eval-loss"]) for x in m], n),
            "eval-metric": weighted_mean([float(x["eval-metric"]) for x in m], n),
        }
    )


class SteadyClientSideAdaptiveClipping(DifferentialPrivacyClientSideAdaptiveClipping):
    """Flower 1.42's client-side adaptive clipping with the norm update turned the right way.

    Flower counts *clipped* updates (``adaptiveclipping_mod``'s norm bit is "was scaled down")
    and documents ``target_clipped_quantile`` as the share that should be clipped, but then
    applies Andrew et al.'s rule C·exp(−η(b̃ − γ)), which is written for the *unclipped*
    share: with every update clipped the norm shrinks (0.1 -> 0.0905), so it runs away from the
    target instead of to it (``tests/federation/test_flower_central.py``). The unclipped share
    is 1 − the noisy clipped share (the same release), which is what this passes on; the
    baseline then tracks the quantile γ of unclipped updates, as fedkv's own mode does."""

    def _geometric_update(self, clipped_fraction: float) -> None:
        super()._geometric_update(1.0 - clipped_fraction)


def dp_wrapper(cfg: RunConfig, fedavg: FedAvg, num_sampled: int) -> Any:
    """Flower's client-side fixed or adaptive clipping (``adaptive-clipping``) around FedAvg.

    Adaptive (Andrew et al. 2021): Flower splits σ between the update sum and the clipped count
    (σ_update = (σ⁻² − (2σ_b)⁻²)^(-1/2)), so the round is still a Gaussian release at σ and the
    same accountant applies."""
    if not cfg.adaptive_clipping:
        return DifferentialPrivacyClientSideFixedClipping(fedavg, cfg.noise_multiplier, cfg.clip_norm, num_sampled)
    return SteadyClientSideAdaptiveClipping(
        fedavg, cfg.noise_multiplier, num_sampled, initial_clipping_norm=cfg.clip_norm,
        target_clipped_quantile=cfg.target_clipped_quantile, clip_norm_lr=cfg.clip_norm_lr,
        clipped_count_stddev=clipped_count_stddev(cfg, num_sampled))


def clipped_count_stddev(cfg: RunConfig, num_sampled: int) -> float:
    """σ_b: ``clipped-count-stddev``, or 0 = max(k/20, σ). Andrew et al.'s k/20 alone must exceed
    σ/2 for the update noise to exist; at σ_b = σ the update noise is 1.155σ."""
    return cfg.clipped_count_stddev or max(num_sampled / 20, cfg.noise_multiplier)


class SecretOrderGrid:
    """``grid`` whose ``get_node_ids`` lists the nodes in an order drawn from the OS's CSPRNG.

    Why: Flower 1.42 samples with the global Mersenne Twister (``random.sample`` in
    ``strategy_utils.sample_nodes``), whose state its outputs reveal; amplification by sampling
    needs a sample nobody can predict. ``random.sample`` over a list in a secret uniform order
    is a secret uniform sample whatever the Twister's state. ``seed`` >= 0 (experiments) makes
    the order reproducible instead. Everything else is the wrapped grid's."""

    def __init__(self, grid: Grid, seed: int = -1) -> None:
        self._grid = grid
        self._rng: random.Random = random.SystemRandom() if seed < 0 else random.Random(seed)

    def get_node_ids(self) -> list[int]:
        nodes = list(self._grid.get_node_ids())
        self._rng.shuffle(nodes)
        return nodes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def run_flower_central(grid: Grid, cfg: RunConfig, results: RunResults) -> None:
    """Run all rounds with Flower's strategy and copy its metrics into ``results``."""
    num_nodes = len(list(grid.get_node_ids()))
    num_sampled = max(cfg.min_clients, int(num_nodes * cfg.fraction_train))
    fedavg = FedAvg(
        fraction_train=cfg.fraction_train,
        # Flower samples int(N·fraction) evaluators: +0.5 makes that fedkv's evaluation_size
        fraction_evaluate=min(1.0, (evaluation_size(num_nodes, cfg.fraction_evaluate, cfg.min_clients,
                                                    cfg.max_evaluate_clients) + 0.5) / max(num_nodes, 1)),
        min_train_nodes=cfg.min_clients,
        min_evaluate_nodes=cfg.min_clients,
        min_available_nodes=cfg.min_clients,
        train_metrics_aggr_fn=_train_metrics,
        evaluate_metrics_aggr_fn=_eval_metrics,
        weighted_by_key=UNIT_WEIGHT,
    )
    strategy = dp_wrapper(cfg, fedavg, num_sampled)
    if cfg.sampler_seed >= 0:  # experiments: Flower samples with the global ``random``
        random.seed(cfg.sampler_seed)
    initial = ArrayRecord(build_model(cfg.task, cfg.seed).state_dict())
    result = strategy.start(
        grid=SecretOrderGrid(grid, cfg.sampler_seed), initial_arrays=initial, num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout,
    )
    # Client-level ε of Flower's mechanism: noise σC on the sum of clipped updates, one
    # release per round of k of N nodes without replacement (as OpaqueFedAvg, client-sampling=fixed).
    sampled = min(num_sampled, num_nodes)
    accountant = ClientAccountant("fixed", num_nodes, cfg.target_delta) if cfg.noise_multiplier > 0 else None
    for rnd in range(1, cfg.num_server_rounds + 1):
        tr = result.train_metrics_clientapp.get(rnd, MetricRecord())
        ev = result.evaluate_metrics_clientapp.get(rnd, MetricRecord())
        rec = RoundRecord(round=rnd, sampled=num_sampled, metric=METRIC_NAMES[cfg.task])
        rec.num_clients = int(tr.get("num-clients", 0))
        rec.train_loss = float(tr.get("train-loss", math.nan))
        rec.epsilon_sample = float(tr.get("epsilon-sample", math.nan))
        rec.clipped_fraction = float(tr.get("clipped", math.nan))
        rec.upload_bytes_mean = float(tr.get("upload-bytes", math.nan))
        rec.seconds["train"] = float(tr.get("train-s", math.nan))
        rec.eval_loss = float(ev.get("eval-loss", math.nan))
        rec.eval_metric = float(ev.get("eval-metric", math.nan))
        rec.eval_clients = int(ev.get("num-clients", 0))
        rec.population = num_nodes
        rec.delta = cfg.target_delta
        rec.epsilon_server = math.inf  # it sees every update in clear and adds the noise itself
        rec.colluding_nodes = cfg.colluding_nodes
        if accountant is None:
            rec.epsilon_client = rec.epsilon_node = rec.epsilon_colluding = math.inf
        else:
            if rec.num_clients > 0:  # Flower skips a round's aggregation when a reply failed
                accountant.step(cfg.noise_multiplier, sampled)
            rec.epsilon_client = accountant.epsilon()
            # nodes see the released model; the noise is the server's, unknown to any of them,
            # and the sample may be known to them: no amplification
            rec.epsilon_node = rec.epsilon_colluding = accountant.epsilon_no_amplification()
        results.rounds.append(rec)
