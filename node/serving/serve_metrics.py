"""What a serving process tells its operator: ``/health``, Prometheus ``/metrics`` and one log
line per request -- independent of the HTTP stack, so the OpenAI routes (``node.serving.openai_routes``
on ``node.serving.server_app``'s ASGI app) only fill a ``RequestRecord`` and hand it over.

Metrics live in a per-server ``CollectorRegistry`` (two servers in one process never clash).
Nothing carries a tenant's name or token: the log line names a tenant by the first 8 hex
digits of the SHA-256 of its name (``tenant_hash``), metrics carry no tenant label at all
(cardinality and privacy); routes are the known ones, anything else is ``other``.

The backend's state (waiting and running requests, preemptions, KV cache hits per tier) is
read at scrape time from its optional ``gauges()`` accessor; a backend without one shows none.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from node.engine.generation import KV_GAUGES

_log = logging.getLogger("fedkv.requests")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/stats", "/health",
          "/metrics")
"""Route labels as they are; ``/v1/models/<id>`` becomes ``/v1/models/{id}``, others ``other``."""
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0)
"""Seconds: TTFT and request duration (a CPU node's SmolLM2 reply takes seconds)."""
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds per output token after the first."""
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServedBackend(Protocol):
    """What ``ServeMetrics`` reads of a ``node.engine.generation.GenerationBackend``."""

    model_id: str

    @property
    def version(self) -> int: ...


@dataclass
class RequestRecord:
    """One request as the handler saw it; filled while it runs, observed once it ends."""

    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    tenant: str | None = None
    """The authenticated tenant's name (never logged as such: ``tenant_hash``)."""
    status: int | None = None
    """The HTTP status sent (a stream that fails after its headers is still 200)."""
    error: str | None = None
    """The error code of the reply, or of a stream's last event (``timeout``...)."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def token(self) -> None:
        """A token arrived from the backend (the first one sets the TTFT)."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than two)."""
        if self.first_token_at is None or self.last_token_at is None or \
                self.generated_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.generated_tokens - 1)


def tenant_hash(tenant: str | None) -> str:
    """8 hex digits naming a tenant in logs (``-`` for none): stable across restarts, so an
    operator can follow one. A pseudonym, not a secret: the log spells no name and never a
    token, but whoever guesses a tenant's name can confirm it (the names are the operator's)."""
    return "-" if tenant is None else hashlib.sha256(tenant.encode()).hexdigest()[:8]


def route_label(path: str) -> str:
    """A bounded route label: a client's path never becomes a new time series."""
    path = path.split("?", 1)[0]
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


def health(backend: Any) -> tuple[int, dict[str, Any]]:
    """``/health``'s status and body: 200 while the backend runs, 503 with a reason once its
    decoding thread stopped (``alive`` false). Only the model's id and version: public."""
    loaded = bool(getattr(backend, "alive", True))
    body: dict[str, Any] = {"status": "ok" if loaded else "unavailable",
                            "model": backend.model_id, "model_loaded": loaded,
                            "version": backend.version}
    if not loaded:
        body["reason"] = "the generation backend has stopped"
    return (200 if loaded else 503), body


class _BackendCollector(Collector):
    """Reads the backend at scrape time: model version, ``gauges()`` when it has one."""

    def __init__(self, backend: ServedBackend):
        self.backend = backend

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("fedkv_model_version", "Model version new tokens are computed "
                                "under", value=self.backend.version)
        read: Callable[[], dict[str, Any]] | None = getattr(self.backend, "gauges", None)
        if read is None:
            return
        try:
            g = read()
        except Exception:  # noqa: BLE001 -- a scrape never fails the server
            _log.debug("backend gauges unavailable", exc_info=True)
            return
        if "waiting" in g:
            yield GaugeMetricFamily("fedkv_requests_waiting", "Requests queued, not decoding",
                                    value=g["waiting"])
        if "running" in g:
            yield GaugeMetricFamily("fedkv_requests_running", "Requests decoding now",
                                    value=g["running"])
        if "preemptions" in g:
            yield CounterMetricFamily("fedkv_preemptions", "Running requests preempted for KV "
                                      "memory", value=g["preemptions"])
        if "tier_hits" in g:
            hits = CounterMetricFamily("fedkv_kv_cache_hit_blocks", "Prefix-cache block hits "
                                       "per tier", labels=["tier"])
            for tier, n in sorted(g["tier_hits"].items()):
                hits.add_metric([tier], n)
            yield hits
        if g.get("remote"):  # node.engine.generation.REMOTE_EVENTS
            events = CounterMetricFamily("fedkv_kv_redis_events", "Shared (Redis) tier events; "
                                         "a fault is a miss, recomputed", labels=["event"])
            for event, n in sorted(g["remote"].items()):
                events.add_metric([event], n)
            yield events
        for name, value in sorted(g.get("kv", {}).items()):  # node.engine.generation.KV_GAUGES
            yield GaugeMetricFamily(f"fedkv_kv_{name}", KV_GAUGES.get(name, name), value=value)


class ServeMetrics:
    """A server's metrics and request log (see the module docstring)."""

    def __init__(self, backend: ServedBackend, logger: logging.Logger = _log):
        self.registry = CollectorRegistry(auto_describe=True)
        self.log = logger
        r = self.registry
        self.requests = Counter("fedkv_requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.prompt_tokens = Counter("fedkv_prompt_tokens", "Prompt tokens of completed "
                                     "requests", registry=r)
        self.generated_tokens = Counter("fedkv_generation_tokens", "Tokens generated",
                                        registry=r)
        self.ttft = Histogram("fedkv_time_to_first_token_seconds", "Seconds from a request's "
                              "arrival to its first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("fedkv_time_per_output_token_seconds", "A request's mean seconds "
                              "per output token after the first", buckets=TPOT_BUCKETS,
                              registry=r)
        self.duration = Histogram("fedkv_request_duration_seconds", "Seconds from a request's "
                                  "arrival to its reply's end", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        r.register(_BackendCollector(backend))

    def observe(self, rec: RequestRecord) -> None:
        """Count ``rec`` and write its log line (once, when the request has ended)."""
        duration = time.monotonic() - rec.started
        route, status = route_label(rec.path), rec.status or 0
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(duration)
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generated_tokens.inc(rec.generated_tokens)
        if (ttft := rec.ttft_s) is not None:
            self.ttft.observe(ttft)
        if (tpot := rec.tpot_s) is not None:
            self.tpot.observe(tpot)
        self.log.info("request method=%s route=%s tenant=%s status=%d error=%s prompt_tokens=%d "
                      "generated_tokens=%d ttft_s=%s duration_s=%.3f", rec.method, route,
                      tenant_hash(rec.tenant), status, rec.error or "-", rec.prompt_tokens,
                      rec.generated_tokens, "-" if ttft is None else f"{ttft:.3f}", duration)

    @contextmanager
    def request(self, rec: RequestRecord) -> Iterator[RequestRecord]:
        """Hold ``rec`` while the handler fills it; observe it once it ends, however it ends."""
        try:
            yield rec
        finally:
            self.observe(rec)

    def render(self) -> bytes:
        """The Prometheus text exposition (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
