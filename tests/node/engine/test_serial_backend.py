"""node.engine.serial_backend: the one-request-at-a-time GenerationBackend, on the byte model."""

from __future__ import annotations

import threading

import pytest
import torch

from cache import KVCache
from cache.errors import CacheFullError
from node.engine.sessions import Sampling
from node.engine.generation import GenerationRequest
from node.engine.serial_backend import SerialBackend
from node.tasks.tasks import lm_model

PROMPT = tuple(b"A prompt of more than two blocks of sixteen bytes each.")


@pytest.fixture
def model(one_thread):
    return lm_model(seed=0).eval()


@pytest.fixture
def backend(model):
    b = SerialBackend(model, KVCache(model.cache_config(pool_bytes=1 << 21)))
    try:
        yield b
    finally:
        b.close()


def _manual_greedy(model, n: int) -> list[int]:
    kv = KVCache(model.cache_config(pool_bytes=1 << 21))
    with torch.inference_mode():
        sid = kv.open_session()
        logits, out = model.prefill(list(PROMPT), kv, sid), []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model.forward_cached(out[-1:], kv, sid)[-1]
    return out


def test_greedy_equals_the_plain_decode_loop(model, backend):
    (h,) = backend.submit(GenerationRequest(PROMPT, 12))
    assert list(h.tokens(30)) == _manual_greedy(model, 12)
    assert (h.finish_reason, h.prompt_tokens, h.model_version) == ("length", len(PROMPT), 0)


def test_seeded_forks_repeat_and_share_the_tenants_prefix(backend):
    req = GenerationRequest(PROMPT, 10, Sampling(1.0), tenant="a", n=2, seeds=(5, 6))
    first = [list(h.tokens(30)) for h in backend.submit(req)]
    again = backend.submit(req)
    assert [list(h.tokens(30)) for h in again] == first and first[0] != first[1]
    assert all(h.cached_prompt_tokens >= 32 for h in again)  # the first request's blocks
    (other,) = backend.submit(GenerationRequest(PROMPT, 1, tenant="b"))
    list(other.tokens(30))
    assert other.cached_prompt_tokens == 0  # another tenant's namespace


def test_stop_ids_end_the_sample_unyielded(model, backend):
    greedy = _manual_greedy(model, 12)
    k = next(i for i, t in enumerate(greedy) if t not in greedy[:i] and i > 0)
    (h,) = backend.submit(GenerationRequest(PROMPT, 12, stop_token_ids=frozenset({greedy[k]})))
    assert list(h.tokens(30)) == greedy[:k] and h.finish_reason == "stop"


class _FailingModel:
    """The model, but ``forward_cached`` raises CacheFullError from its ``fail_at``-th call on
    (or blocks on ``gate`` first)."""

    def __init__(self, inner, fail_at: int | None = None, gate: threading.Event | None = None):
        self.inner, self.fail_at, self.gate, self.calls = inner, fail_at, gate, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_cached(self, tokens, cache, sid):
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise CacheFullError("full")
        return self.inner.forward_cached(tokens, cache, sid)


def test_cache_full_mid_request_is_an_error_handle_and_frees_its_sessions(model):
    kv = KVCache(model.cache_config(pool_bytes=1 << 21))
    b = SerialBackend(_FailingModel(model, fail_at=4), kv)
    try:
        hs = b.submit(GenerationRequest(PROMPT, 20, n=2))
        got = [list(h.tokens(30)) for h in hs]
        assert all(h.finish_reason == "error" and "full" in h.error for h in hs)
        assert 0 < len(got[0]) < 20 and kv.sessions() == []
        b.model.fail_at = None  # the worker goes on with the next request
        (h,) = b.submit(GenerationRequest(PROMPT, 3))
        assert len(list(h.tokens(30))) == 3 and h.finish_reason == "length"
    finally:
        b.close()


def test_cancel_and_close_finish_handles_and_join_the_worker(model):
    gate = threading.Event()
    kv = KVCache(model.cache_config(pool_bytes=1 << 21))
    b = SerialBackend(_FailingModel(model, gate=gate), kv)
    (running,) = b.submit(GenerationRequest(PROMPT, 50))
    (queued,) = b.submit(GenerationRequest(PROMPT, 50))
    running.cancel()
    closer = threading.Thread(target=b.close)
    closer.start()  # the worker is held in its first decode step until the gate opens
    try:
        assert b._closed.wait(30)
    finally:
        gate.set()
        closer.join(30)
    assert len(list(running.tokens(30))) <= 1 and running.finish_reason == "cancelled"
    assert queued.finish_reason == "cancelled" and not b._worker.is_alive()
    assert kv.sessions() == []
    with pytest.raises(RuntimeError):
        b.submit(GenerationRequest(PROMPT, 1))


def test_a_prompt_longer_than_the_context_is_refused(model, backend):
    with pytest.raises(ValueError, match="at most 128"):
        backend.submit(GenerationRequest(tuple(range(200)), 1))
