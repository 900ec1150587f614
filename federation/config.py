"""Run configuration: the ``[tool.flwr.app.config]`` keys, typed and checked once.

Every key can be overridden per run: ``flwr run . --run-config "he=false num-server-rounds=5"``.
Every key is checked before any round starts, and every problem is reported at once in
one ``ConfigError`` (a ``ValueError``): an unknown key (named, with the close known names),
a value of the wrong type (``num-server-rounds=2.5``, ``he=2``, ``lr='fast'``), NaN or
infinity for any float, a value out of range, and combinations the code cannot run
(``dp-mode=flower-central`` with ``he=true``, ...).

Accepted spellings (the CLI gives TOML values, tests and scripts give Python ones):

* int keys: an int, an integral float (``5.0``) or a string of one (``"5"``); not a bool;
* float keys: an int, a float or a numeric string; finite only; not a bool;
* bool keys: a bool, the ints 0 and 1, or the strings true/false/1/0 (any case);
* str keys: a string.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

DP_MODES = ("none", "local", "distributed", "flower-central")
TASKS = ("digits", "lm", "chat")
CHAT_MODELS = ("smollm2", "tiny")
"""Bases of the chat task (``node.tasks.tasks.CHAT_MODELS``; kept literal: the config imports no torch)."""
KV_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
"""``cache.config.KV_DTYPES`` (kept literal, as ``CHAT_MODELS``)."""
PACKINGS = ("packed", "none")
CLIENT_SAMPLINGS = ("fixed", "poisson")
"""federation.sampling's samplers (federation.client_accounting accounts each)."""
CKKS_PRESETS = ("auto", "fedkv-2048", "fedkv-4096", "fedkv-8192", "nvflare-default", "fedkv-2048-pq",
                "fedkv-4096-pq")
"""Names of crypto.PRESETS (kept literal so the config does not import tenseal); "auto" picks the
ring whose updates are smallest for the model (``crypto.preset_for``: fedkv-2048 or fedkv-4096,
or their ``-pq`` forms under he-security post-quantum)."""
HE_SECURITIES = ("classical", "post-quantum")
"""The HE standard's columns at 128 bits: classical (SEAL's own bound) or post-quantum."""
PQ_PRESETS = ("fedkv-2048-pq", "fedkv-4096-pq")
MAX_SEED = 2**32 - 1
"""numpy and scikit-learn take seeds in [0, 2**32 - 1]."""
DEFAULT_RESULTS_DIR = "results"
MAX_SERVE_SESSIONS = 64

_CHOICES: dict[str, tuple[str, ...]] = {
    "task": TASKS,
    "chat-model": CHAT_MODELS,
    "packing": PACKINGS,
    "ckks-preset": CKKS_PRESETS,
    "he-security": HE_SECURITIES,
    "dp-mode": DP_MODES,
    "kv-dtype": KV_DTYPES,
    "client-sampling": CLIENT_SAMPLINGS,
}


class ConfigError(ValueError):
    """A run config that does not parse; ``problems`` lists every problem found."""

    prefix = "bad run config"

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{self.prefix}: " + "; ".join(self.problems))


class NodeConfigError(ConfigError):
    """A node config (``--node-config`` of a SuperNode) that does not parse."""

    prefix = "bad node config"


