"""node.engine.openmp_pool: the thread that runs forwards holds the only OpenMP workers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cache import KVCache
from node.engine import openmp_pool
from node.engine.generation import GenerationRequest
from node.engine.scheduler_backend import ScheduledBackend
from node.engine.serial_backend import SerialBackend
from node.tasks.tasks import lm_model

ROOT = Path(__file__).resolve().parents[3]

# A fresh process: which threads exist is then this script's doing alone.
FREES_THE_WORKER = """
import os, time, torch
from node.engine import openmp_pool
torch.set_num_threads(2)
tasks = lambda: len(os.listdir('/proc/self/task'))
before = tasks()
torch.ones(1 << 22).sum()  # a parallel region: this thread's pool gains a worker
with_pool = tasks()
released = openmp_pool.release_pool()
deadline = time.monotonic() + 10
while tasks() >= with_pool and time.monotonic() < deadline:
    time.sleep(0.01)
print(released, before, with_pool, tasks())
"""


def test_release_pool_frees_the_calling_threads_workers():
    if (os.cpu_count() or 1) < 2 or not Path("/proc/self/task").is_dir():
        pytest.skip("needs Linux and two CPUs")
    out = subprocess.run([sys.executable, "-c", FREES_THE_WORKER], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    if out[0] != "True":
        pytest.skip("no libgomp with OpenMP 5.0's pause in this torch")
    before, with_pool, after = map(int, out[1:])
    assert with_pool == before + 1  # the region left an idle worker behind
    assert after == before


@pytest.fixture
def released(monkeypatch):
    """The names of the threads that called ``release_pool``, in order."""
    names: list[str] = []
    lock = threading.Lock()

    def record() -> bool:
        with lock:
            names.append(threading.current_thread().name)
        return True
    monkeypatch.setattr(openmp_pool, "release_pool", record)
    return names


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("make", [
    lambda m, c: ScheduledBackend(m, c, idle_wait_s=0.01),
    lambda m, c: SerialBackend(m, c)], ids=["scheduler", "serial"])
def test_a_backend_frees_its_builders_workers_and_its_own_when_idle(make, released, one_thread):
    model = lm_model(seed=0).eval()
    backend = make(model, KVCache(model.cache_config(pool_bytes=1 << 21)))
    try:
        builder = threading.current_thread().name
        assert builder in released  # the constructor handed the forwards to its thread
        worker = backend._thread.name if hasattr(backend, "_thread") else backend._worker.name
        _wait_for(lambda: worker in released)  # idle from the start
        idle_before = released.count(worker)
        (h,) = backend.submit(GenerationRequest(tuple(b"some prompt"), 4))
        assert len(list(h.tokens(timeout=30))) == 4
        _wait_for(lambda: released.count(worker) > idle_before)  # idle again after the request
    finally:
        backend.close()
