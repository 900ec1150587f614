"""A federated node for the ``digits`` task: model + data + local training + write-back.

This is the seam the future ``CacheNode`` fills: the federation layer only calls
``FederatedNode`` methods (``train_round``, ``apply_mean_update``, ``evaluate``,
``to_state``/``from_state``) and never touches torch modules itself. When the cache
lands, ``apply_mean_update`` becomes ``cache.put_tensor("param/...", t, version)``
+ ``cache.bump_version()``, and ``train_round`` stores the update under ``grad/...``.

Updates travel as one flat float32 vector (``Layout`` says how to cut it back into
tensors). What is aggregated is the *update* Δ = local - global, not the weights:
clipping and DP noise are defined on Δ, and Δ has a small range (good for CKKS
packing/quantisation later).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from node import digits


@dataclass(frozen=True)
class Layout:
    """Names and shapes of the parameters in a flat update vector, in order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes))

    @staticmethod
    def of(model: nn.Module) -> Layout:
        sd = model.state_dict()
        return Layout(tuple(sd), tuple(tuple(t.shape) for t in sd.values()))


def flatten(model: nn.Module) -> np.ndarray:
    """All parameters (state_dict order) as one float32 vector (a copy)."""
    return np.concatenate(
        [t.detach().cpu().numpy().ravel().astype(np.float32) for t in model.state_dict().values()]
    )


def unflatten(vec: np.ndarray, layout: Layout) -> dict[str, torch.Tensor]:
    """Inverse of ``flatten``; raises on a size mismatch instead of silently truncating."""
    if vec.ndim != 1 or vec.size != layout.size:
        raise ValueError(f"vector of shape {vec.shape} does not fit layout of size {layout.size}")
    out, off = {}, 0
    for name, shape in zip(layout.names, layout.shapes):
        n = math.prod(shape)
        out[name] = torch.from_numpy(vec[off : off + n].reshape(shape).copy())
        off += n
    return out


def build_model(task: str, seed: int, hidden: int = 64) -> nn.Module:
    """The task's model with the run's seeded init (public: the server may build it)."""
    if task != "digits":
        raise NotImplementedError(f"task {task!r} is not available yet (only digits)")
    return digits.make_model(seed, hidden)


@dataclass(frozen=True)
class DpConfig:
    """Update-level privacy done on the node before encoding.

    Stand-in until ``crypto`` provides clip/noise: same maths, same place in the flow.
    """

    mode: str = "none"
    """none | local | distributed | flower-central (the last is done by Flower's mod)."""
    clip_norm: float = 0.0
    """L2 bound on Δ; 0 disables clipping (only allowed with mode none)."""
    noise_multiplier: float = 0.0
    """σ: the noise on the *sum* of updates has std σ·clip_norm."""
    num_sampled: int = 1
    """Clients sampled this round; distributed mode gives each σ·C/√n."""
    dp_sgd: bool = False
    """Per-sample DP-SGD with Opacus during local training."""
    target_delta: float = 1e-5


@dataclass
class TrainOutcome:
    """What one local round produced (Δ is already clipped/noised per ``DpConfig``)."""

    delta: np.ndarray
    loss: float
    num_examples: int
    clipped: bool
    delta_norm: float
    train_s: float
    epsilon: float = float("nan")


def clip_update(delta: np.ndarray, clip_norm: float) -> tuple[np.ndarray, bool, float]:
    """Scale Δ to L2 norm <= clip_norm. Returns (Δ', was_clipped, original_norm)."""
    norm = float(np.linalg.norm(delta))
    if clip_norm <= 0 or norm <= clip_norm:
        return delta, False, norm
    return (delta * (clip_norm / norm)).astype(np.float32), True, norm


def noise_std(dp: DpConfig) -> float:
    """Per-client Gaussian std for the configured mode (0 when no noise is added here)."""
    if dp.mode == "local":
        return dp.noise_multiplier * dp.clip_norm
    if dp.mode == "distributed":
        return dp.noise_multiplier * dp.clip_norm / math.sqrt(max(dp.num_sampled, 1))
    return 0.0


@dataclass
class NodeSpec:
    """Everything needed to (re)build a node; equal specs give interchangeable nodes."""

    partition_id: int
    num_partitions: int
    task: str = "digits"
    seed: int = 42
    alpha: float = 1.0
    hidden: int = 64


