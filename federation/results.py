"""Per-run results: one JSON file per run, one record per round, one log line per round.

Schema (``schema`` = 2; 2 replaced round ``epsilon`` by ``epsilon_client``/``epsilon_sample``
and added ``provisioning``)::

    {"schema": 2, "status": "completed" | "stopped: <why>" | "failed", "run_id", "mode",
     "config": {<run config, dash keys>}, "started_at", "finished_at", "wall_s",
     "provisioning": {<KeyService stats>}, "encoding": {<PackingConfig, he=true>},
     "rounds": [RoundRecord as dict, ...]}

Client phase times are means over the clients that took part (their reply metrics);
``aggregate``, ``verify`` and ``provision`` are measured on the server.

Privacy: ``epsilon_client`` is the client-level ε so far against third parties (server-side RDP
accountant, see ``federation.privacy_ledger.charge_round``); ``epsilon_server``, ``epsilon_node`` and
``epsilon_colluding`` the same against the other observers (``federation.privacy_ledger``);
``epsilon_sample`` the largest sample-level DP-SGD ε reported
by a node (Opacus, per node), both for δ = ``delta``; null = not applicable (no DP of that
kind) or unbounded (noise-multiplier 0). ``delta_total`` = δ + (1 + e^ε)·``saturation_delta``
is the δ of the mechanism that runs under HE (the packed encoding saturates with probability
at most ``saturation_delta``; ``crypto.dp.privacy``, the coupling bound).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from federation.gate_report import line as gate_line

SCHEMA = 8
"""8 added ``epsilon_example`` per round (the name of the unit: = ``epsilon_sample``) and per run
(the last round's, with its ``delta``), as ``experiments.private_finetune`` reports it.
7 added the round field ``gate`` (the gate before serving).
6 replaced ``epsilon_client_no_amplification`` by ε per observer (``epsilon_server``,
``epsilon_node``, ``epsilon_colluding`` with ``colluding_nodes``) and added the key holders'
rounding fields and ``delta_total_key_holders``.
5 added the round fields ``saturation_delta`` and ``delta_total`` (δ of what runs).
4 added ``server_seconds``, ``node_seconds`` and ``seconds`` round / nodes_busy / transport.
3 added ``key_origin``, ``key_rotations``, ``server_pid``, ``privacy_claim`` and the round
fields ``key_epoch``, ``key_rotated``, ``departed``; under DP ``train_loss``, ``clipped_fraction``
and ``saturated_fraction`` are null (nodes do not send them)."""


@dataclass
class RoundRecord:
    round: int
    population: int = 0
    """Admitted (enrolled, and provisioned with he=true) nodes this round."""
    admitted: list[int] = field(default_factory=list)
    """Nodes enrolled/provisioned at the start of this round."""
    sampled: int = 0
    num_clients: int = 0
    """Clients whose update went into the aggregate."""
    dropped: list[dict[str, Any]] = field(default_factory=list)
    """[{"node": id, "phase": "enroll"|"provision"|"train"|"evaluate", "reason": str}]"""
    train_loss: float = math.nan
    eval_loss: float = math.nan
    eval_metric: float = math.nan
    """The task's metric on the nodes' held-out data: accuracy (digits) or perplexity (lm,
    chat: held-out answer perplexity)."""
    base_metric: float = math.nan
    """The same metric of the frozen base model on the same held-out data (chat: the "round 0"
    the adapters are compared against; null for the other tasks)."""
    samples: list[dict[str, str]] = field(default_factory=list)
    """Chat task: ``{"question", "reply"}`` -- greedy replies (<= 32 tokens) of the round's
    global model to held-out questions, from the node that serves partition 0."""
    metric: str = "accuracy"
    eval_clients: int = 0
    upload_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of the encoded update, per node id (str keys for JSON)."""
    upload_bytes_mean: float = math.nan
    aggregate_bytes: int = 0
    """Bytes of the aggregate the server sends back (per copy)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """train, encrypt (encode/encrypt), sign, decrypt, writeback (means over the training
    clients; decrypt/writeback = catching up before training), eval_decrypt/eval_writeback
    (evaluate phase), aggregate / verify / provision (server), train_phase / evaluate_phase
    (server wall clock for the whole phase)."""
    server_seconds: dict[str, float] = field(default_factory=dict)
    """The server's round, phase by phase; they sum to ``seconds["round"]`` (``other``: what no
    phase covers). admit (enroll/provision + sampling), send / wait / receive (build the train
    messages, ``grid.send_and_receive``, parse replies), verify (signatures), parse /
    deserialize / add (the aggregator: header checks, SEAL load, homomorphic add), reject
    (dropping refused updates), noise, serialize (the aggregate + manifest), account, then
    eval_send / eval_wait / eval_receive / eval_account."""
    node_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """{"train": {...}, "evaluate": {...}}: each node phase (``protocol.NODE_TRAIN_PHASES`` /
    ``NODE_EVAL_PHASES``) summed over the replying nodes, ``handler`` (their whole handlers) and
    ``other`` (handler time outside the phases). ``seconds["nodes_busy"]`` is both handlers'
    sum, ``seconds["transport"]`` the server's waits minus it (Flower's queues and polling)."""
    clipped_fraction: float = math.nan
    saturated_fraction: float = math.nan
    """Share of encoded values saturated to the packing range (0 for plaintext)."""
    weight_capped: int = 0
    """Clients whose example count exceeded max-weight (dp-mode none)."""
    noise_shares_added: int = 0
    """Distributed-DP noise shares the server added for left-out clients."""
    epsilon_client: float = math.nan
    """Client-level ε so far against third parties, who see released models only (amplified by
    the sampler; dp-mode local/distributed, flower-central). The other observers' figures
    follow (``federation.privacy_ledger``); all for δ = ``delta``."""
    epsilon_server: float = math.nan
    """Against the server: it knows the sample (no amplification); with he=false it also sees
    each update (dp-mode distributed: σ/√k); ∞ for flower-central (it sees updates in clear)."""
    epsilon_node: float = math.nan
    """Against one curious node (a key holder: knows the sample, the dither, its own shares)."""
    epsilon_colluding: float = math.nan
    """Against ``colluding_nodes`` key holders pooling their noise shares."""
    colluding_nodes: int = 0
    """t of ``epsilon_colluding`` (run-config ``colluding-nodes``)."""
    rounding_share_steps: float = math.nan
    """A noise share's std in lattice steps (dithered packing): the key holders' rounding
    argument needs it ≳ 1 (``federation.privacy_ledger``)."""
    rounding_delta: float = math.nan
    """The key holders' δ for rounding they can see through (they hold the dither key)."""
    sampling_skipped: bool = False
    """client-sampling=poisson: the draw fell outside [min-clients, max-clients] and the round
    trained nobody (charged like any Poisson round: third parties see the skip,
    ``federation.poisson_window``)."""
    epsilon_sample: float = math.nan
    """Largest sample-level DP-SGD ε so far over the nodes (dp-sgd=true)."""
    delta: float = math.nan
    saturation_delta: float = math.nan
    """δ_sat of the run (``crypto.dp.saturation``): a bound on the probability that the packed
    encoding saturates any contribution (0: saturation is not part of the analysis, e.g.
    dp-mode local, where it is post-processing, or he=false); null without DP."""
    delta_total: float = math.nan
    """δ of the mechanism that runs: ``delta + (1 + e^epsilon_client)·saturation_delta``
    (``crypto.dp.privacy``, the coupling bound), for the ε of this round."""
    delta_total_key_holders: float = math.nan
    """The same for ``epsilon_node``/``epsilon_colluding``: δ + (1 + e^ε_node)·(δ_sat + δ_round)."""
    node_sources: dict[str, int] = field(default_factory=dict)
    """How nodes were obtained this round: built / restored / reused (see node_host)."""
    pids: list[int] = field(default_factory=list)
    """Distinct ClientApp process ids that replied this round (Ray actors in simulation)."""
    kv_blocks_on_disk: int = 0
    """K/V blocks the replying nodes' caches found on disk when their process warm-started
    this round (0 for nodes whose process already held them)."""
    serving: dict[str, Any] = field(default_factory=dict)
    """What the nodes' serving passes did this round (``serving_summary``): sessions, turns,
    prefix and per-tier hit rates, tokens/s, K/V recomputed because of the write-back,
    blocks invalidated, stale tokens served, perplexity through the cache and cache-free."""
    key_epoch: int = -1
    """CKKS key epoch of this round's updates (-1: he=false)."""
    key_rotated: bool = False
    """A new key epoch was made before this round (a node left, or rotate-every)."""
    departed: list[int] = field(default_factory=list)
    """Nodes dropped this round that left the key group (he=true)."""
    aggregate_discarded: bool = False
    """No node accepted this round's aggregate (a summand's tag did not match: a node signed a
    ciphertext it did not tag); the round is discarded and the next one starts from the last
    accepted version."""
    gate: dict[str, Any] = field(default_factory=dict)
    """The gate before serving over the nodes that evaluated (``federation.gate_report``):
    ``served`` (every one published this round's model to its serving agents), ``nodes``,
    ``unserved_nodes``, ``reason`` (heldout | probes | heldout+probes), the mean held-out loss
    under the served and the new version (``heldout_before`` / ``_after``) and, for chat, the
    margin of the probe that fell most (``probe_before`` / ``_after``). A node that kept the
    model unserved trains on from it and serves its last served version. {}: no node reported."""

    def summary(self, num_rounds: int) -> str:
        """The round line a person reads: a field without a value is left out, never ``nan``;
        ``per node`` figures are means over the nodes that replied, the rest are the round's."""
        parts = [f"round {self.round}/{num_rounds}", _seconds(self.seconds.get("round")),
                 self._nodes(), self._quality(), self._privacy(), self._traffic(),
                 self._phases(), self._dropped(), gate_line(self.gate)]
        return " · ".join(p for p in parts if p) + serving_line(self.serving)

    def _nodes(self) -> str:
        of = f" of {self.population} nodes"
        if self.sampling_skipped:
            return f"no training (the sample fell outside [min, max]-clients){of}"
        return f"trained {self.num_clients}/{self.sampled}{of}, {self.eval_clients} evaluated"

    def _quality(self) -> str:
        fields_ = [(self.metric, self.eval_metric), ("base", self.base_metric), ("eval loss", self.eval_loss),
                   ("train loss", self.train_loss)]
        return " ".join(f"{name} {_num(v)}" for name, v in fields_ if _finite(v))

    def _privacy(self) -> str:
        out = []
        if _finite(self.epsilon_sample):  # example-level DP-SGD: the unit first, each named
            delta = f"δ {_num(self.delta)}, " if _finite(self.delta) else ""
            out.append(f"ε {_num(self.epsilon_sample)} per training example ({delta}vs everyone) ·")
        if _finite(self.epsilon_client):
            unit = "per node's update ε" if _finite(self.epsilon_sample) else "ε"
            out.append(f"{unit} {_num(self.epsilon_client)}")
            others = [("server", self.epsilon_server), ("a node", self.epsilon_node),
                      (f"{self.colluding_nodes} nodes", self.epsilon_colluding)]
            # each observer named once: the server only where it differs from third parties
            shown = [f"{who} {_num(e) if _finite(e) else '∞'}" for who, e in others
                     if not math.isnan(e) and not (who == "server" and e == self.epsilon_client)]
            if shown:
                out.append(f"(vs {', '.join(shown)})")
        if _finite(self.delta_total):
            # δ + (1 + e^ε)·δ_sat reaches 1 once ε is large: no (ε, δ) guarantee is left
            out.append(f"δ {_num(self.delta_total)}" if self.delta_total < 1
                       else "δ 1 (no guarantee at this ε)")
        out += [f"{name} {v:.2f}" for name, v in (("clipped", self.clipped_fraction),
                                                   ("saturated", self.saturated_fraction)) if _finite(v) and v > 0]
        return " ".join(out)

    def _traffic(self) -> str:
        return f"up {self.upload_bytes_mean / 1024:.1f} KiB/node" if _finite(self.upload_bytes_mean) else ""

    def _phases(self) -> str:
        s = self.seconds
        node = [("train", s.get("train")), ("encrypt", s.get("encrypt")),
                ("decrypt", _sum(s.get("decrypt"), s.get("eval_decrypt"))),
                ("write-back", _sum(s.get("writeback"), s.get("eval_writeback")))]
        shown = [f"{k} {_seconds(v)}" for k, v in node if _finite(v)]
        line = f"per node (mean): {' '.join(shown)}" if shown else ""
        if _finite(s.get("aggregate")):
            line += f"{'; ' if line else ''}server aggregate {_seconds(s['aggregate'])}"
        return line

    def _dropped(self) -> str:
        nodes = sorted({d["node"] for d in self.dropped})
        if not nodes:
            return ""
        phases: dict[int, str] = {}
        for d in self.dropped:  # a node dropped in train is also missing from noise: name the first
            phases.setdefault(d["node"], d["phase"])
        named = ", ".join(f"{n} ({phases[n]})" for n in nodes[:4]) + (" …" if len(nodes) > 4 else "")
        return f"dropped {len(nodes)} node{'s' if len(nodes) > 1 else ''}: {named}"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _sum(*values: Any) -> float:
    vals = [v for v in values if _finite(v)]
    return sum(vals) if vals else math.nan