@dataclass(frozen=True)
class RunConfig:
    """Defaults here equal the pyproject defaults (``[tool.flwr.app.config]`` in pyproject.toml)."""

    num_server_rounds: int = 5
    """Federated rounds (>= 1)."""
    task: str = "lm"
    """digits | lm | chat. ``lm``: the byte-level transformer (the node package's CacheNode) on the
    standard library's sources, one share of whole modules per node, metric perplexity;
    ``digits``: scikit-learn digits, a small MLP, Dirichlet non-IID split (flwr-datasets), metric
    accuracy; ``chat``: FFA-LoRA adapters (B only; A frozen from the public seed) on a frozen
    chat model (``chat-model``) fine-tuned on question/answer pairs from each node's share of
    stdlib docstrings, metric held-out answer perplexity (results: ``base_metric`` = the base
    model's, ``samples`` = greedy replies to held-out questions)."""
    chat_model: str = "smollm2"
    """task=chat only: the frozen base. ``smollm2``: SmolLM2-135M-Instruct (``python -m node.models.smollm2
    fetch`` once); ``tiny``: a seeded random 2-layer Llama, byte-level ChatML (tests, CI)."""
    he: bool = True
    """CKKS aggregation (crypto/; the server holds only the public context). false = plaintext
    FedAvg through the plaintext codec, same messages, same signatures: updates are signed either
    way."""
    packing: str = "packed"
    """packed (quantised 8-bit values, several per CKKS slot part: smaller than fp32) | none (one
    CKKS real per slot part). Only used when he=true."""
    packing_bits: int = 8
    """Quantisation bits per value in packing=packed, in [1, 24]. Part of the public CKKS encoding
    (``crypto/dp/encoding_policy.py:packing_for``)."""
    error_feedback: bool = True
    """he=true, packing=packed: each node adds to its next update what quantization and
    saturation left out of its last one (``crypto.UpdateEncryptor`` ``carry``), so rounding
    errors do not accumulate over rounds and saturation bias is paid back. Not applied with
    dp-mode=distributed, whose rounding is dithered instead (see ``crypto/dp/privacy.py``: the
    residual would carry an unnoised share)."""
    packing_range: float = 0.0
    """Public saturation range R of the CKKS encoding; 0 = derived from the run config
    (``crypto/dp/encoding_policy.py:packing_for``)."""
    max_clients: int = 32
    """Most clients sampled per round with he=true (packing headroom). Larger populations
    are sampled down to this. At least min-clients. Part of the public CKKS encoding: size it to
    the real number of contributors (fewer headroom bits, more values per slot)."""
    max_weight: float = 1000.0
    """dp-mode=none: public bound on a client's FedAvg weight (its example count); a node
    with more examples counts as max-weight. Keep it close to the largest partition: the
    CKKS encoding pre-scales updates by weight/max-weight. Unused under DP (equal weights)."""
    ckks_preset: str = "auto"
    """CKKS parameter set (crypto.PRESETS) the dealer uses, part of the public CKKS encoding.
    ``auto``: ``fedkv-2048`` (N=2048, one 54-bit prime) when the model fits one ciphertext, else
    ``fedkv-4096`` (their ``-pq`` forms under he-security post-quantum)."""
    he_security: str = "classical"
    """classical | post-quantum: the HE standard's 128-bit column the ring must meet.
    ``classical``: log q 54 at N=2048, 109 at 4096 (what SEAL enforces); ``post-quantum``: log q
    <= 51 at N = 2048, 101 at 4096, through ckks-preset ``auto`` or the ``fedkv-2048-pq`` /
    ``fedkv-4096-pq`` presets (``tests/crypto/test_post_quantum.py``)."""
    dp_mode: str = "distributed"
    """none | local (each client adds sigma·C) | distributed (each adds sigma·C/sqrt(n); only the
    sum, which the server cannot read, carries sigma·C) | flower-central (Flower's
    ``DifferentialPrivacyClientSideFixedClipping``, client-side fixed clipping: a trusted-server
    baseline; needs he=false)."""
    dp_sgd: bool = True
    """Example-level DP-SGD in each node's local training, whatever the dp-mode: digits through Opacus,
    lm and chat through ``node.tasks.dp_sgd`` (Poisson batches, per-example clipping, Gaussian noise).
    Each record a node trains on is then protected at dp-sgd-epsilon against everyone: the
    server, the other nodes, whoever uses the model. Reported per round as ``epsilon_sample``.
    false: the client-level mechanism alone (the figures before example-level DP)."""
    dp_sgd_epsilon: float = 8.0
    """The example-level epsilon (at target-delta) a node may spend over num-server-rounds
    rounds; each node picks the smallest sigma that keeps it (Opacus'
    ``make_private_with_epsilon`` search, RDP). 0: sigma = noise-multiplier."""
    dp_sgd_batch: int = 0
    """lm/chat: DP-SGD's expected Poisson batch (sample rate = batch / the node's examples);
    0: the task's (lm 256, chat 8)."""
    dp_sgd_clip: float = 1.0
    """With dp-sgd: the per-example gradient bound (clip-norm bounds the node's whole update)."""
    noise_multiplier: float = 0.02
    """sigma (>= 0). With 5 nodes no sigma buys a useful client-level epsilon without wrecking
    the model: the default shows the mechanism: the run reports the epsilon it spends (27,612
    after 5 rounds against third parties and the server, 34,487 against one node, 45,945 against
    two colluding nodes: replace-one adjacency, all 5 nodes every round, Flower's RdpAccountant;
    recomputed with the run's own accountant by
    ``tests/crypto/test_privacy.py::test_main_job_epsilon_is_what_the_run_reports``, which also
    checks it against dp-accounting's RDP and the exact Gaussian-DP figure, 25,953) and its
    results field ``privacy_claim`` and last log line say "clipping and noise, no meaningful ε at
    this population"; ``python -m experiments.privacy_accuracy`` shows where client-level DP pays
    off."""
    clip_norm: float = 1.0
    """L2 bound C on one update, > 0: every update is clipped to it (CKKS needs a bounded range, and
    every node, he=true or false, refuses a mean beyond the bound C implies: crypto.aggregate_bound)."""
    target_delta: float = 1e-5
    """delta of the reported epsilon, in (0, 1)."""
    colluding_nodes: int = 2
    """t of the ε reported against t colluding key-holding nodes (``epsilon_colluding``), >= 1."""
    fraction_train: float = 1.0
    """Share of connected nodes sampled for training each round (client-sampling fixed; at least
    min-clients), or each node's probability (poisson), in (0, 1]."""
    fraction_evaluate: float = 1.0
    """Share of admitted nodes asked to evaluate (decrypt the aggregate, write it back, score,
    serve serve-sessions) each round, in (0, 1]; at least min-clients, at most
    max-evaluate-clients; a fresh sample each round. Nodes not asked catch up to the latest
    version the next time they train or evaluate."""
    max_evaluate_clients: int = 10
    """Most nodes that evaluate per round (0 = no cap; never fewer than min-clients): evaluation
    then costs the same at 100 nodes as at 10, like training under max-clients."""
    client_sampling: str = "fixed"
    """fixed (exactly k = ceil(fraction-train·N) nodes without replacement; ε under replace-one
    adjacency: the sum moves by 2C, so σ counts as σ/2) | poisson (each node joins with
    probability fraction-train and the mean divides by the fixed expected count q·N (DP-FedAvg;
    not rounded, it may be fractional); ε under add-or-remove-one at q = fraction-train itself,
    the probability the sampler draws each node with, never a rounded q·N/N; a draw outside
    [min-clients, max-clients] skips the round; third parties see the skip, which depends on
    whether a node is there, so every Poisson round is charged with it (dp-accounting's PLD,
    ``federation/poisson_window.py``, docs/privacy.md; ε is ∞ where the window binds often,
    e.g. 10 nodes, q 0.25, min-clients 2)). ``federation.sampling``. Fixed is accounted with
    Flower 1.42's ``RdpAccountant`` (``federation/client_accounting.py``); every round reports ε per observer
    (``epsilon_client`` against third parties, amplified; ``epsilon_server``, ``epsilon_node``,
    ``epsilon_colluding`` without amplification: ``federation/privacy_ledger.py``)."""
    adaptive_clipping: bool = False
    """Adaptive clipping (Andrew et al. 2021) instead of a fixed norm; clip-norm is the initial
    norm. dp-mode=flower-central: Flower's DifferentialPrivacyClientSideAdaptiveClipping.
    dp-mode=distributed (he=true): fedkv's, the noisy clipped count riding in the update's
    ciphertext as one extra coordinate (``crypto/dp/adaptive_clipping.py``); nodes keep and move the
    norm, the server never sees it. Either way the count is paid for inside the noise multiplier
    (the update noise is raised), so ε is the same."""
    target_clipped_quantile: float = 0.5
    """adaptive-clipping: the share of updates the clip norm aims to leave unclipped, in (0, 1)."""
    clipped_count_stddev: float = 0.0
    """adaptive-clipping: noise std σ_b of the clipped count; 0 = max(k/20, σ) (Andrew et al.'s
    k/20, raised where it would not leave noise for the update: σ_b > σ/2), with k the clients
    per round under flower-central and max-clients under distributed (a public bound every
    node and the server share)."""
    clip_norm_lr: float = 0.2
    """adaptive-clipping: η of the geometric norm update C·exp(−η(b̃ − γ)) (Flower's default), >= 0."""
    sampler_seed: int = -1
    """-1 = the client sample is drawn from OS entropy (``secrets.SystemRandom``; a normal run:
    amplification by sampling needs a sample nobody can derive from the public seed); >= 0 seeds
    it (experiments only)."""
    local_epochs: int = 2
    """Local passes per round (>= 1; lm: 8 steps of 8 windows per epoch)."""
    lr: float = 0.0
    """Local learning rate; 0 = the task's default (digits 0.3 with SGD, lm 3e-3 with AdamW)."""
    kv_dtype: str = "fp32"
    """KV-cache block storage on the nodes: fp32 | fp16 | int8 | int4 (lm task; passed to the
    node; unused by digits)."""
    results_dir: str = DEFAULT_RESULTS_DIR
    """Where the run's results JSON goes; relative paths resolve against the ServerApp's cwd
    (where the SuperLink started), so prefer an absolute path."""
    min_clients: int = 2
    """Minimum clients per round: a round with fewer usable updates than this stops the run."""
    seed: int = 42
    """The run's (public) seed, in [0, 2**32 - 1]."""
    alpha: float = 1.0
    """Dirichlet concentration of the digits task's non-IID split (> 0)."""
    round_timeout: float = 120.0
    """Seconds the server waits for replies per phase (late clients are left out),
    and for min-clients nodes to be connected before a round (> 0)."""
    server_kit: str = ""
    """Absolute path of the server's provisioned startup kit (``python -m federation.deploy.provision``):
    enrollment pinned to the kit's roster, the provisioner's CKKS key. "" = simulation: the nodes
    make the CKKS key (the lowest-id node) and peers are trusted on first use, bounded by the
    member set each node pins at its first key (docs/threat-model.md)."""
    rotate_every: int = 0
    """Also rotate the CKKS key every K rounds (>= 0); 0 = only when a node leaves (it always
    rotates when a node leaves a round)."""
    max_rejected_rounds: int = 3
    """After this many rounds in a row whose aggregate every node refused (a node's summand broke
    the public bound on the mean, or under HE a key holder's tag or encrypted header: see the
    threat model's "malicious node"; the server cannot tell whose), the run stops with ``status``
    "stopped: K rounds in a row had their aggregate refused by every node (...)" instead of going
    on without progress (>= 1). A refused round is discarded and the run goes on; an accepted one
    resets the count."""
    serve_sessions: int = 4
    """Chat sessions each node serves through its cache in every evaluate phase (lm task;
    0 = none): multi-turn, behind one shared system prompt, texts from the held-out share,
    lengths and turn order shaped by the Mooncake conversation trace when the machine has it
    (``$FEDKV_SERVE_TRACE``; ``node.tasks.workload``). The round line and results show prefix and tier
    hit rates, tokens/s, K/V recomputed because of the write-back, blocks invalidated,
    perplexity."""
    serve_gate_tolerance: float = 0.5
    """The gate before serving (``node.serve_gate``), nats, >= 0: a node keeps an aggregate unserved
    (trains on from it; its serving agents keep the last served version) when its held-out loss rose
    by more than this over the served version's, a chat probe's margin (log-likelihood per token,
    expected minus contrary answer) fell by more, or a probe's preferred answer flipped to the
    contrary one; node-config ``max-serve-gate-tolerance`` caps it (docs/threat-model.md)."""
    kv_stale_policy: str = "invalidate"
    """What a write-back does to cached K/V: ``invalidate`` (all older K/V unservable: never
    serve K/V of an older model version) or ``keep-<k>`` (serve K/V of up to k older versions;
    the results' ``serve_ppl`` vs ``serve_ppl_fresh``, a cache-free forward under the new
    weights, is its quality cost against recomputing)."""

    @property
    def mode(self) -> str:
        """What aggregates: ``flower-central`` (Flower's DP wrapper), ``he`` (CKKS) or ``plain``."""
        return "flower-central" if self.dp_mode == "flower-central" else ("he" if self.he else "plain")

    @property
    def task_id(self) -> str:
        """The task as ``node.tasks.tasks`` names it (the module's ``task_id``)."""
        return task_id({"task": self.task, "chat-model": self.chat_model})

    @property
    def kv_stale_versions(self) -> int:
        """Older model versions whose K/V stay servable (0 for ``invalidate``)."""
        return stale_versions(self.kv_stale_policy)

    def __post_init__(self) -> None:
        problems: list[str] = []
        bad: set[str] = set()
        for f in fields(self):
            key = key_name(f.name)
            value, problem = _coerce(getattr(self, f.name), type(f.default), key)
            if problem is not None:
                problems.append(problem)
                bad.add(key)
            else:
                object.__setattr__(self, f.name, value)  # normalised type (e.g. 5.0 -> 5)
        problems += _range_problems(self, bad)
        if problems:
            raise ConfigError(problems)

    @staticmethod
    def from_run_config(run_config: Mapping[str, Any]) -> RunConfig:
        """Build from ``context.run_config`` (dash-separated keys), coercing types.

        Raises ``ConfigError`` naming every unknown key and every bad value.
        """
        known = {key_name(f.name): f.name for f in fields(RunConfig)}
        problems = [unknown_key(k, known) for k in run_config if k not in known]
        kwargs = {known[k]: v for k, v in run_config.items() if k in known}
        try:
            cfg = RunConfig(**kwargs)
        except ConfigError as err:
            raise ConfigError(problems + err.problems) from None
        if problems:
            raise ConfigError(problems)
        return cfg

    def as_dict(self) -> dict[str, Any]:
        """Dash-separated keys, as they appear in pyproject (for results files)."""
        return {key_name(k): v for k, v in asdict(self).items()}