@dataclass
class FederatedNode:
    """One client's model, data and privacy bookkeeping; lives across rounds."""

    spec: NodeSpec
    model: nn.Module = field(init=False)
    layout: Layout = field(init=False)
    version: int = 0
    """Number of global aggregates applied so far (0 = the seeded initial model)."""
    dp_steps: int = 0
    """Opacus optimizer steps taken so far (for the ε accountant)."""
    dp_sample_rate: float = 0.0
    dp_sigma: float = 0.0

    def __post_init__(self) -> None:
        self.model = build_model(self.spec.task, self.spec.seed, self.spec.hidden)
        self.data_cfg = digits.DigitsConfig(
            num_partitions=self.spec.num_partitions, alpha=self.spec.alpha, seed=self.spec.seed
        )
        self.layout = Layout.of(self.model)
        self.train_loader, self.test_loader = digits.load_partition(
            self.spec.partition_id, self.data_cfg
        )

    # -- write-back --------------------------------------------------------------
    def apply_mean_update(self, mean_delta: np.ndarray, version: int) -> None:
        """Global ← global + mean Δ; ``version`` must be exactly the next one."""
        if version != self.version + 1:
            raise ValueError(f"aggregate v{version} does not follow node's v{self.version}")
        if not np.all(np.isfinite(mean_delta)):
            raise ValueError("aggregate contains NaN/Inf; refusing to write it back")
        new = flatten(self.model) + mean_delta.astype(np.float32)
        self.model.load_state_dict(unflatten(new, self.layout))
        self.version = version

    # -- local training ------------------------------------------------------------
    def train_round(self, epochs: int, lr: float, dp: DpConfig, rng: np.random.Generator) -> TrainOutcome:
        """Train from the current global model; return Δ (clipped + noised) and stats.

        The node's model is reset to the global weights afterwards: the node only
        moves when an aggregate is written back, so all nodes stay in lock-step.
        """
        start = flatten(self.model)
        # Same shuffle whether this object was reused or rebuilt from context.state
        # (in simulation a node hops between Ray actors), so runs are reproducible.
        gen = self.train_loader.generator
        if gen is not None:
            gen.manual_seed(self.spec.seed * 1_000_003 + self.spec.partition_id * 1009 + self.version)
        t0 = time.perf_counter()
        eps = float("nan")
        if dp.dp_sgd:
            loss, n, eps = self._train_dp_sgd(epochs, lr, dp)
        else:
            loss, n = digits.train(self.model, self.train_loader, epochs, lr)
        train_s = time.perf_counter() - t0
        delta = flatten(self.model) - start
        self.model.load_state_dict(unflatten(start, self.layout))
        clipped, norm = False, float(np.linalg.norm(delta))
        if dp.mode in ("local", "distributed"):
            delta, clipped, norm = clip_update(delta, dp.clip_norm)
            std = noise_std(dp)
            if std > 0:
                delta = (delta + rng.normal(0.0, std, size=delta.shape)).astype(np.float32)
        if not np.all(np.isfinite(delta)):
            raise FloatingPointError("local update has NaN/Inf (diverged?); not sending it")
        return TrainOutcome(delta.astype(np.float32), loss, n, clipped, norm, train_s, eps)

    def _train_dp_sgd(self, epochs: int, lr: float, dp: DpConfig) -> tuple[float, int, float]:
        """Per-sample DP-SGD with Opacus on a private copy; ε from all steps so far (RDP)."""
        import copy

        from opacus import PrivacyEngine
        from opacus.accountants import RDPAccountant

        work = copy.deepcopy(self.model)
        work.train()  # the node may have just evaluated (eval mode); Opacus needs train mode
        opt = torch.optim.SGD(work.parameters(), lr=lr)
        engine = PrivacyEngine(accountant="rdp")
        pmodel, popt, ploader = engine.make_private(
            module=work,
            optimizer=opt,
            data_loader=self.train_loader,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.clip_norm if dp.clip_norm > 0 else 1.0,
        )
        loss_fn = nn.CrossEntropyLoss()
        pmodel.train()
        total, seen, steps = 0.0, 0, 0
        for _ in range(epochs):
            for x, y in ploader:
                if len(y) == 0:  # Poisson sampling can draw an empty batch
                    continue
                popt.zero_grad()
                loss = loss_fn(pmodel(x), y)
                loss.backward()
                popt.step()
                total += loss.item() * len(y)
                seen += len(y)
                steps += 1
        self.model.load_state_dict(pmodel._module.state_dict())
        self.dp_steps += len(ploader) * epochs  # accountant counts expected steps
        self.dp_sample_rate = 1.0 / len(ploader)
        self.dp_sigma = dp.noise_multiplier
        acct = RDPAccountant()
        acct.history = [(self.dp_sigma, self.dp_sample_rate, self.dp_steps)]
        eps = acct.get_epsilon(dp.target_delta)
        return (total / seen if seen else float("nan")), len(self.train_loader.dataset), eps

    # -- Flower's array protocol (baselines such as flower-central DP) ----------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def set_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def train_in_place(self, epochs: int, lr: float) -> tuple[float, int, float]:
        """Train the current weights in place: (loss, n, seconds). Flower sends weights."""
        t0 = time.perf_counter()
        loss, n = digits.train(self.model, self.train_loader, epochs, lr)
        return loss, n, time.perf_counter() - t0

    # -- evaluation ----------------------------------------------------------------
    def evaluate(self) -> tuple[float, float, int]:
        """(loss, accuracy, n) of the current global model on the local held-out share."""
        loss, acc = digits.evaluate(self.model, self.test_loader)
        return loss, acc, len(self.test_loader.dataset)

    # -- persistence (context.state) -------------------------------------------------
    def to_state(self) -> tuple[np.ndarray, dict[str, int | float]]:
        """(flat params, scalars) — enough to rebuild this node in a fresh process."""
        scalars = {
            "version": self.version,
            "dp_steps": self.dp_steps,
            "dp_sample_rate": self.dp_sample_rate,
            "dp_sigma": self.dp_sigma,
        }
        return flatten(self.model), scalars

    def load_state(self, params: np.ndarray, scalars: dict[str, int | float]) -> None:
        self.model.load_state_dict(unflatten(np.asarray(params, dtype=np.float32), self.layout))
        self.version = int(scalars["version"])
        self.dp_steps = int(scalars.get("dp_steps", 0))
        self.dp_sample_rate = float(scalars.get("dp_sample_rate", 0.0))
        self.dp_sigma = float(scalars.get("dp_sigma", 0.0))
