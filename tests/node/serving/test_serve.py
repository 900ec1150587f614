"""The serving agent beside a training node: two processes, one cache directory.

The test process is the trainer (a CacheNode on the directory, writing parameters back);
``python -m node.serving.serve`` is the second agent. Every reply carries the model version it was
computed under, and is checked token for token against a cache-free decode under exactly
those parameters, so a token computed over stale K/V (or with stale weights) fails the test.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from crypto import write_secret_file
from node.cache_node import CacheNode, NodeSpec
from node.models.byte_model import TinyTransformer
from node.tasks.tasks import LM_MODEL
from tests.hang_guard import HANG_GUARD_S

KEY = bytes(range(1, 33))
ROOT = Path(__file__).resolve().parents[3]
SID = re.compile(r"[0-9a-f]{32}")


@dataclass
class Agent:
    """A running ``node.serving.serve``: its port and process, and two tenants' tokens."""

    port: int
    proc: subprocess.Popen
    tokens: dict[str, str]
    scheme: str = "http"
    context: ssl.SSLContext | None = None

    def call(self, path: str, body: dict | None = None, method: str | None = None,
             tenant: str | None = "alice", token: str | None = None, timeout: float = 30) -> dict:
        """One JSON request as ``tenant`` (or with ``token``; neither: no Authorization):
        POST with a body, GET without (or ``method``); an HTTP error raises HTTPError."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        token = token if token is not None else self.tokens.get(tenant) if tenant else None
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"{self.scheme}://127.0.0.1:{self.port}{path}", data=data,
                                     method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout, context=self.context) as r:
            return json.loads(r.read())

    def status(self, *args, **kwargs) -> tuple[int, dict]:
        """``call``'s HTTP status and JSON body, error or not."""
        try:
            return 200, self.call(*args, **kwargs)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def start_agent(tmp_path):
    """``start_agent(*flags)``: a trainer node on ``tmp_path/kv-cache`` (made once) and a
    ``node.serving.serve`` agent on it; tenants alice and bob in the default token file
    ``kv-cache/../serve-token`` unless ``write_tokens=False``. Every agent is stopped by pid."""
    cache_dir = tmp_path / "kv-cache"
    write_secret_file(tmp_path / "kv-cache.key", KEY)
    node = CacheNode(NodeSpec(0, 5, "lm"), cache_dir=cache_dir, cache_key=KEY)
    procs: list[subprocess.Popen] = []

    def start(*flags: str, write_tokens: bool = True, scheme: str = "http",
              context: ssl.SSLContext | None = None, startup_s: float = HANG_GUARD_S) -> Agent:
        tokens = {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}
        if write_tokens:
            path = tmp_path / "serve-token"
            path.write_text("".join(f"{t}:{tok}\n" for t, tok in tokens.items()))
            path.chmod(0o600)
        ready = tmp_path / f"ready-{len(procs)}.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "node.serving.serve", "--cache-dir", str(cache_dir),
                                 "--port", "0", "--ready-file", str(ready), *flags], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(proc)
        deadline = time.monotonic() + startup_s
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "node.serving.serve did not start"
            time.sleep(0.05)
        return Agent(json.loads(ready.read_text())["port"], proc, tokens, scheme, context)

    start.node = node
    try:
        yield start
    finally:
        for proc in procs:
            _stop(proc)
        node.release()


@pytest.fixture
def served(start_agent):
    """(trainer node, agent) on one cache directory, the agent with its default flags."""
    return start_agent.node, start_agent()


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


def _client(agent: Agent, stop: threading.Event, log: list) -> None:
    """Chat turns in a loop: a long session (its K/V outlive write-backs) and one-turn ones."""
    system, history, sid = b"sys: ", b"", None
    i = 0
    while not stop.is_set():
        if sid is None or len(history) > 90:
            if sid is not None:  # close it: the tenant's session quota would refuse the 17th
                agent.call(f"/v1/sessions/{sid}", method="DELETE")
            sid, history = agent.call("/v1/sessions", {"system": system.decode()})["session"], system
        text = f"q{i % 10}? ".encode()
        t0 = time.monotonic()
        r = agent.call(f"/v1/sessions/{sid}", {"text": text.decode(), "max_new_tokens": 6})
        reply = bytes.fromhex(r["reply_hex"])
        log.append((t0, history + text, reply, r["version"]))
        history += text + reply
        i += 1