_KEEP = re.compile(r"keep-([0-9]{1,3})")


def task_id(run_config: Mapping[str, Any]) -> str:
    """The task a node builds (``node.tasks.tasks.make_task``) from raw run-config values:
    ``chat:<chat-model>`` for chat (``RunConfig.task_id``), else the task."""
    task = str(run_config.get("task", "digits"))
    return f"chat:{run_config.get('chat-model', 'smollm2')}" if task == "chat" else task


def stale_versions(policy: str) -> int:
    """``invalidate`` -> 0, ``keep-<k>`` -> k; ValueError for anything else."""
    if policy == "invalidate":
        return 0
    m = _KEEP.fullmatch(policy)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"kv-stale-policy must be 'invalidate' or 'keep-<k>' with k >= 1, "
                         f"not {policy!r}")
    return int(m.group(1))


def config_lines(cfg: RunConfig, width: int = 100) -> list[str]:
    """The run config as a person reads it: the essentials, then only the keys that differ
    from the defaults, wrapped at ``width`` (every key is in the results file)."""
    dp = "no DP" if cfg.dp_mode == "none" else f"dp-mode {cfg.dp_mode} σ {cfg.noise_multiplier:g} C {cfg.clip_norm:g}"
    head = f"task {cfg.task} · {cfg.num_server_rounds} rounds · mode {cfg.mode} · {dp}"
    defaults = RunConfig()
    changed = [f"{key_name(f.name)}={getattr(cfg, f.name)!r}" for f in fields(cfg)
               if getattr(cfg, f.name) != getattr(defaults, f.name)]
    lines, line = [head], "changed from the defaults:" if changed else "every other key at its default"
    for item in changed:
        if len(line) + 1 + len(item) > width:
            lines.append(line)
            line = "  "
        line += ("" if line == "  " else " ") + item
    return lines + [line]


