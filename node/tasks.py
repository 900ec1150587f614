"""The two federated tasks a node can serve, behind one small interface.

* ``digits``: scikit-learn's digits, a small MLP, Dirichlet non-IID split (flwr-datasets);
  metric = accuracy. Fast: what the privacy/accuracy sweeps use.
* ``lm``: the byte-level TinyTransformer on the standard library's sources, one share of
  whole top-level modules per node (non-IID); metric = perplexity on the held-out modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from crypto import Layout, flatten
from node import digits
from node.corpus import split_corpus
from node.lm import eval_loss, train_lm
from node.model import ModelConfig, TinyTransformer
from node.model_interface import CachedLM

LM_MODEL = ModelConfig(n_layers=2, n_heads=2, d_model=64, context_len=128)
"""The federated LM: ~0.13 M parameters, so a round of 5 encrypted nodes takes seconds."""


class Task(Protocol):
    name: str
    metric: str
    """Name of the evaluation metric: ``accuracy`` (higher is better) or ``perplexity``."""
    default_lr: float
    num_examples: int
    train_loader: DataLoader | None
    """Per-sample data for Opacus DP-SGD; None when the task does not support it."""

    def build_model(self, seed: int) -> nn.Module: ...
    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]: ...
    def evaluate(self, model: nn.Module) -> tuple[float, float, int]: ...


@dataclass
class DigitsTask:
    partition_id: int
    num_partitions: int
    seed: int = 42
    alpha: float = 1.0
    hidden: int = 64
    name: str = "digits"
    metric: str = "accuracy"
    default_lr: float = 0.3
    """Plain SGD."""

    def __post_init__(self) -> None:
        cfg = digits.DigitsConfig(
            num_partitions=self.num_partitions, alpha=self.alpha, seed=self.seed
        )
        self.train_loader, self.test_loader = digits.load_partition(self.partition_id, cfg)
        self.num_examples = len(self.train_loader.dataset)

    def build_model(self, seed: int) -> nn.Module:
        return digits.make_model(seed, self.hidden)

    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]:
        if self.train_loader.generator is not None:
            self.train_loader.generator.manual_seed(seed)
        return digits.train(model, self.train_loader, epochs, lr)

    def evaluate(self, model: nn.Module) -> tuple[float, float, int]:
        loss, acc = digits.evaluate(model, self.test_loader)
        return loss, acc, len(self.test_loader.dataset)


@dataclass
class LmTask:
    partition_id: int
    num_partitions: int
    seed: int = 42
    model_config: ModelConfig = LM_MODEL
    steps_per_epoch: int = 8
    batch_size: int = 8
    seq_len: int = 64
    eval_windows: int = 16
    name: str = "lm"
    metric: str = "perplexity"
    default_lr: float = 3e-3
    """AdamW, fresh each round."""
    train_loader: DataLoader | None = None  # Opacus DP-SGD is offered for digits only

    def __post_init__(self) -> None:
        split = split_corpus(self.num_partitions, seed=self.seed)
        self.share = split.shares[self.partition_id]
        self.heldout = split.heldout
        # one "example" = one training window; the weight of this node in FedAvg
        self.num_examples = max(1, len(self.share) // (self.seq_len + 1))

    def build_model(self, seed: int) -> nn.Module:
        return lm_model(seed, self.model_config)

    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]:
        model.train()
        g = torch.Generator().manual_seed(seed)
        steps = epochs * self.steps_per_epoch
        losses = train_lm(model, self.share, steps, self.batch_size, self.seq_len, lr, g)
        return (sum(losses) / len(losses) if losses else float("nan")), steps * self.batch_size

    def evaluate(self, model: nn.Module) -> tuple[float, float, int]:
        g = torch.Generator().manual_seed(self.seed)  # same windows every round: comparable
        with torch.no_grad():
            loss = eval_loss(model, self.heldout, self.seq_len, self.eval_windows, g)
        return loss, math.exp(loss), self.eval_windows * self.seq_len


def lm_model(seed: int | None = None, config: ModelConfig = LM_MODEL) -> CachedLM:
    """The node's language model (the one place that names its class), initialised from
    ``seed`` (None: torch's global generator as it is, for a model loaded afterwards)."""
    if seed is not None:
        torch.manual_seed(seed)
    return TinyTransformer(config)


def parameter_layout(model: nn.Module) -> Layout:
    """Names, shapes and order of the parameters the federation averages: a ``CachedLM``'s
    own ``parameter_layout()``, every state-dict entry of another model (the digits MLP)."""
    if isinstance(model, CachedLM):
        return model.parameter_layout()
    return flatten(model.state_dict(), check_finite=False)[1]


def federated_state(model: nn.Module, layout: Layout) -> dict[str, torch.Tensor]:
    """The model's state-dict entries ``layout`` names."""
    state = model.state_dict()
    return {n: state[n] for n in layout.names}


def load_parameters(model: nn.Module, state: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Load the entries ``layout`` names from ``state`` into ``model`` (a KeyError if one is
    absent); entries outside the layout (a frozen base under adapters) keep their values.
    A name the model lacks or a shape it does not have is refused, as a strict load would."""
    _, unexpected = model.load_state_dict({n: state[n] for n in layout.names}, strict=False)
    if unexpected:
        raise KeyError(f"parameters the model does not have: {sorted(unexpected)}")


def build_model(task: str, seed: int) -> nn.Module:
    """The task's model with the run's seeded init, without loading any data (the server
    sizes aggregates with it)."""
    if task == "lm":
        return lm_model(seed)
    if task == "digits":
        return digits.make_model(seed)
    raise ValueError(f"unknown task {task!r}; use 'digits' or 'lm'")


def make_task(name: str, partition_id: int, num_partitions: int, seed: int, alpha: float) -> Task:
    if name == "digits":
        return DigitsTask(partition_id, num_partitions, seed, alpha)
    if name == "lm":
        return LmTask(partition_id, num_partitions, seed)
    raise ValueError(f"unknown task {name!r}; use 'digits' or 'lm'")