def test_no_reply_is_computed_with_stale_kv_after_a_write_back(served):
    node, agent = served
    params = {0: _model(node.params())}
    done: dict[int, float] = {}
    log: list = []
    stop = threading.Event()
    client = threading.Thread(target=_client, args=(agent, stop, log), daemon=True)
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
    stats = agent.call("/v1/stats")
    assert node.agents_invalidated == 3  # every write-back had to invalidate the server
    assert stats["invalidations"] == 3 and stats["version"] == 3
    assert {v for *_, v in log} >= {0, 3} and len(log) > 8
    for t0, prompt, reply, version in log:
        newest = max([v for v, t in done.items() if t < t0], default=0)
        assert version >= newest, "a reply started after a completed write-back used older weights"
        assert reply == _fresh_reply(params[version], prompt, len(reply)), (version, prompt)


def test_bad_requests_get_clear_errors_and_the_agent_goes_on(served):
    _, agent = served
    for path, body, code in (("/v1/sessions/" + "0" * 32, {"text": "x"}, 404),
                             ("/v1/sessions", {"system": 5}, 400),
                             ("/v1/nowhere", {}, 404)):
        status, answer = agent.status(path, body)
        assert status == code and "error" in answer
    sid = agent.call("/v1/sessions", {"system": "s"})["session"]
    assert agent.status(f"/v1/sessions/{sid}", {"text": "x", "max_new_tokens": 10**6})[0] == 400
    assert agent.call(f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 2})["version"] == 0
    assert agent.call(f"/v1/sessions/{sid}", method="DELETE") == {"closed": sid}
    assert agent.status(f"/v1/sessions/{sid}", {"text": "x"})[0] == 404  # closed