def _num(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def _seconds(v: Any) -> str:
    return f"{v:.1f} s" if _finite(v) and v >= 1 else (f"{v * 1000:.0f} ms" if _finite(v) else "")


def serving_summary(counts: dict[str, float]) -> dict[str, Any]:
    """Rates from the nodes' summed serving counts (``protocol.SERVE_COUNTS``/``AMOUNTS``)."""
    c = counts

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    return {
        "sessions": int(c.get("serve-sessions", 0)), "turns": int(c.get("serve-turns", 0)),
        "nodes_trace_shaped": int(c.get("serve-trace-shaped", 0)),
        "prefix_hit_rate": ratio(c.get("serve-prefix-hit-tokens", 0), c.get("serve-prompt-tokens", 0)),
        "tier_hit_rates": {t: ratio(c.get(f"serve-hit-{t}", 0), c.get("serve-lookups", 0))
                           for t in ("hot", "warm", "cold")},
        "tokens_per_s": ratio(c.get("serve-decode-tokens", 0), c.get("serve-busy-s", 0.0)),
        "decode_tokens": int(c.get("serve-decode-tokens", 0)),
        "recomputed_tokens": int(c.get("serve-recomputed", 0)),
        "invalidated_blocks": int(c.get("serve-invalidated", 0)),
        "stale_tokens_served": int(c.get("serve-stale-served", 0)),
        "ppl": math.exp(ratio(c.get("serve-nll", 0.0), c.get("serve-scored", 0))) if c.get("serve-scored") else math.nan,
        "ppl_fresh": math.exp(ratio(c.get("serve-nll-fresh", 0.0), c.get("serve-scored", 0))) if c.get("serve-scored") else math.nan,
    }


def serving_line(s: dict[str, Any]) -> str:
    """The round line's serving part ("" when nothing was served)."""
    if not s or not s.get("turns"):
        return ""
    t = s["tier_hit_rates"]

    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if _finite(v) else "n/a"

    return (f" · serve {s['sessions']} sess {s['turns']} turns: prefix {f(s['prefix_hit_rate'], '.2f')}"
            f" hot/warm/cold {f(t['hot'], '.2f')}/{f(t['warm'], '.2f')}/{f(t['cold'], '.2f')}"
            f" {f(s['tokens_per_s'], '.0f')} tok/s recomputed {s['recomputed_tokens']}"
            f" invalidated {s['invalidated_blocks']} ppl {f(s['ppl'], '.1f')} (fresh {f(s['ppl_fresh'], '.1f')})")


METRIC_NAMES = {"digits": "accuracy", "lm": "perplexity", "chat": "answer perplexity"}


@dataclass
class RunResults:
    config: dict[str, Any]
    mode: str
    run_id: int = 0
    status: str = "running"
    started_at: float = field(default_factory=time.time)
    finished_at: float = math.nan
    rounds: list[RoundRecord] = field(default_factory=list)
    provisioning: dict[str, Any] = field(default_factory=dict)
    """KeyService stats: who played the dealer, nodes enrolled/provisioned/refused, bytes."""
    encoding: dict[str, Any] = field(default_factory=dict)
    """The public CKKS PackingConfig of the run (he=true), e.g. the derived clip_range."""
    key_origin: dict[str, Any] = field(default_factory=dict)
    """Which party made the CKKS key of epoch 0: {"party": "node" | "provisioner", "node", "epoch"}."""
    key_rotations: int = 0
    server_pid: int = 0
    """Process id of the ServerApp (tests compare it with the secret-context guard's records)."""
    privacy_claim: str = ""
    """What the run's privacy amounts to (crypto.privacy_claim of the final client-level ε)."""

    def outcome_line(self, path: str | Path) -> str:
        """The run's last line: how it ended, its final metric and ε, where the results are."""
        rounds = len(self.rounds)
        want = self.config.get("num-server-rounds", rounds)
        head = "run completed" if self.status == "completed" else f"run FAILED ({self.status})"
        parts = [f"fedkv: {head}", f"{rounds}/{want} rounds"]
        if self.rounds and _finite(self.rounds[-1].eval_metric):
            parts.append(f"{self.rounds[-1].metric} {_num(self.rounds[-1].eval_metric)}")
        if self.privacy_claim:
            parts.append(f"privacy: {self.privacy_claim}")
        return " · ".join(parts + [f"results {path}"])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        for r in d["rounds"]:
            r["epsilon_example"] = r["epsilon_sample"]
        last = self.rounds[-1] if self.rounds else None
        d["epsilon_example"] = last.epsilon_sample if last else math.nan
        d["delta"] = last.delta if last else math.nan
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
