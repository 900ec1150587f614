"""Per-run results: one JSON file per run, one record per round, one log line per round.

Schema (``schema`` = 1)::

    {"schema": 1, "status": "completed" | "stopped: <why>", "run_id", "mode",
     "config": {<run config, dash keys>}, "started_at", "finished_at", "wall_s",
     "rounds": [RoundRecord as dict, ...]}

Client phase times are means over the clients that took part (their reply metrics);
``aggregate_s`` is measured on the server.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RoundRecord:
    round: int
    sampled: int = 0
    num_clients: int = 0
    """Clients whose update went into the aggregate."""
    dropped: list[dict[str, Any]] = field(default_factory=list)
    """[{"node": id, "phase": "train"|"evaluate", "reason": str}]"""
    train_loss: float = math.nan
    eval_loss: float = math.nan
    eval_acc: float = math.nan
    eval_clients: int = 0
    upload_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of the encoded update, per node id (str keys for JSON)."""
    upload_bytes_mean: float = math.nan
    aggregate_bytes: int = 0
    """Bytes of the aggregate the server sends back (per copy)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """train, encrypt, decrypt, writeback (client means), aggregate (server),
    train_phase / evaluate_phase (server wall clock for the whole phase)."""
    clipped_fraction: float = math.nan
    epsilon: float = math.nan
    """Largest per-client DP-SGD ε so far (nan without dp-sgd)."""
    node_sources: dict[str, int] = field(default_factory=dict)
    """How nodes were obtained this round: built / restored / reused (see node_host)."""
    pids: list[int] = field(default_factory=list)
    """Distinct ClientApp process ids that replied this round (Ray actors in simulation)."""

    def summary(self, num_rounds: int) -> str:
        s = self.seconds
        return (
            f"round {self.round}/{num_rounds}: {self.num_clients}/{self.sampled} clients"
            f" | train_loss {self.train_loss:.4f} | eval_loss {self.eval_loss:.4f}"
            f" acc {self.eval_acc:.4f} ({self.eval_clients} nodes)"
            f" | up {self.upload_bytes_mean / 1024:.1f} KiB/client"
            f" | s: train {s.get('train', math.nan):.3f} enc {s.get('encrypt', math.nan):.4f}"
            f" agg {s.get('aggregate', math.nan):.4f}"
            f" dec {s.get('decrypt', 0.0) + s.get('eval_decrypt', 0.0):.4f}"
            f" wb {s.get('writeback', 0.0) + s.get('eval_writeback', 0.0):.4f}"
            f" | clipped {self.clipped_fraction:.2f} | dropped {len(self.dropped)}"
        )


@dataclass
class RunResults:
    config: dict[str, Any]
    mode: str
    run_id: int = 0
    status: str = "running"
    started_at: float = field(default_factory=time.time)
    finished_at: float = math.nan
    rounds: list[RoundRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = 1
        d["wall_s"] = self.finished_at - self.started_at
        return _nan_to_none(d)

    def write(self, results_dir: str | Path) -> Path:
        """Write ``<results_dir>/run-<run_id>-<time>.json`` atomically; returns the absolute path."""
        self.finished_at = time.time()
        out_dir = Path(results_dir).expanduser().resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.started_at))
        path = out_dir / f"run-{self.run_id}-{stamp}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=_jsonable, allow_nan=False))
        tmp.replace(path)
        return path


def _nan_to_none(obj: Any) -> Any:
    """Strict JSON has no NaN: missing measurements become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def mean(values: list[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def weighted_mean(values: list[float], weights: list[float]) -> float:
    pairs = [(v, w) for v, w in zip(values, weights) if not math.isnan(v) and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else math.nan