def test_the_agents_cache_is_read_and_tuned_from_another_process(served, tmp_path):
    _, agent = served
    sid = agent.call("/v1/sessions", {"system": "s"})["session"]
    agent.call(f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 2})
    live = tmp_path / "kv-cache" / "serve"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "cache"]
    out = subprocess.run([*cli, "set", "evict_batch", "24", "--dir", str(live)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0 and "16" in out.stdout and "24" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*cli, "stats", "--dir", str(live)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["tunables"]["evict_batch"] == 24


def test_stats_on_the_cache_dir_reports_the_idle_agent_live_until_it_stops(served, tmp_path):
    """``python -m cache stats --dir <cache-dir>`` (the directory node.serving.serve was given), with
    the trainer's engine let go and the agent idle: the agent's engine, live, exit 0 (its
    snapshot is in <cache-dir>/serve); once the agent stopped, exit 1."""
    node, agent = served
    proc = agent.proc
    node.release()  # the trainer between messages: its snapshot says released
    cache_dir = tmp_path / "kv-cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "cache", "stats", "--dir", str(cache_dir)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["live"] is True and snap["pid"] == proc.pid, snap
    assert snap["dir"] == str(cache_dir / "serve")
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 1 and "no live engine" in out.stderr, out.stderr


# -- a shared host: every attack of issue 20 (Trust II) deliverable 3, as a test ----------------

def test_a_request_without_a_valid_token_gets_401_and_nothing_else(served):
    """No token, a wrong one, another scheme, a token with a suffix: 401, one fixed body, for
    every path (a caller without a token cannot even tell which paths exist)."""
    _, agent = served
    sid = agent.call("/v1/sessions", {"system": "s"})["session"]
    good = agent.tokens["alice"]
    for token in (None, "", secrets.token_urlsafe(32), good + "x", good[:-1]):
        for path, body, method in (("/v1/stats", None, None), ("/v1/sessions", {"system": "s"}, None),
                                   (f"/v1/sessions/{sid}", {"text": "x"}, None),
                                   (f"/v1/sessions/{sid}", None, "DELETE"), ("/v1/nowhere", None, None)):
            assert agent.status(path, body, method, tenant=None, token=token) == \
                (401, {"error": "unauthorized"}), (token, path, method)
    for header in (f"Basic {good}", good, f"Bearer  {good} extra"):
        req = urllib.request.Request(f"http://127.0.0.1:{agent.port}/v1/stats",
                                     headers={"Authorization": header})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 401 and info.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert agent.call(f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 2})["version"] == 0


def test_another_tenant_cannot_continue_read_or_delete_a_session(served):
    """Session ids are random 128-bit hex, bound to their tenant: bob gets the answer a
    never-issued id gets (no oracle), and alice's conversation is untouched."""
    node, agent = served
    ids = [agent.call("/v1/sessions", {"system": "You are alice's. "})["session"] for _ in range(3)]
    assert all(SID.fullmatch(s) for s in ids) and len(set(ids)) == 3, ids
    sid = ids[0]
    first = agent.call(f"/v1/sessions/{sid}", {"text": "my pin is ", "max_new_tokens": 4})
    never = agent.status("/v1/sessions/" + secrets.token_hex(16), {"text": "x"}, tenant="bob")
    assert never[0] == 404
    for body, method in (({"text": "and? ", "max_new_tokens": 8}, None), ({"text": ""}, None),
                         (None, "DELETE"), (None, "GET")):
        assert agent.status(f"/v1/sessions/{sid}", body, method, tenant="bob") == never, method
    assert agent.status("/v1/sessions/chat-0", {"text": "x"}, tenant="bob") == never
    second = agent.call(f"/v1/sessions/{sid}", {"text": "ok ", "max_new_tokens": 5})
    history = b"You are alice's. my pin is " + bytes.fromhex(first["reply_hex"]) + b"ok "
    assert bytes.fromhex(second["reply_hex"]) == _fresh_reply(_model(node.params()), history, 5)
    assert agent.call(f"/v1/sessions/{sid}", method="DELETE") == {"closed": sid}


def test_an_idle_connection_does_not_block_other_clients(served):
    """An idle connection, one stuck in its headers (slow loris) and one that never sends the
    body it announced: another client still completes its requests within seconds."""
    _, agent = served
    stuck = []
    try:
        for data in (b"", b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n",
                     f"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{agent.tokens['bob']}\r\nContent-Length: 100\r\n\r\n{{".encode()):
            s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
            s.sendall(data)
            stuck.append(s)
        t0 = time.monotonic()
        sid = agent.call("/v1/sessions", {"system": "hello "}, timeout=5)["session"]
        agent.call(f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 4}, timeout=5)
        assert agent.call("/v1/stats", timeout=5)["turns"] == 1
        assert time.monotonic() - t0 < 5
    finally:
        for s in stuck:
            s.close()


def test_the_agent_drops_a_connection_idle_past_its_socket_timeout(start_agent):
    agent = start_agent("--socket-timeout", "1")
    with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as s:
        s.sendall(b"GET /v1/stats HTTP/1.1\r\n")  # and nothing more
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the agent, not by our timeout
        assert time.monotonic() - t0 < 5
    assert agent.call("/v1/stats")["tenant"] == "alice"


def test_a_session_flood_gets_429_after_the_quota_and_others_are_still_served(served):
    _, agent = served
    ids = [agent.call("/v1/sessions", {"system": "flood "})["session"] for _ in range(16)]
    status, body = agent.status("/v1/sessions", {"system": "flood "})
    assert status == 429 and "16" in body["error"] and "quota" in body["error"], body
    bob = agent.call("/v1/sessions", {"system": "mine "}, tenant="bob")["session"]
    assert agent.call(f"/v1/sessions/{bob}", {"text": "hi", "max_new_tokens": 2}, tenant="bob")
    agent.call(f"/v1/sessions/{ids[0]}", method="DELETE")
    assert SID.fullmatch(agent.call("/v1/sessions", {"system": "flood "})["session"])
    assert agent.call("/v1/stats")["sessions"] == 16


