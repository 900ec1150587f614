"""One generation request and the stream of its tokens: the contract between whatever decodes
(``node.engine.scheduler``'s continuous batching, or one request at a time) and whatever serves or
measures it (``node.serving.openai_api``, ``experiments.serve_load``).

Requests carry token ids, not text: the chat template, stop strings and detokenizing are the
server's (``node.models.chat``), so a backend never sees a tokenizer. A backend answers ``submit``
at once with one handle per sample (``n`` forks share the prompt's blocks by copy-on-write)
and produces tokens as it runs; a consumer iterates a handle from its own thread.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from node.engine.sampling import GREEDY, SamplingParams, Token

FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error")
"""``stop``: an EOS/stop token id was produced (it is not yielded) or the request's grammar
allows no further token (its constrained output is complete); ``length``: ``max_tokens``
reached; ``cancelled``: the consumer called ``cancel``; ``timeout``: the request's
``deadline`` passed first (checked between decode steps and prefill chunks); ``error``: the
backend failed the request (``GenerationHandle.error`` says why; nothing secret-dependent)."""


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate. ``tenant`` is the prefix-sharing namespace: a request shares cached
    blocks only with requests of the same tenant."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    """How each token is picked (``node.engine.sampling``); a ``node.engine.sessions.Sampling`` is taken as
    its temperature and top_p."""
    stop_token_ids: frozenset[int] = frozenset()
    tenant: str = "default"
    n: int = 1
    seeds: tuple[int, ...] | None = field(default=None)
    """One sampling seed per fork (``len == n``); None: each fork draws its own from the OS."""
    deadline: float | None = None
    """A ``time.monotonic()`` instant: past it the backend finishes every fork ``timeout``
    at its next step boundary and frees its blocks. None: no deadline."""

    def expired(self) -> bool:
        """The deadline has passed (never, without one)."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling", SamplingParams.of(self.sampling))
        if not self.prompt:
            raise ValueError("a generation request needs at least one prompt token")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seeds is not None and len(self.seeds) != self.n:
            raise ValueError(f"{len(self.seeds)} seeds for n={self.n} forks")


_END = object()


class TokenStream:
    """One sample's tokens from the decoding thread to the consumer's (thread-safe): ``put``
    each, ``end`` once; a handle's ``tokens`` is ``stream.tokens``."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, token: Token | int) -> None:
        self._queue.put(token)

    def end(self) -> None:
        self._queue.put(_END)

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The tokens as produced, ending after ``end``; ``TimeoutError`` after ``timeout``
        seconds without one. Iterating again after the end returns at once."""
        while True:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no token within {timeout} s") from None
            if item is _END:
                self._queue.put(_END)
                return
            yield item


class GenerationHandle(Protocol):
    """One sample being generated."""

    request_id: str
    finish_reason: str | None
    """One of ``FINISH_REASONS`` once finished, else None."""
    error: str | None
    model_version: int | None
    """The model (weights/adapter) version every yielded token was computed under; set when
    the first token is produced. A backend that restarts running requests under a newer
    version (``node.engine.scheduler``) keeps the first token's here and lists each token's in a
    ``token_versions`` attribute of its handles."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens taken from the prefix cache instead of computed."""

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The generated token ids as they are produced, ending when the sample finishes;
        ``TimeoutError`` when no token arrives within ``timeout`` seconds. Each is a
        ``node.engine.sampling.Token`` (an ``int``) with its logprobs when the request asked."""
        ...

    def cancel(self) -> None:
        """Stop generating; the handle finishes with ``cancelled`` and its blocks are freed."""
        ...


class GenerationBackend(Protocol):
    """Something that decodes requests (see the module docstring)."""

    model_id: str

    @property
    def version(self) -> int:
        """The model version new tokens are computed under."""
        ...

    def submit(self, request: GenerationRequest) -> list[GenerationHandle]:
        """Queue ``request``; one handle per fork, in order. Never refuses for lack of KV
        memory (it waits or preempts); ``ValueError`` for a request the model cannot take
        (a prompt longer than its context)."""
        ...

    def close(self) -> None:
        """Finish every handle (``cancelled``) and stop any thread the backend runs."""
        ...


KV_GAUGES = {
    "sessions_open": "KV cache sessions open (one per sequence holding K/V)",
    "blocks_used": "KV cache blocks held, referenced or cached for reuse",
    "blocks_referenced": "KV cache blocks a live session references",
    "bytes_allocated": "Bytes of the KV cache's blocks",
}
"""What a backend's ``gauges()`` shows of its cache under ``"kv"`` (``/metrics`` as
``fedkv_kv_<name>``): what a long-running server holds, so a leak shows as growth at rest."""


def kv_gauges(stats: dict) -> dict[str, float]:
    """The ``KV_GAUGES`` of a ``KVCache.stats()`` snapshot."""
    return {k: float(stats[k]) for k in KV_GAUGES}


REMOTE_EVENTS = ("hits", "misses", "rejected", "errors", "timeouts", "skipped", "unavailable",
                 "writes", "write_errors", "writes_dropped")
"""A shared (Redis) tier's events ``/metrics`` counts: faults are misses the cache recomputes,
so an operator sees them here, not as failed requests."""


def remote_events(stats: dict) -> dict[str, int]:
    """The ``REMOTE_EVENTS`` of a ``KVCache.stats()`` snapshot ({} without a shared tier)."""
    remote = stats.get("remote") or {}
    return {k: int(remote[k]) for k in REMOTE_EVENTS if k in remote}