def known_keys() -> list[str]:
    """Every run-config key, dash-separated, in declaration order."""
    return [key_name(f.name) for f in fields(RunConfig)]


def results_dir_of(run_config: Mapping[str, Any]) -> str:
    """The results-dir of a raw run config if it is a usable string, else "results": where a
    ``status: failed: <reason>`` file goes when the config does not parse. Never raises."""
    try:
        value = run_config.get("results-dir", DEFAULT_RESULTS_DIR)
    except Exception:  # not a mapping at all
        return DEFAULT_RESULTS_DIR
    if isinstance(value, str) and value.strip() and "\0" not in value:
        return value
    return DEFAULT_RESULTS_DIR



# -- internals ------------------------------------------------------------------------------
def key_name(name: str) -> str:
    """A field's run-config key (dashes for underscores)."""
    return name.replace("_", "-")


def unknown_key(key: Any, known: Iterable[str], where: str = "[tool.flwr.app.config] in pyproject.toml") -> str:
    """The problem text for an unknown key: the closest known keys, else where the keys are."""
    close = difflib.get_close_matches(str(key).replace("_", "-"), list(known), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"see {where}"
    return f"unknown key {key!r} ({hint})"


def _coerce(value: Any, typ: type, key: str) -> tuple[Any, str | None]:
    """(value of type ``typ``, None) or (None, the problem)."""
    if typ is bool:
        if isinstance(value, bool):
            return value, None
        if isinstance(value, numbers.Integral) and value in (0, 1):
            return bool(value), None
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1"), None
        return None, f"{key}={value!r} is not a boolean (true, false, 1 or 0)"
    if typ is int:
        if isinstance(value, bool):
            return None, f"{key}={value!r} is a boolean, not an integer"
        if isinstance(value, numbers.Integral):
            return int(value), None
        number = _number(value)
        if number is not None and math.isfinite(number) and float(number).is_integer():
            return int(number), None
        return None, f"{key}={value!r} is not an integer"
    if typ is float:
        if isinstance(value, bool):
            return None, f"{key}={value!r} is a boolean, not a number"
        number = _number(value)
        if number is None:
            return None, f"{key}={value!r} is not a number"
        if not math.isfinite(number):
            return None, f"{key}={value!r} must be a finite number (not NaN or infinity)"
        return float(number), None
    if isinstance(value, str):
        return value, None
    if key in _CHOICES:
        return None, f"{key} must be one of {_CHOICES[key]}, not {value!r}"
    return None, f"{key}={value!r} is not a string"


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _is_stale_policy(policy: str) -> bool:
    """Whether ``stale_versions`` takes ``policy``."""
    return policy == "invalidate" or bool((m := _KEEP.fullmatch(policy)) and int(m.group(1)) >= 1)


def _range_problems(cfg: RunConfig, bad: set[str]) -> list[str]:
    """Range and combination checks over the values that parsed (``bad``: those that did not)."""
    problems: list[str] = []

    def check(keys: str, ok: Any, message: str) -> None:
        if not any(k in bad for k in keys.split()) and not ok():
            problems.append(message)

    for key, choices in _CHOICES.items():
        value = getattr(cfg, key.replace("-", "_"))
        check(key, lambda: value in choices, f"{key} must be one of {choices}, not {value!r}")
    _check_values(cfg, check)
    _check_combinations(cfg, check)
    return problems


_Check = Callable[[str, Callable[[], bool], str], None]


def _check_values(cfg: RunConfig, check: _Check) -> None:
    """One key's range at a time."""
    check("num-server-rounds", lambda: cfg.num_server_rounds >= 1, "num-server-rounds must be >= 1")
    check("packing-bits", lambda: 1 <= cfg.packing_bits <= 24, "packing-bits must be in [1, 24]")
    check("packing-range", lambda: cfg.packing_range >= 0, "packing-range must be >= 0 (0 = derived)")
    check("min-clients", lambda: cfg.min_clients >= 1, "min-clients must be >= 1")
    check("max-weight", lambda: cfg.max_weight > 0, "max-weight must be > 0")
    check("noise-multiplier", lambda: cfg.noise_multiplier >= 0, "noise-multiplier must be >= 0")
    check("clip-norm", lambda: cfg.clip_norm > 0,
          "clip-norm must be > 0 (every update is clipped to it; nodes refuse a mean beyond the bound it implies)")
    check("dp-sgd-epsilon", lambda: cfg.dp_sgd_epsilon >= 0, "dp-sgd-epsilon must be >= 0 (0: sigma = noise-multiplier)")
    check("dp-sgd-batch", lambda: cfg.dp_sgd_batch >= 0, "dp-sgd-batch must be >= 0 (0: the task's)")
    check("dp-sgd-clip", lambda: cfg.dp_sgd_clip > 0, "dp-sgd-clip must be > 0")
    check("target-delta", lambda: 0.0 < cfg.target_delta < 1.0, "target-delta must be in (0, 1)")
    check("colluding-nodes", lambda: cfg.colluding_nodes >= 1, "colluding-nodes must be >= 1")
    check("fraction-train", lambda: 0.0 < cfg.fraction_train <= 1.0, "fraction-train must be in (0, 1]")
    check("fraction-evaluate", lambda: 0.0 < cfg.fraction_evaluate <= 1.0, "fraction-evaluate must be in (0, 1]")
    check("max-evaluate-clients", lambda: cfg.max_evaluate_clients >= 0,
          "max-evaluate-clients must be >= 0 (0 = no cap)")
    check("local-epochs", lambda: cfg.local_epochs >= 1, "local-epochs must be >= 1")
    check("lr", lambda: cfg.lr >= 0, "lr must be >= 0 (0 = the task's default)")
    check("results-dir", lambda: bool(cfg.results_dir.strip()) and "\0" not in cfg.results_dir,
          "results-dir must be a non-empty path")
    check("seed", lambda: 0 <= cfg.seed <= MAX_SEED, f"seed must be in [0, {MAX_SEED}]")
    check("sampler-seed", lambda: -1 <= cfg.sampler_seed <= MAX_SEED,
          f"sampler-seed must be -1 (OS entropy) or in [0, {MAX_SEED}]")
    check("alpha", lambda: cfg.alpha > 0, "alpha (Dirichlet concentration) must be > 0")
    check("round-timeout", lambda: cfg.round_timeout > 0, "round-timeout must be > 0 seconds")
    check("server-kit", lambda: cfg.server_kit == "" or ("\0" not in cfg.server_kit and os.path.isabs(cfg.server_kit)),
          f"server-kit must be an absolute path (or \"\" for simulation), not {cfg.server_kit!r}")
    check("rotate-every", lambda: cfg.rotate_every >= 0, "rotate-every must be >= 0 (0 = only when a node leaves)")
    check("max-rejected-rounds", lambda: cfg.max_rejected_rounds >= 1, "max-rejected-rounds must be >= 1")
    check("serve-sessions", lambda: 0 <= cfg.serve_sessions <= MAX_SERVE_SESSIONS,
          f"serve-sessions must be in [0, {MAX_SERVE_SESSIONS}]")
    check("serve-gate-tolerance", lambda: cfg.serve_gate_tolerance >= 0, "serve-gate-tolerance must be >= 0")
    check("kv-stale-policy", lambda: _is_stale_policy(cfg.kv_stale_policy),
          f"kv-stale-policy must be 'invalidate' or 'keep-<k>' (k >= 1), not {cfg.kv_stale_policy!r}")
    check("clip-norm-lr", lambda: math.isfinite(cfg.clip_norm_lr) and cfg.clip_norm_lr >= 0,
          "clip-norm-lr must be finite and >= 0")
    check("target-clipped-quantile", lambda: 0.0 < cfg.target_clipped_quantile < 1.0,
          "target-clipped-quantile must be in (0, 1)")
    check("clipped-count-stddev", lambda: cfg.clipped_count_stddev >= 0,
          "clipped-count-stddev must be >= 0 (0 = max(clients per round / 20, noise-multiplier))")


def _check_combinations(cfg: RunConfig, check: _Check) -> None:
    """Keys that constrain each other."""
    check("max-clients min-clients", lambda: cfg.max_clients >= max(cfg.min_clients, 1),
          "max-clients must be >= min-clients")
    check("he-security ckks-preset", lambda: cfg.he_security == "classical" or cfg.ckks_preset in ("auto",) + PQ_PRESETS,
          f"he-security post-quantum needs ckks-preset auto or one of {PQ_PRESETS}, not {cfg.ckks_preset!r}")
    check("rotate-every he", lambda: cfg.rotate_every == 0 or cfg.he,
          "rotate-every rotates the CKKS key; it needs he=true")
    check("server-kit he", lambda: not cfg.server_kit or cfg.he,
          "server-kit provisions the CKKS key; it needs he=true")
    check("dp-mode he", lambda: not (cfg.dp_mode == "flower-central" and cfg.he),
          "dp-mode=flower-central uses Flower's plaintext arrays; set he=false")
    check("client-sampling dp-mode", lambda: not (cfg.client_sampling == "poisson" and cfg.dp_mode == "flower-central"),
          "client-sampling=poisson is fedkv's sampler; Flower's FedAvg (dp-mode=flower-central) samples a fixed k")
    check("adaptive-clipping dp-mode", lambda: not cfg.adaptive_clipping or cfg.dp_mode in ("flower-central", "distributed"),
          "adaptive-clipping needs dp-mode=distributed (fedkv's, under HE) or flower-central (Flower's wrapper)")
    check("adaptive-clipping he", lambda: not (cfg.adaptive_clipping and cfg.dp_mode == "distributed" and not cfg.he),
          "adaptive-clipping with dp-mode=distributed sums the clipped count under CKKS; set he=true")
    check("task dp-mode", lambda: not (cfg.task == "chat" and cfg.dp_mode == "flower-central"),
          "task=chat does not run with dp-mode=flower-central (Flower's array protocol would ship "
          "the whole base model); use dp-mode none, local or distributed")
