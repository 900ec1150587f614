"""The OpenAI server's cache tiers by flags (``node.serving.serving_cache``), and two real server
processes of one node sharing prefixes through one real Redis server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.hang_guard import HANG_GUARD_S

from tests.redis_server import running_redis

KEY = bytes(range(32))
TOKEN = "t0ken-for-the-redis-tests"
ROOT = Path(__file__).resolve().parents[3]
PROMPT = ("You are a careful assistant of the fedkv node. Answer briefly and cite the "
          "documentation when you can, please.")  # 110 bytes: 6 full blocks of 16 (context 128)


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


def _options(**kw):
    from node.serving.serving_cache import ServingCacheOptions
    return ServingCacheOptions(pool_bytes=1 << 20, **kw)


def _model():
    import torch
    from node.tasks.tasks import lm_model
    torch.manual_seed(0)  # what the server does (--seed)
    return lm_model()


def test_the_default_is_the_hot_pool_alone_and_warm_comes_by_flag():
    from node.serving.serving_cache import build_serving_cache
    assert build_serving_cache(_options(), _model(), "fedkv-byte").blocks.tiers is None
    kv = build_serving_cache(_options(warm_bytes=1 << 20), _model(), "fedkv-byte")
    assert kv.blocks.tiers.warm_bytes == 1 << 20 and kv.store is None


def test_a_cold_tier_without_the_nodes_key_is_refused_with_the_flag_to_give(redis_server):
    from node.serving.serving_cache import build_serving_cache
    with pytest.raises(SystemExit, match="--kv-key-file"):
        build_serving_cache(_options(redis_url=redis_server.url), _model(), "fedkv-byte")


def test_disk_and_redis_together_chain_disk_first(tmp_path, redis_server):
    from cache.chained_store import ChainedStore
    from crypto import write_secret_file
    from node.serving.serving_cache import build_serving_cache
    key_file = write_secret_file(tmp_path / "kv.key", KEY)
    kv = build_serving_cache(_options(cold_dir=tmp_path / "cold", redis_url=redis_server.url,
                                      key_file=key_file), _model(), "fedkv-byte")
    try:
        assert isinstance(kv.store, ChainedStore)
    finally:
        kv.close()


def test_other_weights_get_another_namespace():
    import torch
    from node.serving.serving_cache import weights_digest
    a, b = _model(), _model()
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():
        next(b.parameters()).add_(1e-3)
    assert weights_digest(a) != weights_digest(b)


def _start(tmp_path: Path, name: str, url: str, key_file: Path, tokens: Path) -> tuple:
    ready = tmp_path / f"{name}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.serving.openai_api", "--port", "0", "--ready-file", str(ready),
         "--token-file", str(tokens), "--kv-redis", url, "--kv-key-file", str(key_file),
         "--backend", "serial"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return proc, ready


def _wait_ready(proc, ready: Path) -> int:
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "node.serving.openai_api did not start"
        time.sleep(0.05)
    return json.loads(ready.read_text())["port"]


def _complete(port: int) -> None:
    body = json.dumps({"model": "fedkv-byte", "prompt": PROMPT, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def _redis_hits(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'fedkv_kv_cache_hit_blocks(?:_total)?\{tier="redis"\} ([0-9.e+]+)', text)
    return int(float(m.group(1))) if m else 0


def _settled(server, want: int) -> int:
    """Keys in Redis once the first process's writer has drained (at least ``want``)."""
    r, deadline = server.client(), time.monotonic() + 30
    while r.dbsize() < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return r.dbsize()


def _nothing_names(server, prompt: str) -> None:
    """No Redis key or value holds 8 bytes of the prompt, as text or as the byte model's token
    ids packed in 32 or 64 bits."""
    from array import array
    r = server.client()
    blobs = [b for k in r.scan_iter() for b in (k, r.get(k))]
    text = prompt.encode()
    for fmt in ("i", "q"):
        ids = array(fmt, list(text)).tobytes()
        n = 4 * array(fmt).itemsize
        windows = {ids[i:i + n] for i in range(0, len(ids) - n, array(fmt).itemsize)}
        windows |= {text[i:i + 8] for i in range(len(text) - 8)}
        assert not any(w in b for w in windows for b in blobs)


@pytest.mark.slow
def test_two_server_processes_share_a_prefix_through_redis(tmp_path, redis_server):
    from crypto import write_secret_file
    key_file = write_secret_file(tmp_path / "kv.key", KEY)
    tokens = tmp_path / "serve-token"
    tokens.write_text(f"alice:{TOKEN}\n")
    tokens.chmod(0o600)
    procs = [_start(tmp_path, n, redis_server.url, key_file, tokens) for n in ("first", "second")]
    try:
        ports = [_wait_ready(*p) for p in procs]
        _complete(ports[0])
        assert _settled(redis_server, 6) >= 6  # its prompt's blocks, written through
        assert _redis_hits(ports[1]) == 0
        _complete(ports[1])
        assert _redis_hits(ports[1]) == 6  # the second process restored them, not recomputed
        _nothing_names(redis_server, PROMPT)
    finally:
        for proc, _ in procs:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_redis_faults_are_counted_in_metrics_not_failed(tmp_path, redis_server):
    """A request while Redis is down succeeds (its blocks are recomputed) and /metrics counts
    the shared tier's events: misses while up, a fault once it is gone."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from crypto import write_secret_file
    from node.engine.generation import GenerationRequest
    from node.engine.scheduler_backend import ScheduledBackend
    from node.serving.serve_metrics import ServeMetrics
    from node.serving.serving_cache import build_serving_cache

    def events() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {s.labels["event"]: s.value for f in text_string_to_metric_families(text)
                if f.name == "fedkv_kv_redis_events" for s in f.samples}

    model = _model().eval()
    kv = build_serving_cache(_options(redis_url=redis_server.url, redis_timeout_s=0.2,
                                      key_file=write_secret_file(tmp_path / "kv.key", KEY)),
                             model, "fedkv-byte")
    backend = ScheduledBackend(model, kv)
    metrics = ServeMetrics(backend)
    try:
        prompt = tuple(PROMPT.encode())
        assert list(backend.submit(GenerationRequest(prompt, 4))[0].tokens(timeout=HANG_GUARD_S))
        up = events()
        assert up.get("misses", 0) > 0 and up.get("errors", 0) == 0, up
        redis_server.kill()
        other = tuple(b"another prompt, so the hot tier has none of it: " + PROMPT.encode()[:60])
        h = backend.submit(GenerationRequest(other, 4))[0]
        assert len(list(h.tokens(timeout=HANG_GUARD_S))) == 4 and h.finish_reason == "length"
        down = events()
        faults = sum(down.get(k, 0) for k in ("errors", "timeouts", "unavailable", "skipped"))
        assert faults > 0, down
    finally:
        backend.close()
        kv.close()
