"""A ``GenerationBackend`` that decodes one request at a time: fedkv without the scheduler.

One worker thread takes requests from a queue in arrival order. For each it opens a cache
session in the request's tenant namespace (prefix blocks are shared only within a tenant),
prefills the prompt with ``model.prefill`` (a cached prefix is reused, not computed), forks
the session ``n - 1`` times (the forks share the prompt's blocks copy-on-write) and decodes the
forks round-robin, one ``forward_cached`` token at a time, until each meets a stop id,
``max_tokens``, the model's context, a ``cancel`` or the request's deadline (checked before the
prefill and before every token: ``timeout``). Each fork samples with its own
``torch.Generator``, seeded from the request's seed or ``secrets``, and its own
``node.engine.sampling.Sampler`` (penalties, logprobs, grammar). A full KV pool
(``CacheFullError``) finishes the request's unfinished handles with ``error`` and frees its
sessions; the worker goes on with the next request. It is the baseline the continuous-batching
scheduler (``node.engine.scheduler``) is measured against, and a backend the OpenAI server
(``node.serving.openai_api``) runs on by itself.

The model and the cache are touched by the worker thread only; handles are fed through
``queue.Queue``, so any thread may consume or cancel them. The worker holds the process's OpenMP
workers: the constructor frees its caller's, the idle worker its own (``node.engine.openmp_pool``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cache import KVCache
from cache.errors import CacheFullError
from node.engine import openmp_pool
from node.engine.generation import GenerationRequest, TokenStream, kv_gauges, remote_events
from node.models.interface import CachedLM
from node.engine.sampling import Sampler

_log = logging.getLogger("fedkv.serial_backend")
_ids = itertools.count(1)


@dataclass(eq=False)
class SerialHandle:
    """One fork's stream of tokens (``node.engine.generation.GenerationHandle``)."""

    request_id: str
    prompt_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    model_version: int | None = None
    cached_prompt_tokens: int = 0
    _stream: TokenStream = field(default_factory=TokenStream, repr=False)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The generated ids as produced; ``TimeoutError`` after ``timeout`` s without one."""
        return self._stream.tokens(timeout)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.error, self.finish_reason = error, reason
            self._stream.end()


@dataclass
class _Fork:
    handle: SerialHandle
    sid: int
    sampling: Sampler
    logits: torch.Tensor
    produced: int = 0


class SerialBackend:
    """Decodes queued requests one at a time on one worker thread (see the module docstring)."""

    def __init__(self, model: CachedLM, cache: KVCache, *, model_id: str = "fedkv"):
        self.model, self.cache, self.model_id = model, cache, model_id
        self._requests: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # submit vs close: nothing is queued after close drains
        self._worker = threading.Thread(target=self._run, name="fedkv-serial-backend", daemon=True)
        self._worker.start()
        openmp_pool.release_pool()  # the worker runs the forwards now (node.engine.openmp_pool)

    @property
    def version(self) -> int:
        return self.cache.version

    @property
    def alive(self) -> bool:
        """The worker thread runs (``/health``)."""
        return self._worker.is_alive()

    def gauges(self) -> dict[str, Any]:
        """A read-only glance for ``/metrics``: requests queued behind the one decoding,
        prefix-cache block hits per tier and what the cache holds (``KVCache.stats``, a
        snapshot safe beside the worker)."""
        stats = self.cache.stats()
        return {"waiting": self._requests.qsize(), "tier_hits": dict(stats["tier_hits"]),
                "kv": kv_gauges(stats), "remote": remote_events(stats)}

    def submit(self, request: GenerationRequest) -> list[SerialHandle]:
        """One handle per fork, queued; ``ValueError`` when the prompt exceeds the context,
        ``RuntimeError`` after ``close``."""
        if len(request.prompt) > self.model.context_len:
            raise ValueError(f"the prompt has {len(request.prompt)} tokens; the model takes at "
                             f"most {self.model.context_len}")
        rid = f"gen-{next(_ids)}"
        handles = [SerialHandle(f"{rid}-{i}", len(request.prompt)) for i in range(request.n)]
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the backend is closed")
            self._requests.put((request, handles))
        return handles

    def close(self) -> None:
        """Stop the worker (the request it decodes and every queued one finish ``cancelled``)."""
        with self._lock:
            self._closed.set()
            self._requests.put(None)
        self._worker.join()
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return
            for h in item[1] if item else ():
                h._finish("cancelled")

    # -- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while (item := self._next()) is not None:
                request, handles = item
                if self._closed.is_set():
                    self._requests.put(item)  # close() finishes it
                    return
                self._serve(request, handles)
                del item, request, handles  # idle, the worker holds no finished request

    def _next(self) -> tuple[GenerationRequest, list[SerialHandle]] | None:
        """The next queued request; before waiting for one, the idle worker's OpenMP workers
        are freed (``node.engine.openmp_pool``)."""
        try:
            return self._requests.get_nowait()
        except queue.Empty:
            openmp_pool.release_pool()
            return self._requests.get()

    def _serve(self, request: GenerationRequest, handles: list[SerialHandle]) -> None:
        """Prefill, fork, decode; whatever happens, every handle finishes and sessions close."""
        sids: list[int] = []
        try:
            forks = self._prefill(request, handles, sids)
            self._decode(request, forks)
        except CacheFullError:
            for h in handles:
                h._finish("error", "the KV cache is full: no free block for this request")
        except Exception as e:  # a bug must not leave a consumer waiting forever
            for h in handles:
                h._finish("error", f"generation failed: {type(e).__name__}")
            _log.exception("request %s failed", handles[0].request_id)
        finally:
            for sid in sids:
                self.cache.close_session(sid)
            for h in handles:
                h._finish("cancelled" if self._closed.is_set() else "error", "not finished")

    def _prefill(self, request: GenerationRequest, handles: list[SerialHandle],
                 sids: list[int]) -> list[_Fork]:
        if request.max_tokens == 0 or request.expired():
            for h in handles:
                h._finish("timeout" if request.expired() else "length")
            return []
        counters = self.cache.blocks.counters
        hits = counters["prefix_hit_tokens"]
        sids.append(self.cache.open_session(namespace=request.tenant))
        logits = self.model.prefill(list(request.prompt), self.cache, sids[0])
        cached = counters["prefix_hit_tokens"] - hits
        sids.extend(self.cache.fork(sids[0]) for _ in handles[1:])
        forks = []
        for i, (h, sid) in enumerate(zip(handles, sids)):
            h.cached_prompt_tokens = cached
            seed = request.seeds[i] if request.seeds is not None else None
            forks.append(_Fork(h, sid, Sampler(request.sampling, request.prompt, seed), logits))
        return forks

    def _decode(self, request: GenerationRequest, forks: list[_Fork]) -> None:
        """Round-robin over the forks, one token each per turn."""
        while forks := [f for f in forks if self._step(request, f)]:
            pass

    def _step(self, request: GenerationRequest, f: _Fork) -> bool:
        """One token of fork ``f``; False once it finished."""
        h = f.handle
        if h.cancelled or self._closed.is_set() or request.expired():
            h._finish("cancelled" if h.cancelled or self._closed.is_set() else "timeout")
            return False
        token = f.sampling.pick(f.logits)  # None: the grammar's output is complete
        if h.model_version is None:
            h.model_version = self.cache.version
        if token is None or token in request.stop_token_ids:
            h._finish("stop")
            return False
        h._stream.put(token)
        f.produced += 1
        if f.produced >= request.max_tokens or self.cache.length(f.sid) >= self.model.context_len:
            h._finish("length")
            return False
        f.logits = self.model.forward_cached([token], self.cache, f.sid)[-1]
        return True
