"""One fedkv run over any ``Grid``: what the ServerApp and ``federation.local.run_local`` share.

Wires the server's side: the ``KeyService`` (public material only: the server kit in deployment,
node-made keys in simulation), ``OpaqueFedAvg`` over signed ciphertext bytes, or Flower's DP
baseline for ``dp-mode=flower-central``; fills the ``RunResults``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any

from flwr.common import log

from crypto import privacy_claim
from crypto.dp.privacy import NO_MEANINGFUL_EPSILON
from federation.codec import ckks_preset_for, wire_dim
from federation.config import RunConfig
from federation.flower_central import run_flower_central
from federation.key_service import KeyService
from federation.results import RoundRecord, RunResults
from federation.strategy import OpaqueFedAvg
from node.cache_node import model_layout


def key_service(cfg: RunConfig, run_id: int, dim: int | None = None) -> KeyService:
    """The server's key relay; with ``server-kit`` it pins every node to the kit's roster.
    ``dim`` (the model size) resolves ``ckks-preset = "auto"`` for the keys nodes make."""
    kit = None
    if cfg.server_kit:
        from federation.startup_kit import load_server_kit

        kit = load_server_kit(cfg.server_kit)
    preset = ckks_preset_for(cfg, dim) if cfg.he and dim is not None else None
    return KeyService(cfg, run_id, kit, preset=preset)


def run_rounds(grid: Any, cfg: RunConfig, run_id: int, results: RunResults, *, wait_for_nodes_s: float,
               on_round: Callable[[RoundRecord], None]) -> None:
    """All rounds of one run; ``RunStopped`` propagates (the caller records it as "stopped: ...")."""
    results.server_pid = os.getpid()
    if cfg.dp_mode == "flower-central":
        run_flower_central(grid, cfg, results)
        for rec in results.rounds:
            on_round(rec)
        _claim(cfg, results)
        return
    dim = wire_dim(cfg, model_layout(cfg.task_id, cfg.seed).size)  # + the clipped count under adaptive clipping
    keys = key_service(cfg, run_id, dim)
    results.provisioning = keys.stats
    strategy = OpaqueFedAvg(cfg, dim, keys, wait_for_nodes_s=wait_for_nodes_s)
    if strategy.packing is not None:
        results.encoding = {**asdict(strategy.packing), "preset": keys.preset, "dim": dim}
        log(INFO, "fedkv: CKKS encoding %s", results.encoding)

    def record(rec: RoundRecord) -> None:
        results.rounds.append(rec)
        results.key_origin = dict(keys.key_origin)
        results.key_rotations = len(keys.rotations)
        on_round(rec)

    try:
        strategy.run(grid, record)
    finally:
        results.key_origin = dict(keys.key_origin)
        results.key_rotations = len(keys.rotations)
        _claim(cfg, results)


def _claim(cfg: RunConfig, results: RunResults) -> None:
    """``privacy_claim``: per training example first under DP-SGD (the unit a few organisations
    can protect at a meaningful ε), then per node's update (client level)."""
    eps = results.rounds[-1].epsilon_client if results.rounds else math.nan
    if cfg.dp_mode in ("local", "distributed", "flower-central") and not math.isfinite(eps):
        eps = math.inf
    # the δ of what ran: target-delta plus the saturation coupling's share (crypto.dp.privacy)
    delta = results.rounds[-1].delta_total if results.rounds else math.nan
    delta = delta if math.isfinite(delta) and 0 < delta < 1 else cfg.target_delta
    results.privacy_claim = privacy_claim(eps, cfg.dp_mode, delta=delta)
    if cfg.dp_sgd:  # a node's ε only grows: the largest any round reported
        spent = [r.epsilon_sample for r in results.rounds if not math.isnan(r.epsilon_sample)]
        example = privacy_claim(max(spent, default=math.inf), "local", delta=cfg.target_delta, level="example")
        results.privacy_claim = f"{example}: each training example; each node's update: {results.privacy_claim}"
    if cfg.dp_mode != "none" or cfg.dp_sgd:
        log(WARNING if results.privacy_claim.startswith(NO_MEANINGFUL_EPSILON) else INFO,
            "fedkv privacy: %s", results.privacy_claim)