def test_a_full_pool_answers_503_with_a_body_and_leaves_the_session_usable(start_agent):
    """A pool of 8 blocks (128 tokens): a session creation, a turn whose text and one whose
    reply need more get 503 and a clear error; the turn's session is as before (the reply cut
    short is rolled back), and goes on once blocks are free."""
    node = start_agent.node
    agent = start_agent("--pool-mib", "0.125")
    sid = agent.call("/v1/sessions", {"system": "You are a node. "})["session"]  # 1 block
    first = agent.call(f"/v1/sessions/{sid}", {"text": "hello", "max_new_tokens": 3})  # 2 blocks
    before = agent.call(f"/v1/sessions/{sid}")
    assert before["tokens"] == 24
    filler = agent.call("/v1/sessions", {"system": "f" * 90}, tenant="bob")["session"]  # 6 blocks
    for path, body in (("/v1/sessions", {"system": "g" * 40}),  # 3 blocks
                       (f"/v1/sessions/{sid}", {"text": "x" * 40, "max_new_tokens": 8}),  # text: 3
                       (f"/v1/sessions/{sid}", {"text": "xxxx", "max_new_tokens": 10})):  # reply's 5th
        status, answer = agent.status(path, body)
        assert status == 503 and "cache is full" in answer["error"], (path, body, answer)
        assert agent.call(f"/v1/sessions/{sid}") == before
    # a write-back drops every session's K/V; when recomputing them finds the pool full, the
    # conversation is kept (and recomputed by the next turn), not lost
    node.apply_mean_update(np.random.default_rng(1).normal(0, 0.05, node.layout.size), 1)
    filler2 = agent.call("/v1/sessions", {"system": "h" * 100}, tenant="bob")["session"]  # 7 blocks
    status, answer = agent.status(f"/v1/sessions/{sid}", {"text": "xxxx", "max_new_tokens": 10})
    assert status == 503 and "cache is full" in answer["error"], answer
    assert agent.call(f"/v1/sessions/{sid}") == before
    stats = agent.call("/v1/stats")
    assert stats["sessions"] == 1 and stats["cache_full"] == 4 and stats["turns"] == 1, stats
    for f in (filler, filler2):
        agent.call(f"/v1/sessions/{f}", method="DELETE", tenant="bob")
    r = agent.call(f"/v1/sessions/{sid}", {"text": "xxxx", "max_new_tokens": 10})
    history = b"You are a node. hello" + bytes.fromhex(first["reply_hex"]) + b"xxxx"
    assert r["version"] == 1
    assert bytes.fromhex(r["reply_hex"]) == _fresh_reply(_model(node.params()), history, 10)


