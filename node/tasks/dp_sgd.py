"""Example-level DP-SGD for the language tasks (``lm``, ``chat``): Poisson batches, per-example
gradients clipped to C, Gaussian noise σ·C on their sum -- the mechanism Opacus' ``make_private``
applies, in one call (``private_step``) with its randomness injected.

Why not Opacus here: its per-layer grad samplers have no rule for ``scaled_dot_product_attention``
(both language models use it) nor for the LoRA wrappers. Why not ``torch.func.vmap(grad(...))``:
on CPU it falls back to a per-example loop for SDPA and ran ~8x slower than this one on the byte
LM. So each example gets its own backward: exact per-example gradients for any module.

Accounting: Poisson sampling at q = ``expected_batch`` / n and N(0, (σC)²) on the sum is the
sampled Gaussian mechanism; ``crypto.dp_sgd_epsilon`` (Opacus' RDP accountant, add/remove-one
example) composes it over every step of every round a node trains in. The noisy sum is divided by
the *expected* batch, as Opacus does, so the batch's size is never used in the clear.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from crypto import dp_sgd_epsilon, dp_sgd_noise_multiplier


@dataclass(frozen=True)
class ExampleDp:
    """The per-example mechanism of one node's local training."""

    noise_multiplier: float
    """σ: the sum of clipped per-example gradients gets N(0, (σ·C)²) per coordinate."""
    clip_norm: float = 1.0
    """C: each example's gradient (over the trained parameters) is scaled to L2 norm <= C."""
    expected_batch: int = 64
    """Poisson rate q = expected_batch / n (every example joins each step independently)."""

    def __post_init__(self) -> None:
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise_multiplier must be finite and >= 0, not {self.noise_multiplier}")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"clip_norm must be finite and > 0, not {self.clip_norm}")
        if self.expected_batch < 1:
            raise ValueError(f"expected_batch must be >= 1, not {self.expected_batch}")

    def sample_rate(self, num_examples: int) -> float:
        """q of a node holding ``num_examples`` records (1 when the batch exceeds them)."""
        if num_examples < 1:
            raise ValueError("DP-SGD needs at least one training example")
        return min(1.0, self.expected_batch / num_examples)

    @classmethod
    def for_target(cls, epsilon: float, delta: float, num_examples: int, steps: int,
                   clip_norm: float = 1.0, expected_batch: int = 64) -> ExampleDp:
        """The smallest σ that keeps ``steps`` steps within (ε, δ) (Opacus'
        ``make_private_with_epsilon`` search, the same accountant)."""
        q = cls(0.0, clip_norm, expected_batch).sample_rate(num_examples)
        sigma = dp_sgd_noise_multiplier(epsilon, delta, q, max(1, steps))
        return cls(sigma, clip_norm, expected_batch)

    def epsilon(self, num_examples: int, steps: int, delta: float) -> float:
        """ε after ``steps`` steps at this σ and q (add/remove one example)."""
        return dp_sgd_epsilon(self.noise_multiplier, self.sample_rate(num_examples), steps, delta)


def poisson_batch(num_examples: int, rate: float, generator: torch.Generator) -> list[int]:
    """Indices of one Poisson batch: each example independently with probability ``rate``."""
    return torch.nonzero(torch.rand(num_examples, generator=generator) < rate).flatten().tolist()


def _clipped_sum(params: Sequence[torch.nn.Parameter], example_loss: Callable[[int], torch.Tensor],
                 batch: Sequence[int], clip_norm: float) -> tuple[list[torch.Tensor], float]:
    """Σ over ``batch`` of each example's gradient scaled to norm <= C; the summed loss."""
    total = [torch.zeros_like(p) for p in params]
    loss_sum = 0.0
    for i in batch:
        loss = example_loss(i)
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.detach().pow(2).sum() for g in grads))
        scale = min(1.0, clip_norm / (float(norm) + 1e-12))
        for acc, g in zip(total, grads):
            acc.add_(g.detach(), alpha=scale)
        loss_sum += float(loss.detach())
    return total, loss_sum


def private_step(params: Sequence[torch.nn.Parameter], example_loss: Callable[[int], torch.Tensor],
                 num_examples: int, dp: ExampleDp, generator: torch.Generator) -> tuple[float, int]:
    """Set every parameter's ``.grad`` to one DP-SGD step's noisy mean gradient (clipped
    per-example sum + N(0, (σC)²), over the expected batch); the optimizer steps afterwards.
    ``example_loss(i)`` is example i's differentiable loss. Returns (mean loss of the batch,
    its size) -- private values: the node keeps them to itself under DP."""
    batch = poisson_batch(num_examples, dp.sample_rate(num_examples), generator)
    total, loss_sum = _clipped_sum(params, example_loss, batch, dp.clip_norm)
    for p, acc in zip(params, total):
        noise = torch.normal(0.0, dp.noise_multiplier * dp.clip_norm, size=acc.shape,
                             generator=generator, dtype=acc.dtype)
        p.grad = (acc + noise) / dp.expected_batch
    return (loss_sum / len(batch) if batch else float("nan")), len(batch)


def private_train(params: Sequence[torch.nn.Parameter], example_loss: Callable[[int], torch.Tensor],
                  num_examples: int, steps: int, dp: ExampleDp, optimizer: torch.optim.Optimizer,
                  generator: torch.Generator) -> list[float]:
    """``steps`` DP-SGD steps with ``optimizer`` (post-processing: any optimizer keeps the
    guarantee); the batch losses of the steps that drew a non-empty batch."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss, size = private_step(params, example_loss, num_examples, dp, generator)
        optimizer.step()
        if size:
            losses.append(loss)
    return losses
