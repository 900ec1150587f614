"""The serving agent beside a training node: two processes, one cache directory.

The test process is the trainer (a CacheNode on the directory, writing parameters back);
``python -m node.serve`` is the second agent. Every reply carries the model version it was
computed under, and is checked token for token against a cache-free decode under exactly
those parameters, so a token computed over stale K/V (or with stale weights) fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from crypto import write_secret_file
from node.cache_node import CacheNode, NodeSpec
from node.model import TinyTransformer
from node.tasks import LM_MODEL

KEY = bytes(range(1, 33))
ROOT = Path(__file__).resolve().parents[2]


def _call(port: int, path: str, body: dict | None = None, method: str | None = None) -> dict:
    """One JSON request: POST with a body, GET without (or ``method``)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def served(tmp_path):
    """(trainer node, port, serve process) on one cache directory; the server stopped by pid."""
    cache_dir = tmp_path / "kv-cache"
    write_secret_file(tmp_path / "kv-cache.key", KEY)
    node = CacheNode(NodeSpec(0, 5, "lm"), cache_dir=cache_dir, cache_key=KEY)
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "node.serve", "--cache-dir", str(cache_dir),
                             "--port", "0", "--ready-file", str(ready)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "node.serve did not start"
            time.sleep(0.05)
        yield node, json.loads(ready.read_text())["port"], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        node.release()


@torch.no_grad()
def _fresh_reply(model: TinyTransformer, prompt: bytes, n: int) -> bytes:
    """Greedy bytes from full forwards: no cache at all."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return bytes(seq[len(prompt):])


def _model(params: dict[str, torch.Tensor]) -> TinyTransformer:
    model = TinyTransformer(LM_MODEL).eval()
    model.load_state_dict(params)
    return model


def _client(port: int, stop: threading.Event, log: list) -> None:
    """Chat turns in a loop: a long session (its K/V outlive write-backs) and one-turn ones."""
    system, history, sid = b"sys: ", b"", None
    i = 0
    while not stop.is_set():
        if sid is None or len(history) > 90:
            sid, history = _call(port, "/v1/sessions", {"system": system.decode()})["session"], system
        text = f"q{i % 10}? ".encode()
        t0 = time.monotonic()
        r = _call(port, f"/v1/sessions/{sid}", {"text": text.decode(), "max_new_tokens": 6})
        reply = bytes.fromhex(r["reply_hex"])
        log.append((t0, history + text, reply, r["version"]))
        history += text + reply
        i += 1


def test_no_reply_is_computed_with_stale_kv_after_a_write_back(served):
    node, port, proc = served
    params = {0: _model(node.params())}
    done: dict[int, float] = {}
    log: list = []
    stop = threading.Event()
    client = threading.Thread(target=_client, args=(port, stop, log), daemon=True)
    client.start()
    try:
        for v in (1, 2, 3):
            time.sleep(0.4)
            node.apply_mean_update(np.random.default_rng(v).normal(0, 0.05, node.layout.size), v)
            done[v] = time.monotonic()
            params[v] = _model(node.params())
        time.sleep(0.6)
    finally:
        stop.set()
        client.join(30)
    stats = _call(port, "/v1/stats")
    assert node.agents_invalidated == 3  # every write-back had to invalidate the server
    assert stats["invalidations"] == 3 and stats["version"] == 3
    assert {v for *_, v in log} >= {0, 3} and len(log) > 8
    for t0, prompt, reply, version in log:
        newest = max([v for v, t in done.items() if t < t0], default=0)
        assert version >= newest, "a reply started after a completed write-back used older weights"
        assert reply == _fresh_reply(params[version], prompt, len(reply)), (version, prompt)


def test_bad_requests_get_clear_errors_and_the_agent_goes_on(served):
    _, port, _ = served
    for path, body, code in (("/v1/sessions/chat-99", {"text": "x"}, 404),
                             ("/v1/sessions", {"system": 5}, 400),
                             ("/v1/nowhere", {}, 404)):
        with pytest.raises(urllib.error.HTTPError) as info:
            _call(port, path, body)
        assert info.value.code == code and "error" in json.loads(info.value.read())
    sid = _call(port, "/v1/sessions", {"system": "s"})["session"]
    with pytest.raises(urllib.error.HTTPError) as info:
        _call(port, f"/v1/sessions/{sid}", {"text": "x", "max_new_tokens": 10**6})
    assert info.value.code == 400
    assert _call(port, f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 2})["version"] == 0
    assert _call(port, f"/v1/sessions/{sid}", method="DELETE") == {"closed": sid}
    with pytest.raises(urllib.error.HTTPError) as info:
        _call(port, f"/v1/sessions/{sid}", {"text": "x"})
    assert info.value.code == 404  # closed


def test_the_agents_cache_is_read_and_tuned_from_another_process(served, tmp_path):
    _, port, _ = served
    sid = _call(port, "/v1/sessions", {"system": "s"})["session"]
    _call(port, f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 2})
    live = tmp_path / "kv-cache" / "serve"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "cache"]
    out = subprocess.run([*cli, "set", "evict_batch", "24", "--dir", str(live)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "16" in out.stdout and "24" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*cli, "stats", "--dir", str(live)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["tunables"]["evict_batch"] == 24


def test_stats_on_the_cache_dir_reports_the_idle_agent_live_until_it_stops(served, tmp_path):
    """``python -m cache stats --dir <cache-dir>`` (the directory node.serve was given), with
    the trainer's engine let go and the agent idle: the agent's engine, live, exit 0 (its
    snapshot is in <cache-dir>/serve); once the agent stopped, exit 1."""
    node, _, proc = served
    node.release()  # the trainer between messages: its snapshot says released
    cache_dir = tmp_path / "kv-cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "cache", "stats", "--dir", str(cache_dir)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["live"] is True and snap["pid"] == proc.pid, snap
    assert snap["dir"] == str(cache_dir / "serve")
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no live engine" in out.stderr, out.stderr
