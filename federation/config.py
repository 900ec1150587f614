"""Run configuration: the ``[tool.flwr.app.config]`` keys, typed and checked once.

Every key can be overridden per run: ``flwr run . --run-config "he=false num-server-rounds=5"``.
Unknown keys are ignored (so other apps' keys can share a pyproject); bad values
stop the run before any round starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

DP_MODES = ("none", "local", "distributed", "flower-central")
TASKS = ("digits", "lm")
KV_DTYPES = ("fp32", "fp16", "int8", "int4")
PACKINGS = ("packed", "none")
CKKS_PRESETS = ("fedkv-4096", "fedkv-8192", "nvflare-default")
"""Names of crypto.PRESETS (kept literal so the config does not import tenseal)."""


@dataclass(frozen=True)
class RunConfig:
    """Defaults here equal the pyproject defaults (``[tool.flwr.app.config]`` in pyproject.toml)."""

    num_server_rounds: int = 5
    task: str = "lm"
    """digits | lm (lm is provided by the node package's CacheNode)."""
    he: bool = True
    """CKKS aggregation (crypto/). false = plaintext codec, same messages, same signatures."""
    packing: str = "packed"
    """packed (quantised, several values per CKKS slot part) | none (one CKKS real per part).
    Only used when he=true."""
    packing_bits: int = 8
    """Quantisation bits per value in packing=packed."""
    packing_range: float = 0.0
    """Public saturation range R of the CKKS encoding; 0 = derived from the run config
    (``federation.codec.packing_for``)."""
    max_clients: int = 32
    """Most clients sampled per round with he=true (packing headroom). Larger populations
    are sampled down to this."""
    max_weight: float = 1000.0
    """dp-mode=none: public bound on a client's FedAvg weight (its example count); a node
    with more examples counts as max-weight. Keep it close to the largest partition: the
    CKKS encoding pre-scales updates by weight/max-weight. Unused under DP (equal weights)."""
    ckks_preset: str = "fedkv-4096"
    """CKKS parameter set (crypto.PRESETS) the dealer uses."""
    dp_mode: str = "distributed"
    """none | local | distributed | flower-central (Flower's client-side fixed clipping)."""
    dp_sgd: bool = False
    """Opacus per-sample DP-SGD in local training (independent of dp-mode)."""
    noise_multiplier: float = 0.02
    clip_norm: float = 1.0
    """L2 bound on one update. Applied under DP, and under HE in every dp-mode (the
    CKKS encoding needs a bounded range)."""
    target_delta: float = 1e-5
    fraction_train: float = 1.0
    """Share of connected nodes sampled for training each round (at least min-clients)."""
    local_epochs: int = 2
    lr: float = 0.0
    """Local learning rate; 0 = the task's default (digits 0.3 with SGD, lm 3e-3 with AdamW)."""
    kv_dtype: str = "fp32"
    """KV-cache block dtype for the lm task (passed to the node; unused by digits)."""
    results_dir: str = "results"
    """Where the run's JSON goes; relative paths resolve against the ServerApp's cwd."""
    min_clients: int = 2
    """A round with fewer usable updates than this stops the run."""
    seed: int = 42
    alpha: float = 1.0
    """Dirichlet concentration of the non-IID split."""
    round_timeout: float = 120.0
    """Seconds the server waits for replies per phase (late clients are left out),
    and for min-clients nodes to be connected before a round."""

    def __post_init__(self) -> None:
        problems = []
        if self.num_server_rounds < 1:
            problems.append("num-server-rounds must be >= 1")
        if self.task not in TASKS:
            problems.append(f"task must be one of {TASKS}")
        if self.dp_mode not in DP_MODES:
            problems.append(f"dp-mode must be one of {DP_MODES}")
        if self.kv_dtype not in KV_DTYPES:
            problems.append(f"kv-dtype must be one of {KV_DTYPES}")
        if not 0.0 < self.fraction_train <= 1.0:
            problems.append("fraction-train must be in (0, 1]")
        if self.min_clients < 1:
            problems.append("min-clients must be >= 1")
        if self.packing not in PACKINGS:
            problems.append(f"packing must be one of {PACKINGS}")
        if not 1 <= self.packing_bits <= 24:
            problems.append("packing-bits must be in [1, 24]")
        if not (self.packing_range >= 0 and math.isfinite(self.packing_range)):
            problems.append("packing-range must be >= 0 (0 = derived)")
        if self.max_clients < max(self.min_clients, 1):
            problems.append("max-clients must be >= min-clients")
        if not (self.max_weight > 0 and math.isfinite(self.max_weight)):
            problems.append("max-weight must be > 0")
        if self.ckks_preset not in CKKS_PRESETS:
            problems.append(f"ckks-preset must be one of {CKKS_PRESETS}")
        if self.dp_mode != "none" and self.clip_norm <= 0:
            problems.append("clip-norm must be > 0 when dp-mode is not none")
        if self.he and self.clip_norm <= 0:
            problems.append("clip-norm must be > 0 when he=true (updates are clipped to bound the CKKS encoding range)")
        if self.noise_multiplier < 0:
            problems.append("noise-multiplier must be >= 0")
        if not 0.0 < self.target_delta < 1.0:
            problems.append("target-delta must be in (0, 1)")
        if self.dp_mode == "flower-central" and self.he:
            problems.append("dp-mode=flower-central uses Flower's plaintext arrays; set he=false")
        if self.lr < 0:
            problems.append("lr must be >= 0 (0 = the task's default)")
        if problems:
            raise ValueError("bad run config: " + "; ".join(problems))

    @staticmethod
    def from_run_config(run_config: Mapping[str, Any]) -> RunConfig:
        """Build from ``context.run_config`` (dash-separated keys), coercing types."""
        kwargs: dict[str, Any] = {}
        for f in fields(RunConfig):
            key = f.name.replace("_", "-")
            if key not in run_config:
                continue
            kwargs[f.name] = _coerce(run_config[key], type(getattr(RunConfig, f.name)), key)
        return RunConfig(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        """Dash-separated keys, as they appear in pyproject (for results files)."""
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}


def _coerce(value: Any, typ: type, key: str) -> Any:
    try:
        if typ is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                return value.lower() in ("true", "1")
            return bool(value)
        return typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"bad run config: {key}={value!r} is not a {typ.__name__}") from None
