"""CacheNode: one federated client that is also a KV-cache node.

The node's KV-cache engine holds its parameters (``param/<name>``) and its latest update
(``grad/update``) next to the K/V of its generation sessions. One round::

    params <- cache "param/"   train locally (SGD, or Opacus DP-SGD)   delta -> cache "grad/"
    the raw delta -> federation.contribution.make_contribution: clip -> noise share -> ... -> sign
    aggregate -> decrypt -> params + mean delta -> cache "param/" at version + 1
              -> cache.set_version(): K/V computed under the old weights is never served again

Between rounds the node serves chat sessions (``lm`` task) through the cache:
``create_session`` / ``send`` / ``reset_conversation`` / ``close`` (``node.engine.sessions`` documents
the byte framing and the errors). Sessions keep their K/V across turns until a write-back makes it
stale, then they are recomputed from their tokens.
"""

from __future__ import annotations

import copy
import functools
import os
import secrets
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cache import CacheConfig, KVCache
from crypto import Layout, dp_sgd_epsilon, dp_sgd_noise_multiplier
from node.tasks import digits
from node import serve_gate
from node.serving import param_channel
from node.serving.param_channel import exclusive_params
from node.tasks.dp_sgd import ExampleDp
from node.serve_gate import GateScores, GateVerdict
from node.workload_pass import ServeReport, serve_workload
from node.engine.sessions import Sessions
from node.tasks.workload import WorkloadConfig, find_trace, plan_turns
from node.models.interface import CachedLM
from node.tasks.tasks import (Task, build_model, federated_state, load_parameters, make_task,
                        parameter_layout)

UPDATE_KEY = "grad/update"


@dataclass(frozen=True)
class NodeSpec:
    """Everything needed to (re)build a node; equal specs give interchangeable nodes."""

    partition_id: int
    num_partitions: int
    task: str = "lm"
    seed: int = 42
    alpha: float = 1.0
    """Dirichlet concentration of the digits split (lower = more non-IID)."""
    kv_dtype: str = "fp32"
    """Storage of KV blocks that left the full-precision window (lm task)."""
    kv_pool_bytes: int = 8 << 20
    kv_stale_versions: int = 0
    """K/V of up to this many older model versions stay servable after a write-back
    (run-config ``kv-stale-policy``: ``invalidate`` = 0, ``keep-<k>`` = k)."""


def os_entropy_torch_generator() -> torch.Generator:
    """A torch generator seeded with 63 bits from ``secrets`` (os.urandom): DP-SGD's noise and
    sampling must not be derivable from the run's public seed (``crypto.dp.privacy.gaussian_noise``)."""
    return torch.Generator().manual_seed(secrets.randbits(63))


@dataclass(frozen=True)
class DpConfig:
    """Example-level privacy inside local training: per-example DP-SGD (digits: Opacus; lm and
    chat: ``node.tasks.dp_sgd``). The update-level mechanism (clip, noise share) is not the node's:
    ``federation.contribution.make_contribution``."""

    clip_norm: float = 0.0
    """The client-level bound of the node's update (the federation's; not used by DP-SGD)."""
    noise_multiplier: float = 0.0
    """σ of DP-SGD when ``target_epsilon`` is 0."""
    dp_sgd: bool = False
    """Per-example DP-SGD during local training."""
    target_delta: float = 1e-5
    target_epsilon: float = 0.0
    """σ is the smallest that keeps ``planned_rounds`` rounds of steps within
    (target_epsilon, target_delta) (Opacus' make_private_with_epsilon); 0: ``noise_multiplier``."""
    planned_rounds: int = 1
    """Rounds the node may train in (the run's rounds): the budget ``target_epsilon`` spans."""
    expected_batch: int = 0
    """lm/chat: the Poisson batch's expected size (q = expected_batch / examples); 0: the
    task's ``dp_batch``."""
    example_clip: float = 1.0
    """The per-example bound C of DP-SGD (``clip_norm`` is the bound of the node's whole update)."""


@dataclass
class TrainOutcome:
    """What one local round produced: the raw update (new minus global parameters, float64 as
    computed, neither clipped nor noised: ``make_contribution`` applies the mechanism) and its
    stats."""

    delta: np.ndarray
    loss: float
    num_examples: int
    delta_norm: float
    """The update's L2 norm."""
    train_s: float
    epsilon: float = float("nan")


SERVE_PROMPT = b"You are a fedkv cache node. Answer in one short line. "
"""The system prompt of the chat turn a node serves between rounds (3 full blocks)."""


