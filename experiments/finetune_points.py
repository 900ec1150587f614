"""One point of ``experiments.private_finetune``: ``nodes`` chat nodes in this process (one shared
frozen base, ``node.tasks.tasks.chat_base``) fine-tune FFA-LoRA or plain LoRA adapters for ``rounds``
rounds, with example-level DP-SGD at a target ε (``node.tasks.dp_sgd``) or without it (ε = ∞: the
task's ordinary AdamW training, same steps and batch). Each round every node's update is clipped
to the run's C and the nodes' equal-weight mean is written back -- computed under CKKS by the
run's own codecs (``federation.codec``: the run's packing, preset and error feedback; one secret
context shared by the nodes, as the dealer's wrapped key is) or, with ``aggregation="plaintext"``,
in numpy, one update still encrypted per round to measure its bytes. No client-level noise: the
arms differ only by example-level DP.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from experiments.general_probe import probe_score
from federation.codec import ckks_preset_for, make_aggregator, make_client_codec, packing_for
from federation.config import RunConfig
from node.cache_node import CacheNode, DpConfig, NodeSpec
from node.models.lora import LoraConfig
from node.tasks.tasks import ChatTask, chat_base

METHODS = ("ffa_lora", "lora")
"""FFA-LoRA (A frozen from the public seed, B trained: the chat task's default) and plain LoRA."""


@dataclass(frozen=True)
class PointConfig:
    """The settings every point of a run shares (documented defaults: the full SmolLM2 run)."""

    chat_model: str = "smollm2"
    nodes: int = 5
    rounds: int = 2
    epochs: int = 1
    """Local epochs per round; each is the chat task's ``steps`` AdamW/DP-SGD steps."""
    steps: int = 3
    batch: int = 16
    """DP-SGD's expected Poisson batch; the non-private arm's fixed batch. DP-SGD pays one
    SmolLM2 backward per example: 16 keeps the full run (24 points, 3 seeds) near an hour on
    2 cores, and halves the noise on the mean gradient against 8."""
    example_clip: float = 1.0
    """Per-example L2 bound of DP-SGD."""
    update_clip: float = 1.0
    """The run's clip-norm C on each node's update (applied under HE in every dp-mode)."""
    delta: float = 1e-5
    lr: float = 5e-3
    eval_examples: int = 8
    """Held-out pairs per node (node i scores the i-th slice: 5 nodes score 40 pairs)."""
    general_mix: float = 0.2
    """Share of each node's training pool that is public general pairs (``ChatTask.general_mix``)."""
    aggregation: str = "ckks"
    """``ckks``: encrypted, aggregated and decrypted; ``plaintext``: numpy mean, CKKS bytes measured."""

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.rounds < 1 or self.epochs < 1 or self.steps < 1 or self.batch < 1:
            raise ValueError("nodes must be >= 2 and rounds, epochs, steps, batch >= 1")
        if self.aggregation not in ("ckks", "plaintext"):
            raise ValueError(f"aggregation must be 'ckks' or 'plaintext', not {self.aggregation!r}")

    def run_config(self) -> RunConfig:
        """The federation's config these points stand for: HE, no client-level DP, clip C."""
        return RunConfig.from_run_config({
            "task": "chat", "chat-model": self.chat_model, "he": True, "dp-mode": "none",
            "clip-norm": self.update_clip, "num-server-rounds": self.rounds,
            "min-clients": self.nodes})


@dataclass
class _Ckks:
    """The nodes' codec (shared secret context) and the server's public aggregator inputs."""

    dim: int
    cfg: RunConfig
    residuals: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from crypto import make_secret_context

        self.packing = packing_for(self.cfg, self.dim)
        self.preset = ckks_preset_for(self.cfg, self.dim)
        self.context = make_secret_context(self.preset)
        self.public = self.context.public_bytes()
        self.codec = make_client_codec(True, self.dim, self.packing, self.context)

    def encrypt(self, node: int, update: np.ndarray) -> bytes:
        """Node ``node``'s update at weight 1, with its error-feedback carry."""
        blob = self.codec.encode(update, 1.0, carry=self.residuals.get(node))
        self.residuals[node] = self.codec.residual
        return blob

    def mean(self, blobs: list[bytes]) -> np.ndarray:
        agg = make_aggregator(True, self.dim, self.packing, self.public)
        for b in blobs:
            agg.add(b)
        return self.codec.decode_mean(agg.result()).astype(np.float64)


def build_nodes(cfg: PointConfig, method: str, seed: int) -> list[CacheNode]:
    """``cfg.nodes`` chat nodes of ``seed``'s split; adapters of ``method``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    lora = LoraConfig(train_a=method == "lora")
    return [CacheNode(NodeSpec(i, cfg.nodes, task=f"chat:{cfg.chat_model}", seed=seed),
                      task=ChatTask(i, cfg.nodes, seed, chat_model=cfg.chat_model, steps_per_epoch=cfg.steps,
                                    batch_size=cfg.batch, eval_examples=cfg.eval_examples,
                                    sample_replies=0, lora=lora, general_mix=cfg.general_mix))
            for i in range(cfg.nodes)]


def pooled_perplexity(scored: list[tuple[ChatTask, torch.nn.Module]]) -> float:
    """exp(answer-token loss over every (task, model)'s held-out slice, pooled)."""
    total, count = 0.0, 0
    for task, model in scored:
        loss, c = task.answer_loss(model)
        total, count = total + loss * c, count + c
    return math.exp(total / count)


def base_point(cfg: PointConfig, seed: int) -> dict:
    """The base model (no adapters) on ``seed``'s held-out pairs and the probe."""
    t0 = time.perf_counter()
    tasks = [ChatTask(i, cfg.nodes, seed, chat_model=cfg.chat_model, eval_examples=cfg.eval_examples)
             for i in range(cfg.nodes)]
    base, codec = chat_base(cfg.chat_model)
    return {"seed": seed, "perplexity": pooled_perplexity([(t, base) for t in tasks]),
            **_probe_fields(base, codec, tasks[0].max_len), "wall_s": time.perf_counter() - t0}


def _probe_fields(model: torch.nn.Module, codec, max_len: int) -> dict:
    probe = probe_score(model, codec, max_len)
    return {"probe_accuracy": probe.accuracy, "probe_margin": probe.margin, "probe_greedy": probe.greedy,
            "probe_replies": list(probe.replies)}


def _round(nodes: list[CacheNode], cfg: PointConfig, dp: DpConfig, ckks: _Ckks) -> tuple[float, int, float]:
    """One round: train, clip to C, aggregate, write back. (largest ε spent, bytes of one
    upload, seconds the nodes trained)."""
    outs = [n.train_round(cfg.epochs, cfg.lr, dp) for n in nodes]
    clipped = [o.delta * min(1.0, cfg.update_clip / (o.delta_norm + 1e-12)) for o in outs]
    if cfg.aggregation == "ckks":
        blobs = [ckks.encrypt(i, u) for i, u in enumerate(clipped)]
        mean, nbytes = ckks.mean(blobs), len(blobs[0])
    else:
        mean, nbytes = np.mean(clipped, axis=0), len(ckks.encrypt(0, clipped[0]))
    for n in nodes:
        n.apply_mean_update(mean, n.version + 1)
    return (max(o.epsilon for o in outs) if dp.dp_sgd else math.inf), nbytes, sum(o.train_s for o in outs)


def run_point(cfg: PointConfig, method: str, epsilon: float, seed: int) -> dict:
    """Fine-tune ``method`` at example-level ``epsilon`` (inf: no DP-SGD) from ``seed``; the
    held-out perplexity, the probe, the ε spent and one node's upload bytes per round."""
    t0 = time.perf_counter()
    nodes = build_nodes(cfg, method, seed)
    private = math.isfinite(epsilon)
    dp = DpConfig(dp_sgd=private, target_epsilon=epsilon if private else 0.0, planned_rounds=cfg.rounds,
                  expected_batch=cfg.batch, example_clip=cfg.example_clip, target_delta=cfg.delta)
    ckks = _Ckks(nodes[0].layout.size, cfg.run_config())
    spent, nbytes, train_s = math.inf, 0, 0.0
    for _ in range(cfg.rounds):
        spent, nbytes, seconds = _round(nodes, cfg, dp, ckks)
        train_s += seconds
    return {"method": method, "epsilon": epsilon, "seed": seed, "perplexity": pooled_perplexity([(n.task, n.model) for n in nodes]),
            **_probe_fields(nodes[0].model, nodes[0].task.codec, nodes[0].task.max_len),
            "epsilon_example": spent if private else None, "noise_multiplier": nodes[0].dp_sigma,
            "upload_bytes": nbytes, "upload_values": nodes[0].layout.size, "ckks_preset": ckks.preset,
            "train_s": train_s, "wall_s": time.perf_counter() - t0}
