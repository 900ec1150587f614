"""A short soak of the generation backends in process: after many mixed requests (shared
prefixes that fill and evict the prefix cache, ``n > 1`` forks, sampled ones, consumers that
walk away mid-stream, requests past their deadline) nothing of a request is left behind --
no handle object alive, no cache session open, no block referenced, the scheduler's queues
empty, the cache's bookkeeping bounded by its pool -- and closing the backend leaves the
thread count where it was. The HTTP-level soak is ``experiments.serve_soak``
(``tests/experiments/test_serve_soak.py``); no timing is asserted anywhere.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import pytest
import torch

from cache import KVCache
from node.engine.generation import GenerationRequest
from node.models.byte_model import ModelConfig, TinyTransformer
from node.engine.scheduler import SchedulerConfig
from node.engine.scheduler_backend import ScheduledBackend
from node.engine.serial_backend import SerialBackend
from node.engine.sessions import Sampling

BLOCK, POOL_BLOCKS = 8, 48


@pytest.fixture(scope="module", autouse=True)
def _single_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig(n_layers=2, n_heads=2, d_model=32, context_len=256)).eval()


def _cache(model) -> KVCache:
    probe = model.cache_config(block_size=BLOCK, tail_granule=0)
    return KVCache(model.cache_config(block_size=BLOCK, tail_granule=0,
                                      pool_bytes=POOL_BLOCKS * probe.block_bytes_fp32,
                                      managed_block_bytes=probe.block_bytes_fp32))


def _requests(n: int, seed: int) -> list[tuple[GenerationRequest, str]]:
    """(request, what its consumer does): ``read`` all, ``walk`` away after one token
    (cancel), ``late`` (a deadline already past)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(2 * BLOCK)] for _ in range(5)]
    out = []
    for i in range(n):
        prompt = tuple(rng.choice(prefixes) + [rng.randrange(256)
                                               for _ in range(rng.randrange(3, 40))])
        kind = rng.choice(["read", "read", "read", "fork", "sampled", "walk", "late"])
        req = GenerationRequest(
            prompt, rng.randrange(2, 16),
            Sampling(0.8, 0.9) if kind in ("fork", "sampled") else Sampling(),
            tenant=f"t{i % 3}", n=rng.randrange(2, 4) if kind == "fork" else 1,
            deadline=0.0 if kind == "late" else None)
        out.append((req, "walk" if kind == "walk" else "read"))
    return out


def _soak(backend, requests) -> list[weakref.ref]:
    """Every request through ``backend``, consumed as its kind says; weak references to every
    handle (the test drops the handles themselves)."""
    refs = []
    for req, consumer in requests:
        handles = backend.submit(req)
        if consumer == "walk":
            next(handles[0].tokens(timeout=30), None)
            for h in handles:
                h.cancel()
        for h in handles:
            for _ in h.tokens(timeout=30):
                pass
            assert h.finish_reason in ("stop", "length", "cancelled", "timeout"), h.error
            refs.append(weakref.ref(h))
        del handles, h
    return refs


def _alive_after_settling(refs: list, wait_s: float = 10.0) -> list:
    """The handles still alive once the worker has left its last request: a handle finishes
    (the client sees its end) a moment before the worker drops its reference, a moment a
    loaded machine stretches; a leak keeps them however long we wait."""
    deadline = time.monotonic() + wait_s
    while True:
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        del alive
        time.sleep(0.05)


def _at_rest(kv: KVCache) -> dict:
    st = kv.stats()
    return {"sessions": kv.sessions(), "referenced": st["blocks_referenced"],
            "used_within_pool": st["blocks_used"] <= POOL_BLOCKS}


@pytest.mark.parametrize("kind", ["scheduler", "serial"])
def test_a_soak_leaves_nothing_of_its_requests_behind(model, kind):
    threads_before = threading.active_count()
    kv = _cache(model)
    backend = (ScheduledBackend(model, kv, SchedulerConfig(max_running=4), model_id="soak")
               if kind == "scheduler" else SerialBackend(model, kv, model_id="soak"))
    try:
        refs = _soak(backend, _requests(60, seed=1))
        alive = _alive_after_settling(refs)
        assert alive == [], f"{len(alive)} of {len(refs)} handles outlive their requests"
        assert _at_rest(kv) == {"sessions": [], "referenced": 0, "used_within_pool": True}
        if kind == "scheduler":
            s = backend.scheduler
            assert s.waiting == [] and s.running == []
            assert backend.gauges()["kv"]["sessions_open"] == 0
        more = _soak(backend, _requests(60, seed=2))  # a second round: still nothing kept
        assert _alive_after_settling(more) == []
        assert _at_rest(kv) == {"sessions": [], "referenced": 0, "used_within_pool": True}
    finally:
        backend.close()
    assert threading.active_count() == threads_before
