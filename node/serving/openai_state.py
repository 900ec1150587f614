"""The OpenAI routes' shared state: the served models, codec, tenants, limits (``APIConfig``),
per-tenant counters and the admission gate (``node.serving.fair_gate``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from node.serving.fair_gate import FairGate, Refused
from node.serving.openai_protocol import APIError, PromptCodec
from node.serving.serve_auth import Tenants
from node.serving.serve_metrics import ServeMetrics
from node.serving.served_models import ServedModels

MIN_MAX_TOKENS = 256
"""The default cap on ``max_tokens`` for a model of a shorter context (the byte model's 128)."""


@dataclass(frozen=True)
class APIConfig:
    """The server's limits (every one a flag of ``python -m node.serving.openai_api``)."""

    max_tokens: int | None = None
    """The most tokens one choice may generate (a larger ``max_tokens`` is a 400). None: the
    context left after the prompt (as vLLM), which a request omitting ``max_tokens`` gets;
    at least ``MIN_MAX_TOKENS`` may be asked for (then the context decides)."""
    max_concurrent: int = 16
    """Requests one tenant may have in flight (queued or decoding); more get 429. 16: one
    client may stream 16 requests at once; ``node.serving.fair_gate`` keeps tenants fair."""
    max_queue: int = 64
    """Requests the server takes in flight in all; more get 503 with ``Retry-After``."""
    request_timeout_s: float = 60.0
    """Seconds a request may wait for its next token before it is cancelled (503)."""
    request_deadline_s: float = 300.0
    """Seconds a request may take in all, from its admission to its last token: past it the
    backend stops decoding it between steps, the server between tokens, and the reply ends
    with a 503 ``timeout`` (a stream: its last event); its slot and KV blocks are freed."""
    socket_timeout_s: float = 10.0
    """Seconds a client may take for its request head, and for its body."""
    max_body: int = 1 << 20
    metrics_auth: bool = False
    """``GET /metrics`` needs a tenant's token too (off: as vLLM; it shows no tenant or token)."""
    max_running: int | None = None
    """Sequences handed to the backend at once (``node.serving.fair_gate``'s slots); None: the
    backend's own ``max_running`` when it has one, else ``max_queue``."""


@dataclass
class TenantStats:
    """One tenant's own counters (``GET /v1/stats`` shows the caller's only)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens taken from the tenant's own prefix cache."""
    completion_tokens: int = 0
    rate_limited: int = 0
    refused_busy: int = 0


def _slots(backend: Any, config: APIConfig) -> int:
    if config.max_running is not None:
        return config.max_running
    sched = getattr(getattr(backend, "scheduler", None), "config", None)
    return getattr(sched, "max_running", None) or config.max_queue


@dataclass
class OpenAIState:
    """What the routes share: the served models, codec, tenants, limits and counters."""

    models: ServedModels
    codec: PromptCodec
    tenants: Tenants
    config: APIConfig
    context_len: int
    stats: defaultdict[str, TenantStats] = field(default_factory=lambda: defaultdict(TenantStats))
    history: Callable[[], dict] | None = None
    """The followed node's model history (``WeightFollower.history``), shown to all."""
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServeMetrics = field(init=False)
    gate: FairGate = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServeMetrics(self.backend)  # this server's own registry; the request log
        self.gate = FairGate(self.config.max_concurrent, self.config.max_queue,
                             _slots(self.backend, self.config))

    @property
    def backend(self) -> Any:
        """The base model's backend (every served model's, shared)."""
        return self.models.backend

    def max_tokens(self) -> int:
        """The cap a request's ``max_tokens`` is checked against (a request under it that
        does not fit the context left is a 400 naming the prompt)."""
        return self.config.max_tokens or max(MIN_MAX_TOKENS, self.context_len)

    def admit(self, tenant: str) -> None:
        """``FairGate.admit`` with OpenAI's 429/503 replies and the tenant's counters."""
        try:
            self.gate.admit(tenant)
        except Refused as e:
            if e.status == 429:
                self.stats[tenant].rate_limited += 1
                raise APIError(429, f"too many requests in flight for this API key (at most "
                                    f"{self.config.max_concurrent})", None, "rate_limit_exceeded",
                               "rate_limit_error", {"Retry-After": "1"}) from None
            self.stats[tenant].refused_busy += 1
            raise APIError(503, "the server is at capacity; retry later", None, "overloaded",
                           "server_error", {"Retry-After": "1"}) from None
