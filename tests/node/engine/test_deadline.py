"""Issue 30: a generation request's deadline is honoured inside generation, on both backends.

A request whose ``deadline`` (a ``time.monotonic()`` instant) has passed is finished
``timeout`` between decode steps and prefill chunks -- not only when the consumer next waits for
a token -- and its KV blocks are freed; the backend goes on with the next request. No timing
is asserted: the model is slowed so the undeadlined request would run far past the deadline,
and what is checked is how the request ended and what it holds.
"""

from __future__ import annotations

import time

import pytest

from cache import KVCache
from node.engine.generation import GenerationRequest
from node.engine.scheduler_backend import ScheduledBackend
from node.engine.serial_backend import SerialBackend
from node.tasks.tasks import lm_model

PROMPT = tuple(b"A prompt of more than two blocks of sixteen bytes each.")
BACKENDS = {"serial": SerialBackend, "scheduler": ScheduledBackend}


class _Slowed:
    """The model, each forward 30 ms slower: 60 tokens take far longer than a 0.1 s deadline."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name.startswith("forward"):
            def slow(*a, **kw):
                time.sleep(0.03)
                return attr(*a, **kw)
            return slow
        return attr


@pytest.fixture(params=list(BACKENDS))
def served(request, one_thread):
    model = _Slowed(lm_model(seed=0).eval())
    kv = KVCache(model.cache_config(pool_bytes=1 << 21))
    backend = BACKENDS[request.param](model, kv)
    try:
        yield backend, kv
    finally:
        backend.close()


def test_a_request_past_its_deadline_is_never_decoded(served):
    backend, kv = served
    hs = backend.submit(GenerationRequest(PROMPT, 20, n=2, deadline=time.monotonic() - 1))
    assert [list(h.tokens(30)) for h in hs] == [[], []]
    assert all(h.finish_reason == "timeout" for h in hs) and kv.sessions() == []


def test_a_deadline_ends_a_running_request_between_steps_and_frees_its_blocks(served):
    backend, kv = served
    (h,) = backend.submit(GenerationRequest(PROMPT, 60, deadline=time.monotonic() + 0.1))
    got = list(h.tokens(30))
    assert h.finish_reason == "timeout" and len(got) < 60 and kv.sessions() == []
    (after,) = backend.submit(GenerationRequest(PROMPT, 3))  # the backend goes on
    assert len(list(after.tokens(30))) == 3 and after.finish_reason == "length"
