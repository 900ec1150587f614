"""Shadow models for a LiRA audit of a dp-sgd point: the digits model trained with Opacus
DP-SGD exactly as the point's mechanism is accounted — noise multiplier σ, clip norm C,
Poisson sampling at rate q = 1/L and T steps.

The sample-level guarantee of a dp-sgd point is per node: a node's local training, summed over
the rounds it was sampled, is T = rounds_trained · L · epochs DP-SGD steps at (σ, C, q), and the
accountant's ε depends on nothing else (not on the data set's size nor on the model's start). So
the audit trains that mechanism directly on pools of examples (``experiments.lira.lira_attack``)
instead of shadow federations. Every shadow starts from the same public initialisation (the run's
seed), as the nodes do: the attack is stronger, the mechanism the same.

Built on Opacus' public API (``PrivacyEngine.make_private`` over a ``DPDataLoader``), not on
``CacheNode``, so the audit is independent of the node code it checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DpSgdMechanism", "MechanismError", "dp_sgd_trainer", "train_dp_sgd"]


class MechanismError(ValueError):
    """A DP-SGD mechanism that cannot run: σ < 0, C <= 0, q not 1/L, no steps, no data."""


@dataclass(frozen=True)
class DpSgdMechanism:
    """What a dp-sgd node is charged for (``CacheNode._train_dp_sgd``), defaults = one round of
    a digits node with 4 batches and 2 local epochs."""

    noise_multiplier: float
    """σ of the Gaussian noise per step, in units of the clip norm (0 = clipping only)."""
    clip_norm: float = 1.0
    """Per-sample gradient norm bound C."""
    batches: int = 4
    """L: Poisson sampling rate q = 1/L (a node's batches per epoch, ceil(n / batch size))."""
    steps: int = 8
    """T: DP-SGD steps in all (L · local epochs · rounds the node trained)."""
    lr: float = 0.3
    """SGD learning rate (the digits task's default)."""
    init_seed: int = 0
    """Seed of the shared initial model (the run's seed: every node starts from it)."""

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise MechanismError(f"noise multiplier must be finite and >= 0, not {self.noise_multiplier}")
        if not self.clip_norm > 0:
            raise MechanismError(f"clip norm must be > 0, not {self.clip_norm}")
        if self.batches < 1 or self.steps < 1:
            raise MechanismError(f"need >= 1 batch per epoch and >= 1 step, not L={self.batches}, T={self.steps}")

    @property
    def sample_rate(self) -> float:
        return 1.0 / self.batches

    def epsilon(self, delta: float) -> float:
        """The accountant's ε of this mechanism: ``crypto.dp_sgd_epsilon``, the call the node reports with."""
        from crypto import dp_sgd_epsilon

        return dp_sgd_epsilon(self.noise_multiplier, self.sample_rate, self.steps, delta)


def train_dp_sgd(mech: DpSgdMechanism, x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
    """The digits MLP after T DP-SGD steps on (x, y); ``seed`` draws the batches and the noise.
    An empty Poisson batch is skipped but counted, as the node's loop does."""
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import TensorDataset

    from node.tasks import digits

    if len(y) < mech.batches:  # Opacus scales the noise by the expected batch int(n·q): 0 divides
        raise MechanismError(f"DP-SGD at q = 1/{mech.batches} needs at least {mech.batches} examples, got {len(y)}")
    gen = torch.Generator().manual_seed(seed)
    model = digits.make_model(mech.init_seed)
    loader = DPDataLoader(TensorDataset(x, y), sample_rate=mech.sample_rate, generator=gen)
    engine = PrivacyEngine(accountant="rdp")
    pmodel, popt, ploader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=mech.lr), data_loader=loader,
        noise_multiplier=mech.noise_multiplier, max_grad_norm=mech.clip_norm, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(seed + 1_000_003))
    _run_steps(pmodel, popt, ploader, mech.steps)
    return pmodel._module.eval()


def _run_steps(model: nn.Module, opt: torch.optim.Optimizer, loader, steps: int) -> None:
    loss_fn = nn.CrossEntropyLoss()
    done = 0
    model.train()
    while done < steps:
        for xb, yb in loader:
            if done == steps:
                break
            done += 1
            if len(yb) == 0:
                continue
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()


def dp_sgd_trainer(mech: DpSgdMechanism) -> Callable[[torch.Tensor, torch.Tensor, int], nn.Module]:
    """``train(x, y, seed)`` for ``experiments.lira.lira_attack``."""
    return lambda x, y, seed: train_dp_sgd(mech, x, y, seed)