def test_idle_sessions_expire_and_free_their_blocks(start_agent, tmp_path):
    agent = start_agent("--idle-expiry-s", "1.5")
    old = agent.call("/v1/sessions", {"system": "x" * 40})["session"]
    kept = agent.call("/v1/sessions", {"system": "kept "})["session"]
    for _ in range(6):  # kept busy; old idle
        time.sleep(0.5)
        agent.call(f"/v1/sessions/{kept}", {"text": "a", "max_new_tokens": 1})
    assert agent.status(f"/v1/sessions/{old}", {"text": "x"})[0] == 404
    stats = agent.call("/v1/stats")
    assert stats["sessions"] == 1 and stats["expired"] == 1, stats
    assert agent.call(f"/v1/sessions/{kept}")["tokens"] == 5 + 2 * 6
    time.sleep(2.5)  # now kept is idle too
    assert agent.call("/v1/stats")["expired"] == 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    live = tmp_path / "kv-cache" / "serve"
    deadline = time.monotonic() + 30  # the agent republishes its snapshot about once a second
    while True:
        out = subprocess.run([sys.executable, "-m", "cache", "stats", "--dir", str(live)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert out.returncode == 0, out.stderr
        engine = json.loads(out.stdout)["stats"]
        if engine["sessions_open"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert engine["sessions_open"] == 0 and engine["blocks_referenced"] == 0, engine


def test_stats_need_a_token_and_show_only_the_callers_tenant(served):
    _, agent = served
    for _ in range(2):
        sid = agent.call("/v1/sessions", {"system": "alice's prompt, secret " * 2})["session"]
        agent.call(f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 5})
    assert agent.status("/v1/stats", tenant=None) == (401, {"error": "unauthorized"})
    alice, bob = agent.call("/v1/stats"), agent.call("/v1/stats", tenant="bob")
    assert alice["tenant"] == "alice" and alice["sessions"] == 2 and alice["turns"] == 2
    assert alice["tokens"] == 10 and alice["prefix_hit_blocks"] == 2
    assert bob["tenant"] == "bob"
    assert {bob[k] for k in ("sessions", "turns", "tokens", "prefix_hit_blocks", "sessions_created")} == {0}
    assert set(alice) == set(bob)
    assert not any("rate" in k or "coherence" in k or "pid" in k for k in bob), sorted(bob)


def test_the_prefix_hit_side_channel_across_tenants_is_closed(served):
    """Alice's system prompt is cached; bob guesses it block by block. What bob can see --
    his own counters -- is the same for the right guess as for a wrong one; alice's own
    sessions still share the prompt's blocks."""
    _, agent = served
    secret = "You serve alice. Her PIN is 4711 and her key: abcd."  # 51 bytes: 3 full blocks
    agent.call("/v1/sessions", {"system": secret})
    seen = []
    for guess in (secret, secret[:5] + "X" + secret[6:], secret):  # block 0 right, then wrong
        before = agent.call("/v1/stats", tenant="bob")
        sid = agent.call("/v1/sessions", {"system": guess}, tenant="bob")["session"]
        after = agent.call("/v1/stats", tenant="bob")
        seen.append({k: after[k] - before[k] for k in after if isinstance(after[k], int)
                     and not isinstance(after[k], bool) and k not in ("version", "invalidations", "reloads")})
        agent.call(f"/v1/sessions/{sid}", method="DELETE", tenant="bob")
    assert seen[0] == seen[1], seen  # right and wrong guess look alike to bob
    assert seen[0]["prefix_hit_blocks"] == 0
    assert seen[2]["prefix_hit_blocks"] == 3  # bob's own earlier session: shared within bob
    before = agent.call("/v1/stats")["prefix_hit_blocks"]
    agent.call("/v1/sessions", {"system": secret})
    assert agent.call("/v1/stats")["prefix_hit_blocks"] - before == 3  # within alice: shared


def test_a_non_loopback_bind_is_refused_without_tls(tmp_path, capsys):
    from node.serving import serve
    base = ["--cache-dir", str(tmp_path / "kv-cache"), "--no-key", "--wait-s", "1"]
    for flags in (["--host", "0.0.0.0"], ["--host", "192.0.2.1"], ["--host", "::"],
                  ["--host", "example.org"], ["--host", "0.0.0.0", "--tls-cert", str(tmp_path / "c.pem")]):
        with pytest.raises(SystemExit) as info:
            serve._args(base + flags)
        assert info.value.code == 2 and "--tls-cert and --tls-key" in capsys.readouterr().err, flags
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert serve._args(base + ["--host", host]).host == host
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "node.serving.serve", *base, "--host", "0.0.0.0"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 2 and "without TLS" in out.stderr, out.stderr[-500:]
    assert not (tmp_path / "serve-token").exists()  # refused before anything was written


def test_tls_on_loopback_and_a_token_file_written_on_first_start(start_agent, tmp_path):
    """With --tls-cert/--tls-key the agent speaks TLS only (>= 1.2); with no token file it
    writes one: 0600, in a 0700 directory, a bare token for the tenant ``default``."""
    from federation.deploy.provisioning import make_tls
    ca, cert, key = make_tls(["127.0.0.1"])
    (tmp_path / "tls").mkdir(mode=0o700)
    for name, pem in (("ca.pem", ca), ("cert.pem", cert), ("key.pem", key)):
        (tmp_path / "tls" / name).write_bytes(pem)
    token_file = tmp_path / "secrets" / "serve-token"
    context = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.pem"))
    agent = start_agent("--tls-cert", str(tmp_path / "tls" / "cert.pem"), "--tls-key",
                        str(tmp_path / "tls" / "key.pem"), "--token-file", str(token_file),
                        write_tokens=False, scheme="https", context=context)
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert token_file.parent.stat().st_mode & 0o777 == 0o700
    token = token_file.read_text().strip()
    assert len(token) >= 43 and ":" not in token
    assert agent.call("/v1/stats", token=token)["tenant"] == "default"
    assert agent.status("/v1/stats", token=token + "x")[0] == 401
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(str(tmp_path / "tls" / "ca.pem"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        old.minimum_version = ssl.TLSVersion.TLSv1
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        Agent(agent.port, agent.proc, {}, "https", old).call("/v1/stats", token=token, timeout=5)
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        Agent(agent.port, agent.proc, {}).call("/v1/stats", token=token, timeout=5)  # plain HTTP
    assert agent.call("/v1/stats", token=token)["tenant"] == "default"  # still serving


# -- per-request options: max_tokens, temperature, top_p, stop, seed (issue 23, item 3) ------

def _turn(agent: Agent, sid: str, **body) -> dict:
    return agent.call(f"/v1/sessions/{sid}", body)


SYSTEM = "You are a fedkv node. "
BAD_OPTIONS = [  # (body fields, the field the 400 must name)
    ({"temperature": "hot"}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": 11}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_p": None}, "top_p"), ({"stop": "x"}, "stop"), ({"stop": [1]}, "stop"),
    ({"stop": [""]}, "stop"), ({"stop": ["a" * 65]}, "stop"), ({"stop": ["a"] * 9}, "stop"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": "7"}, "seed"),
    ({"seed": True}, "seed"), ({"seed": 2**63}, "seed"), ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_new_tokens": "8"}, "max_new_tokens"),
    ({"max_tokens": 4, "max_new_tokens": 5}, "max_tokens"), ({"temprature": 0.5}, "temprature"),
]


def test_parse_turn_is_strict_and_names_the_field():
    from node.serving.turn_options import DEFAULT_NEW_TOKENS, TurnOptions, parse_turn
    assert parse_turn({"text": "hi"}) == ("hi", TurnOptions(DEFAULT_NEW_TOKENS))
    assert parse_turn({"text": "", "max_new_tokens": 3})[1].max_new_tokens == 3  # the old field
    text, o = parse_turn({"text": "q", "max_tokens": 9, "max_new_tokens": 9, "temperature": 0.7,
                          "top_p": 0.9, "stop": ["\n", "END"], "seed": 2**63 - 1})
    assert o == TurnOptions(9, 0.7, 0.9, ("\n", "END"), 2**63 - 1)
    for fields, name in BAD_OPTIONS:
        with pytest.raises((ValueError, TypeError), match=name):
            parse_turn({"text": "q", **fields})
    with pytest.raises(TypeError, match="text"):
        parse_turn({"max_tokens": 2})


def test_bad_options_get_400s_naming_the_field_and_change_nothing(served):
    _, agent = served
    sid = agent.call("/v1/sessions", {"system": SYSTEM})["session"]
    _turn(agent, sid, text="hi ", max_new_tokens=3)
    before, stats = agent.call(f"/v1/sessions/{sid}", method="GET"), agent.call("/v1/stats")
    for fields, name in BAD_OPTIONS:
        status, answer = agent.status(f"/v1/sessions/{sid}", {"text": "x", **fields})
        assert status == 400 and name in answer["error"], (fields, status, answer)
    assert agent.call(f"/v1/sessions/{sid}", method="GET") == before
    after = agent.call("/v1/stats")
    assert (after["turns"], after["tokens"]) == (stats["turns"], stats["tokens"]) == (1, 3)
    assert _turn(agent, sid, text="ok ", max_tokens=2)["stop_reason"] == "length"  # goes on


def test_temperature_zero_is_the_old_greedy_reply(served):
    node, agent = served
    a, b = (agent.call("/v1/sessions", {"system": SYSTEM})["session"] for _ in range(2))
    old = _turn(agent, a, text="status? ", max_new_tokens=12)
    new = _turn(agent, b, text="status? ", max_tokens=12, temperature=0, top_p=0.3, seed=5)
    assert old == new and old["stop_reason"] == "length"
    prompt = (SYSTEM + "status? ").encode()
    assert bytes.fromhex(old["reply_hex"]) == _fresh_reply(_model(node.params()), prompt, 12)


def test_a_seeded_sample_repeats(served):
    _, agent = served
    body = {"text": "status? ", "max_tokens": 24, "temperature": 1.0, "top_p": 0.9}
    replies = []
    for tenant in ("alice", "bob", "alice"):
        sid = agent.call("/v1/sessions", {"system": SYSTEM}, tenant=tenant)["session"]
        replies.append(agent.call(f"/v1/sessions/{sid}", {**body, "seed": 7}, tenant=tenant))
        unseeded = agent.call(f"/v1/sessions/{sid}", body, tenant=tenant)  # secrets-seeded
        assert len(bytes.fromhex(unseeded["reply_hex"])) == 24
    assert replies[0] == replies[1] == replies[2]
    greedy = _turn(agent, agent.call("/v1/sessions", {"system": SYSTEM})["session"],
                   text="status? ", max_tokens=24)
    assert greedy["reply_hex"] != replies[0]["reply_hex"]  # it did sample


def test_stop_strings_end_the_reply_before_them(served):
    _, agent = served
    sid = agent.call("/v1/sessions", {"system": SYSTEM})["session"]
    full = bytes.fromhex(_turn(agent, sid, text="status? ", max_tokens=24)["reply_hex"])
    pos = next(i for i, c in enumerate(full) if i > 0 and chr(c).isalnum() and c < 128)
    stop = chr(full[pos])
    sid = agent.call("/v1/sessions", {"system": SYSTEM})["session"]
    r = _turn(agent, sid, text="status? ", max_tokens=24, stop=["never-there", stop])
    assert r["stop_reason"] == "stop"
    assert r["reply"] == full[:pos].decode("utf-8", "replace")  # cut before the stop string
    assert bytes.fromhex(r["reply_hex"]) == full[:pos + 1]      # the session holds what was decoded
    history = bytes.fromhex(agent.call(f"/v1/sessions/{sid}", method="GET")["history_hex"])
    assert history == (SYSTEM + "status? ").encode() + full[:pos + 1]


def test_smollm2_without_its_directory_is_a_clear_error(tmp_path):
    from node.serving import serve
    with pytest.raises(SystemExit, match="python -m node.models.smollm2 fetch"):
        serve.main(["--cache-dir", str(tmp_path / "kv-cache"), "--no-key", "--model", "smollm2",
                    "--model-dir", str(tmp_path / "absent")])


def _smollm2_dir() -> Path:
    pytest.importorskip("transformers")
    from node.models.smollm2 import MANIFEST, default_dir
    if not (default_dir() / MANIFEST).is_file():
        pytest.skip("SmolLM2 not fetched: python -m node.models.smollm2 fetch")
    return default_dir()


SMOL_SYSTEM = "You are a concise assistant. Answer in one or two sentences."


@pytest.mark.slow  # the real model in an agent process (58 s + 11 s teardown loaded); .ci/run's real-model step;
# tests/node/models/test_chat.py feeds the same chat template in process
def test_an_agent_serving_smollm2_answers_in_its_chat_template(start_agent):
    model_dir = _smollm2_dir()
    agent = start_agent("--model", "smollm2", "--model-dir", str(model_dir))
    q = "What is the capital of France?"
    sid = agent.call("/v1/sessions", {"system": SMOL_SYSTEM})["session"]
    r = agent.call(f"/v1/sessions/{sid}", {"text": q, "max_tokens": 24}, timeout=120)
    assert r["stop_reason"] in ("eos", "length") and r["version"] == 0
    assert isinstance(r["reply"], str) and r["reply"].strip() and "<|im" not in r["reply"]
    assert "reply_hex" not in r and all(isinstance(t, int) for t in r["reply_tokens"])
    assert "Paris" in r["reply"], r
    history = agent.call(f"/v1/sessions/{sid}", method="GET")["history"]
    assert history.startswith(f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"), history
    assert f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{r['reply']}" in history
    assert history.endswith("<|im_end|>\n")  # the template closed the assistant turn
    # a stop string, in another tenant's session (no shared prefix: the same greedy tokens)
    word = r["reply"].split()[1]
    sid = agent.call("/v1/sessions", {"system": SMOL_SYSTEM}, tenant="bob")["session"]
    s = agent.call(f"/v1/sessions/{sid}", {"text": q, "max_tokens": 24, "stop": [word]},
                   tenant="bob", timeout=120)
    assert s["stop_reason"] == "stop" and s["reply"] == r["reply"][:r["reply"].index(word)], s


def test_own_weights_serve_without_published_parameters_and_keep_unfit_ones_out(tmp_path):
    """``--model smollm2``'s path, with the byte model standing in: the agent serves the
    weights it came with at once; a published file for another model is refused whole."""
    from cache.coherence import Mode
    from node.serving import param_channel as pc
    from node.serving.param_channel import exclusive_params
    from node.serving.serve import ServingAgent
    from node.serving.turn_options import TurnOptions
    from node.tasks.tasks import lm_model

    model = lm_model(seed=3)
    mine = {n: t.clone() for n, t in model.state_dict().items()}
    agent = ServingAgent(tmp_path, KEY, mode=Mode.RELAXED, wait_s=0.1, model=model,
                         own_weights=True)
    try:
        assert agent.version == 0
        sid = agent.create("alice", b"sys: ")
        first = agent.send("alice", sid, b"hi ", TurnOptions(4))
        assert first["stop_reason"] == "length" and len(first["reply_hex"]) == 8
        with exclusive_params(tmp_path, Mode.RELAXED):  # another model's parameters
            pc.publish(tmp_path, KEY, {"other.weight": torch.zeros(2, 2)}, 1)
        agent.idle()
        assert agent.version == 0 and agent.counters.invalidations == 1  # seen, and refused
        assert all(torch.equal(agent.model.state_dict()[n], t) for n, t in mine.items())
        fitting = {n: t + 0.25 for n, t in mine.items()}
        with exclusive_params(tmp_path, Mode.RELAXED):
            pc.publish(tmp_path, KEY, fitting, 2)
        agent.idle()
        assert agent.version == 2
        assert all(torch.equal(agent.model.state_dict()[n], fitting[n]) for n in fitting)
    finally:
        agent.close()


def _raw_post(agent: Agent, path: str, data: bytes) -> tuple[int, dict]:
    """POST ``data`` as it is (no json.dumps: it could not write a lone surrogate as such)."""
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
    try:
        conn.request("POST", path, data, {"Authorization": f"Bearer {agent.tokens['alice']}",
                                          "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_a_lone_surrogate_or_a_deeply_nested_body_is_a_400_not_a_500(served):
    """Issue 30: ``"\\ud800"`` parses (json.loads keeps lone surrogates) and failed later when
    encoded; 30k nested arrays raised RecursionError: both were 500 "internal error"."""
    _, agent = served
    sid = agent.call("/v1/sessions", {"system": "s"})["session"]
    deep = b'{"text": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    got = []
    for path, data, says in (("/v1/sessions", b'{"system": "a\\ud800b"}', "surrogate"),
                             (f"/v1/sessions/{sid}", b'{"text": "\\udfff"}', "surrogate"),
                             (f"/v1/sessions/{sid}", b'{"text": "x", "\\ud800": 1}', "surrogate"),
                             (f"/v1/sessions/{sid}", deep, "nested")):
        got.append((data[:30], *_raw_post(agent, path, data)))
    assert all(status == 400 and says in answer["error"] for (_, status, answer), says
               in zip(got, ("surrogate",) * 3 + ("nested",))), got
    assert agent.call(f"/v1/sessions/{sid}", {"text": "hi", "max_new_tokens": 2})["version"] == 0