def model_layout(task: str, seed: int = 0) -> Layout:
    """Names and shapes of the task's parameters: what the server needs to size aggregates."""
    return parameter_layout(build_model(task, seed))


def _kv_config(spec: NodeSpec, model: torch.nn.Module) -> CacheConfig:
    if isinstance(model, CachedLM):
        # a warm tier as big as the hot pool: evicted prefix blocks stay a hit; the best
        # policy (experiments.eviction) and prefetcher (experiments.prefetch) on Mooncake
        return model.cache_config(kv_dtype=spec.kv_dtype, pool_bytes=spec.kv_pool_bytes,
                                  warm_bytes=spec.kv_pool_bytes, eviction_policy="adaptive",
                                  prefetch_mode="sequential")
    # digits has no attention; the engine still holds its parameters and updates
    return CacheConfig(num_layers=1, num_heads=1, head_dim=16, pool_bytes=2 << 20)


class CacheNode:
    def __init__(self, spec: NodeSpec, task: Task | None = None, *,
                 cache_dir: str | os.PathLike | None = None, cache_key: bytes | None = None):
        """With ``cache_dir`` the node's cache (K/V blocks, ``param/``, ``grad/`` and the
        model version) persists there between processes, encrypted with ``cache_key``; a
        node built on a directory that holds parameters starts from them."""
        self.spec = spec
        self.task = task or make_task(
            spec.task, spec.partition_id, spec.num_partitions, spec.seed, spec.alpha
        )
        self.model = self.task.build_model(spec.seed)
        cfg = _kv_config(spec, self.model)
        self.cache_dir, self._cache_key = cache_dir, cache_key
        self.agents_invalidated = 0
        """Serving agents this node's write-backs invalidated (coherence directory)."""
        self.cache = KVCache.open(cache_dir, cfg, key=cache_key) if cache_dir else KVCache(cfg)
        self.cache.keep_stale_versions(spec.kv_stale_versions)
        self.layout = parameter_layout(self.model)
        if not self._load_cached_params():
            self._write_params(federated_state(self.model, self.layout), version=0)
        self.dp_steps = 0
        self.dp_sample_rate = 0.0
        self.dp_sigma = 0.0
        self.served: tuple[int, GateScores] | None = None
        """(version, scores) of what the node's serving agents serve (``node.serve_gate``);
        None until the first gated write-back, which takes the version the node is at."""
        self.last_gate: tuple[int, GateVerdict] | None = None
        """The gate's verdict on the last aggregate applied, with its version."""

    @functools.cached_property
    def sessions(self) -> Sessions:
        """Open chat sessions as ``{session id: cache session id}``; closing removes one. Made
        on first use: a node that only trains (digits) never holds a session table."""
        return Sessions(self.model, self.cache)

    # -- parameters live in the cache ------------------------------------------------
    @property
    def version(self) -> int:
        """Global aggregates applied so far (0 = the seeded initial model): the cache's one
        model-version counter, which the stored parameters are tagged with. On Flower's array
        path (the flower-central baseline) ``set_weights`` and ``train_in_place`` move it too:
        every change of the model's weights does, so no K/V of other weights is served."""
        return self.cache.version

    def _write_params(self, state: dict[str, torch.Tensor], version: int, publish: bool = True) -> None:
        """Parameters at ``version`` into the cache and the model; K/V computed under any
        older version than the policy keeps are never served again (also after a restore).
        With ``publish`` the node's serving agents are invalidated first (``node.serving.param_channel``)
        and read the parameters published beside the cache afterwards; without, they keep
        serving what they have (an aggregate the gate kept unserved)."""
        with exclusive_params(self.cache_dir if publish else None) as invalidated:
            for name in self.layout.names:
                self.cache.put_tensor(f"param/{name}", state[name], version=version)
            load_parameters(self.model, state, self.layout)
            self.cache.set_version(version)
            if self.cache_dir and publish:
                param_channel.publish(self.cache_dir, self._cache_key, self.params(), version)
        self.agents_invalidated += invalidated

    def _publish(self) -> None:
        """Publish the parameters the node holds to its serving agents (``node.serving.param_channel``)."""
        with exclusive_params(self.cache_dir) as invalidated:
            if self.cache_dir:
                param_channel.publish(self.cache_dir, self._cache_key, self.params(), self.version)
        self.agents_invalidated += invalidated

    def _load_cached_params(self) -> bool:
        """Start from the parameters the cache holds (a warm start); False if it has none."""
        names = [f"param/{n}" for n in self.layout.names]
        if not all(n in self.cache.tensors.names("param") for n in names):
            return False
        state = {n: self.cache.get_tensor(f"param/{n}") for n in self.layout.names}
        if any(self.cache.tensor_version(f"param/{n}") != self.cache.version
               for n in self.layout.names):
            return False
        load_parameters(self.model, state, self.layout)
        return True

    def persist(self) -> None:
        """Commit the cache to its directory and release it (no-op without one): what the
        next process -- or the next message in this one, after ``reattach`` -- sees. The
        ``param/`` tensors and the model version go in one atomic commit; a failure raises and
        leaves the previous commit (the node's parameters have no other copy to fall back on)."""
        if self.cache_dir:
            self.reattach()
            self.cache.close(strict=True)

    def release(self) -> None:
        """Release the cache directory without flushing (end of a message, or a failure)."""
        self.cache.release()

    def reattach(self) -> None:
        """Re-open the cache directory after ``persist`` (a process reusing this node)."""
        if self.cache_dir:
            self.cache.attach(self.cache_dir, key=self._cache_key)

    @property
    def kv_blocks_on_disk(self) -> int:
        """K/V blocks this node's cache found in its directory when it was opened."""
        return self.cache.found_on_disk

    def params(self) -> dict[str, torch.Tensor]:
        return {n: self.cache.get_tensor(f"param/{n}") for n in self.layout.names}

    def flat_params(self) -> np.ndarray:
        return self.layout.flatten(self.params()).astype(np.float32)

    # -- write-back ---------------------------------------------------------------
    def apply_mean_update(self, mean_delta: np.ndarray, version: int,
                          gate_tolerance: float | None = None) -> GateVerdict | None:
        """params <- params + mean delta at ``version`` (exactly the next one); stale K/V
        becomes unreachable. With ``gate_tolerance`` the new parameters pass the gate before
        serving (``node.serve_gate``): served (published) only when they are not markedly worse
        than the served ones; otherwise the node trains on from them and its serving agents keep
        the served version. Returns the gate's verdict (None without a gate)."""
        if version != self.version + 1:
            raise ValueError(f"aggregate v{version} does not follow node's v{self.version}")
        mean_delta = np.asarray(mean_delta)
        if mean_delta.shape != (self.layout.size,):
            raise ValueError(
                f"aggregate has shape {mean_delta.shape}, the model has {self.layout.size} values"
            )
        if not np.all(np.isfinite(mean_delta)):
            raise ValueError("aggregate contains NaN/Inf; refusing to write it back")
        new = self.layout.unflatten((self.flat_params().astype(np.float64) + mean_delta).astype(np.float32),
                                    as_torch=True)
        if gate_tolerance is None:
            self._write_params(new, version)
            return None
        before = self._served_scores()
        self._write_params(new, version, publish=False)
        verdict = serve_gate.judge(before, serve_gate.scores(self.task, self.model), gate_tolerance)
        if verdict.served:
            self._publish()
            self.served = (version, verdict.after)
        self.last_gate = (version, verdict)
        return verdict

    def _served_scores(self) -> GateScores:
        """The gate's baseline: the scores of the served version (the model the node is at when
        it has not gated yet: a fresh node serves what it holds)."""
        if self.served is None:
            self.served = (self.version, serve_gate.scores(self.task, self.model))
        return self.served[1]

    # -- local training ------------------------------------------------------------
    def train_round(self, epochs: int, lr: float, dp: DpConfig = DpConfig()) -> TrainOutcome:
        """Train from the global parameters (with ``dp.dp_sgd``: Opacus DP-SGD); return the raw
        update, also kept in the cache as ``grad/update``, and stats. The model goes back to the
        global parameters: only a write-back moves the node. ``lr <= 0`` means the task's
        default learning rate."""
        lr = lr if lr > 0 else self.task.default_lr
        start = self.params()
        load_parameters(self.model, start, self.layout)
        # the same shuffle whether this object was reused or rebuilt from context.state
        seed = self.spec.seed * 1_000_003 + self.spec.partition_id * 1009 + self.version
        t0 = time.perf_counter()
        eps = float("nan")
        if dp.dp_sgd:
            loss, n, eps = self._train_dp_sgd(epochs, lr, dp)
        else:
            loss, n = self.task.train(self.model, epochs, lr, seed)
        train_s = time.perf_counter() - t0
        after = self.layout.flatten(federated_state(self.model, self.layout))
        delta = after - self.layout.flatten(start)
        load_parameters(self.model, start, self.layout)
        if not np.all(np.isfinite(delta)):
            raise FloatingPointError("local update has NaN/Inf (diverged?); not sending it")
        self.cache.put_tensor(UPDATE_KEY, torch.from_numpy(delta.astype(np.float32)), self.version)
        return TrainOutcome(delta, loss, n, float(np.linalg.norm(delta)), train_s, eps)

    def _train_dp_sgd(self, epochs: int, lr: float, dp: DpConfig) -> tuple[float, int, float]:
        """Per-example DP-SGD: Opacus on a copy (digits), ``node.tasks.dp_sgd`` for the language
        tasks; ε from all steps so far (RDP)."""
        from opacus import PrivacyEngine

        if self.task.train_loader is None:
            return self._train_example_dp(epochs, lr, dp)
        work = copy.deepcopy(self.model).train()
        opt = torch.optim.SGD(work.parameters(), lr=lr)
        # without a generator, Opacus would draw its noise from torch's global generator and its
        # Poisson batches from the loader's (seeded with the public seed + partition): both
        # come from `fresh` (make_private's noise_generator; DPDataLoader takes the loader's)
        fresh = os_entropy_torch_generator()
        with warnings.catch_warnings():
            # its "Secure RNG turned off" is about torch's global RNG: noise and batches use `fresh`
            warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
            engine = PrivacyEngine(accountant="rdp")
        loader = torch.utils.data.DataLoader(self.task.train_loader.dataset, shuffle=True, generator=fresh,
                                             batch_size=self.task.train_loader.batch_size)
        pmodel, popt, ploader = engine.make_private(
            module=work,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=self._digits_sigma(dp, len(loader), epochs),
            max_grad_norm=dp.example_clip,
            noise_generator=fresh,
        )
        loss = digits.run_epochs(pmodel, ploader, popt, epochs)
        self.model.load_state_dict(pmodel._module.state_dict())
        self.dp_steps += len(ploader) * epochs  # the accountant counts expected steps
        self.dp_sample_rate = 1.0 / len(ploader)
        self.dp_sigma = self._digits_sigma(dp, len(loader), epochs)
        eps = dp_sgd_epsilon(self.dp_sigma, self.dp_sample_rate, self.dp_steps, dp.target_delta)
        return loss, self.task.num_examples, eps

    @staticmethod
    def _digits_sigma(dp: DpConfig, batches: int, epochs: int) -> float:
        """Opacus' σ: sized for ``target_epsilon`` over the planned rounds (its Poisson loader
        samples at q = 1 / batches), else ``noise_multiplier``."""
        if dp.target_epsilon <= 0:
            return dp.noise_multiplier
        return dp_sgd_noise_multiplier(dp.target_epsilon, dp.target_delta, 1.0 / batches,
                                       batches * epochs * dp.planned_rounds)

    def _train_example_dp(self, epochs: int, lr: float, dp: DpConfig) -> tuple[float, int, float]:
        """Example-level DP-SGD of the language tasks (``node.tasks.dp_sgd``); ε over every step this
        node has taken (σ and q are fixed for a run: one self-composed sampled Gaussian)."""
        n, steps = self.task.num_examples, self.task.private_steps(epochs)
        batch = dp.expected_batch or self.task.dp_batch
        mech = (ExampleDp.for_target(dp.target_epsilon, dp.target_delta, n, steps * dp.planned_rounds,
                                     dp.example_clip, batch)
                if dp.target_epsilon > 0 else ExampleDp(dp.noise_multiplier, dp.example_clip, batch))
        loss = self.task.train_private(self.model, epochs, lr, mech, os_entropy_torch_generator())
        self.dp_steps += steps
        self.dp_sample_rate, self.dp_sigma = mech.sample_rate(n), mech.noise_multiplier
        return loss, n, mech.epsilon(n, self.dp_steps, dp.target_delta)

    # -- Flower's array protocol (the flower-central baseline) --------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def set_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load Flower's weights into the model (no write-back: ``param/`` stays); the cache
        moves to a new model version, so K/V computed under other weights is never served."""
        self.model.load_state_dict(state)
        self.cache.bump_version()

    def train_in_place(self, epochs: int, lr: float, server_round: int,
                       dp: DpConfig = DpConfig()) -> tuple[float, int, float, float]:
        """Train the current weights in place (with ``dp.dp_sgd``: DP-SGD, as ``train_round``):
        (loss, n, seconds, ε per example or NaN). Flower sends weights; the shuffle is seeded by
        the round. The weights changed, so the cache's version moves: K/V computed under the
        old ones is not served again."""
        t0 = time.perf_counter()
        lr = lr if lr > 0 else self.task.default_lr
        seed = self.spec.seed * 1_000_003 + self.spec.partition_id * 1009 + server_round
        eps = float("nan")
        if dp.dp_sgd:
            loss, n, eps = self._train_dp_sgd(epochs, lr, dp)
        else:
            loss, n = self.task.train(self.model, epochs, lr, seed)
        self.cache.bump_version()
        return loss, n, time.perf_counter() - t0, eps

    # -- evaluation and serving ---------------------------------------------------------
    def evaluate(self) -> tuple[float, float, int]:
        """(loss, metric, n) of the current global model on the local held-out data."""
        return self.task.evaluate(self.model)

    def serve_between_rounds(self, workload: WorkloadConfig = WorkloadConfig(),
                             seed: int = 0) -> ServeReport | None:
        """Serve a workload of chat sessions through the cache behind ``SERVE_PROMPT`` (lm
        task; None for digits): texts from the node's held-out share, shaped by the
        Mooncake trace when this machine has one. The prompt's blocks stay cached (and
        persisted) for the next pass or process."""
        if self.task.name != "lm" or workload.sessions == 0:
            return None
        self._serve_lm()
        trace = find_trace()
        turns = plan_turns(workload, self.task.heldout, seed, trace)
        report = serve_workload(self.sessions, SERVE_PROMPT, turns)
        report.shape = "mooncake" if trace else "synthetic"
        return report

    # -- chat sessions (lm task); the framing is documented in node.engine.sessions ---------------
    def create_session(self, system_prompt: str | bytes = b"") -> str:
        """A new session id; the system prompt is encoded into the cache once, and its full
        blocks are shared with every session that starts with the same prompt."""
        self._serve_lm()
        return self.sessions.create(system_prompt)

    def send(self, session_id: str, text: str | bytes, max_new_tokens: int = 32) -> bytes:
        """Append ``text`` to the session and return the greedy reply (raw bytes), decoded
        through the KV cache; recomputed under the new weights after a write-back."""
        self._serve_lm()
        return self.sessions.send(session_id, text, max_new_tokens)

    def close(self, session_id: str) -> None:
        """Free the session's blocks; the id leaves ``sessions`` and is refused from now on."""
        self.sessions.close(session_id)

    def reset_conversation(self, session_id: str) -> None:
        """Keep the session's system prompt, drop the rest of its conversation."""
        self.sessions.reset_conversation(session_id)

    def history(self, session_id: str) -> bytes:
        """The session's conversation so far: system prompt, texts and replies."""
        return self.sessions.history(session_id)

    def _serve_lm(self) -> None:
        """Sessions need a language model that decodes through the cache
        (``node.models.interface.CachedLM``; a digits node has none), in eval mode whatever
        training left it in."""
        if not isinstance(self.model, CachedLM):
            raise ValueError(f"generation needs the lm task, this node serves {self.task.name!r}")
        self.model.eval()

    # -- state between objects and processes ---------------------------------------------
    def scalars(self) -> dict[str, int | float | list[float]]:
        """The node's public scalars (model version, DP-SGD accounting, the served version and
        its gate scores, computed on public held-out data and probes): what ``context.state``
        keeps; the parameters stay in the cache directory."""
        served = {} if self.served is None else {
            "gate_version": self.served[0], "gate_heldout": self.served[1].heldout,
            "gate_probes": list(self.served[1].probes), "gate_preferences": list(self.served[1].preferences)}
        return {
            "version": self.version,
            "dp_steps": self.dp_steps,
            "dp_sample_rate": self.dp_sample_rate,
            "dp_sigma": self.dp_sigma,
            **served,
        }

    def to_state(self) -> tuple[np.ndarray, dict[str, int | float | list[float]]]:
        """(flat params, scalars): a node without a cache directory copied into another."""
        return self.flat_params(), self.scalars()

    def load_state(self, params: np.ndarray, scalars: dict) -> None:
        version = int(scalars["version"])
        self._write_params(self.layout.unflatten(np.asarray(params, np.float32), as_torch=True),
                           version)
        self.load_scalars(scalars)

    def load_scalars(self, scalars: dict) -> None:
        """The accounting scalars of ``to_state`` (the parameters came from the cache)."""
        self.dp_steps = int(scalars.get("dp_steps", 0))
        self.dp_sample_rate = float(scalars.get("dp_sample_rate", 0.0))
        self.dp_sigma = float(scalars.get("dp_sigma", 0.0))
        if "gate_version" in scalars:
            self.served = (int(scalars["gate_version"]), GateScores(
                float(scalars["gate_heldout"]), tuple(float(p) for p in scalars.get("gate_probes", [])),
                tuple(float(p) for p in scalars.get("gate_preferences", []))))
