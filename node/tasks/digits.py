"""The ``digits`` task: scikit-learn's 8x8 digits, a small MLP, a non-IID split.

Why this task: it is in memory (no download, works offline and in CI), trains in
milliseconds per client, and is non-trivial enough (10 classes, ~97 % reachable)
to show an accuracy gap between plaintext, encrypted and DP aggregation.

Data flow: ``load_digits`` -> stratified global train/test split (the global test
split is for experiments only: the server never sees plaintext weights under HE)
-> ``DirichletPartitioner`` over the global train split (label skew, ``alpha``)
-> each partition is split again into a local train share and a local held-out
share that the client evaluates on (federated evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:  # imported where used: an lm node never pays for datasets and scikit-learn (~2 s)
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

NUM_FEATURES = 64
NUM_CLASSES = 10


@dataclass(frozen=True)
class DigitsConfig:
    """How the digits data is split. Every node of a run must use the same values."""

    num_partitions: int = 2
    """Number of clients the training split is divided into."""
    alpha: float = 1.0
    """Dirichlet concentration: small (0.1) = strong label skew, large (100) ~ IID."""
    seed: int = 42
    """Seeds the global split, the partitioner and the local splits."""
    test_fraction: float = 0.2
    """Share of all digits kept as a global held-out test set (experiments only)."""
    local_test_fraction: float = 0.2
    """Share of each partition a client keeps for its own (federated) evaluation."""
    batch_size: int = 32
    min_partition_size: int = 10
    """Passed to DirichletPartitioner: it resamples until every partition has this many. Capped
    at half the mean partition size (``effective_min_partition_size``): 100 partitions of the
    ~1,440 training digits average 14 each, and at 10 the partitioner gave up for some seeds."""

    def effective_min_partition_size(self, train_size: int) -> int:
        return max(1, min(self.min_partition_size, train_size // (2 * self.num_partitions)))


class DigitsMLP(nn.Module):
    """64 -> hidden -> 10 MLP (~4.8k parameters with hidden=64): fast, big enough to learn."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_model(seed: int, hidden: int = 64) -> DigitsMLP:
    """Build the model with seeded init, so every node starts from identical weights.

    This is what lets the HE path skip sending plaintext initial weights: round 1
    starts from the shared seed, later rounds from decrypted aggregates.
    """
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = DigitsMLP(hidden)
    torch.random.set_rng_state(gen_state)
    return model


@lru_cache(maxsize=4)
def _global_split(seed: int, test_fraction: float) -> tuple[Dataset, Dataset]:
    """All digits as in-memory ``datasets.Dataset``s: (train, test), stratified."""
    from datasets import Dataset
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    train = Dataset.from_dict({"pixels": x_tr.tolist(), "label": y_tr.tolist()})
    test = Dataset.from_dict({"pixels": x_te.tolist(), "label": y_te.tolist()})
    return train, test


@lru_cache(maxsize=4)
def _partitioner(cfg: DigitsConfig) -> DirichletPartitioner:
    """One partitioner per process and config (it caches its own index split)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    train = _global_split(cfg.seed, cfg.test_fraction)[0]
    part = DirichletPartitioner(
        num_partitions=cfg.num_partitions,
        partition_by="label",
        alpha=cfg.alpha,
        min_partition_size=cfg.effective_min_partition_size(len(train)),
        self_balancing=False,
        shuffle=True,
        seed=cfg.seed,
    )
    part.dataset = train
    return part


def _to_tensors(ds: Dataset) -> TensorDataset:
    x = torch.tensor(np.asarray(ds["pixels"], dtype=np.float32))
    y = torch.tensor(np.asarray(ds["label"], dtype=np.int64))
    return TensorDataset(x, y)


def load_partition(partition_id: int, cfg: DigitsConfig) -> tuple[DataLoader, DataLoader]:
    """(train loader, local held-out loader) for one client's Dirichlet partition."""
    if not 0 <= partition_id < cfg.num_partitions:
        raise ValueError(f"partition_id {partition_id} not in [0, {cfg.num_partitions})")
    part = _partitioner(cfg).load_partition(partition_id)
    split = part.train_test_split(test_size=cfg.local_test_fraction, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + partition_id)
    train = DataLoader(
        _to_tensors(split["train"]), batch_size=cfg.batch_size, shuffle=True, generator=gen
    )
    test = DataLoader(_to_tensors(split["test"]), batch_size=256)
    return train, test


def load_global_test(cfg: DigitsConfig) -> DataLoader:
    """The global held-out test set (for experiments and tests, never for the server)."""
    return DataLoader(_to_tensors(_global_split(cfg.seed, cfg.test_fraction)[1]), batch_size=256)


def partition_sizes(cfg: DigitsConfig) -> list[int]:
    """Examples per partition (before the local train/test split); handy in tests/logs."""
    part = _partitioner(cfg)
    return [part.load_partition(i).num_rows for i in range(cfg.num_partitions)]


def train(model: nn.Module, loader: DataLoader, epochs: int, lr: float) -> tuple[float, int]:
    """Plain SGD for ``epochs`` passes. Returns (mean training loss, number of examples)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return run_epochs(model, loader, opt, epochs), len(loader.dataset)


def run_epochs(model: nn.Module, loader: DataLoader, opt: torch.optim.Optimizer,
               epochs: int) -> float:
    """Cross-entropy training passes with a given optimizer (plain or Opacus-wrapped);
    returns the mean training loss. Empty batches (Poisson sampling) are skipped."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    total, seen = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            if len(y) == 0:
                continue
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            seen += len(y)
    return total / seen if seen else float("nan")


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on ``loader``."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            total += loss_fn(out, y).item()
            correct += (out.argmax(dim=1) == y).sum().item()
            n += len(y)
    if n == 0:
        return float("nan"), float("nan")
    return total / n, correct / n
