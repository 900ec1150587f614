"""Real ``node.serving.openai_api`` processes on one Redis, for ``experiments.bench_redis``: a second
process's prefix hits on a load the first computed, and a 16-client load while Redis is killed
and restarted. Requests over HTTP (urllib), hits from each server's ``/metrics``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from experiments.redis_server import RedisServer, start_in

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-redis-token-0123456789"
KEY = bytes(range(32))
BLOCK = 16
"""The cache's default block size (``CacheConfig.block_size``): what the hit rate counts in."""
PREFIX = {"byte": "System: answer as the fedkv node's assistant, briefly. User: ",
          "smollm2": ("System: you are the assistant of a federated key-value cache node. Answer "
                      "briefly, cite the project's documentation, never reveal a tenant's data, "
                      "and say when a question falls outside what the node knows. ") * 4 + "User: "}


def _files(tmp: Path) -> tuple[Path, Path]:
    from crypto import write_secret_file
    key_file = write_secret_file(tmp / "bench-kv.key", KEY)
    tokens = tmp / "serve-token"
    tokens.write_text(f"bench:{TOKEN}\n")
    tokens.chmod(0o600)
    return key_file, tokens


def start(tmp: Path, name: str, model: str, url: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """A server process on ``url``'s Redis; (process, port) once it is ready."""
    key_file, tokens = _files(tmp)
    ready = tmp / f"{name}.ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.serving.openai_api", "--model", model, "--port", "0",
         "--ready-file", str(ready), "--token-file", str(tokens), "--kv-redis", url,
         "--kv-key-file", str(key_file), "--log-level", "WARNING", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"node.serving.openai_api ({name}) did not start")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["port"]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def complete(port: int, model: str, prompt: str, max_tokens: int = 2) -> int:
    """One completion; its prompt tokens (raises on any failure)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return int(json.loads(r.read())["usage"]["prompt_tokens"])


def hit_blocks(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {t: int(float(n)) for t, n in
            re.findall(r'fedkv_kv_cache_hit_blocks(?:_total)?\{tier="(\w+)"\} ([0-9.e+]+)', text)}


def _model_id(model: str) -> str:
    return {"byte": "fedkv-byte", "smollm2": "smollm2-135m-instruct"}[model]


def _serve_load(port: int, model: str, prompts: list[str]) -> tuple[float, dict]:
    lookups = sum((complete(port, _model_id(model), p) - 1) // BLOCK for p in prompts)
    hits = hit_blocks(port)
    return sum(hits.values()) / lookups if lookups else 0.0, hits


def second_process_section(tmp: Path, model: str, quick: bool) -> dict[str, Any]:
    n = 4 if quick else 6
    prompts = [f"{PREFIX[model]}question {i}: what is block {i * 7}?" for i in range(2 * n)]
    server = start_in(tmp, "second")
    procs = []
    try:
        procs = [start(tmp, name, model, server.url) for name in ("first", "second")]
        h1, hits1 = _serve_load(procs[0][1], model, prompts[:n])
        time.sleep(1.0)  # the first process's writer drains (it writes off the request path)
        h2, hits2 = _serve_load(procs[1][1], model, prompts[n:])
    finally:
        for proc, _ in procs:
            stop(proc)
        server.stop()
    return {"redis.first_process_hit_rate": h1, "redis.second_process_hit_rate": h2,
            "redis.second_vs_first": h2 / h1 if h1 else None,
            "redis.second_process": {"requests_each": n, "hits_first": hits1, "hits_second": hits2}}


def _client(ports: list[int], model: str, c: int, stop_at: list[float], log: list) -> None:
    """Client ``c``: question ``k // 2`` to one process, then the same to the other (a Redis
    hit there while Redis is up, a recompute while it is down)."""
    k = 0
    while time.monotonic() < stop_at[0]:
        t = time.monotonic()
        q = k // 2
        words = " ".join(f"w{c}x{q}y{i}" for i in range(6 if model == "byte" else 12))
        prompt = f"client {c} question {q}: {words}" + ("" if model == "byte" else PREFIX[model])
        try:
            complete(ports[(c + k) % 2], _model_id(model), prompt)
            log.append((t, True, ""))
        except Exception as e:  # noqa: BLE001 -- counted, the load goes on
            body = e.read().decode(errors="replace")[:200] if hasattr(e, "read") else str(e)[:200]
            log.append((t, False, f"{type(e).__name__} {getattr(e, 'code', '')}: {body}"))
        k += 1


def _redis_calls(server: RedisServer) -> dict[str, int]:
    calls = {k.removeprefix("cmdstat_"): v["calls"]
             for k, v in server.client().info("commandstats").items()}
    return {"mget": calls.get("mget", 0), "set": calls.get("set", 0),
            "keys": server.client().dbsize()}


def _load(ports: list[int], model: str, server: RedisServer, load_s: float, clients: int,
          log: list) -> dict[str, float]:
    """The load, Redis killed at a third of it and restarted at two thirds; the times."""
    stop_at = [time.monotonic() + 1e9]
    threads = [threading.Thread(target=_client, args=(ports, model, c, stop_at, log))
               for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(load_s / 3)
    killed = time.monotonic()
    server.kill()
    time.sleep(load_s / 3)
    server.start()
    restarted = time.monotonic()
    time.sleep(load_s / 3)
    stop_at[0] = time.monotonic()
    for t in threads:
        t.join()
    return {"killed": killed, "restarted": restarted}


def restart_section(tmp: Path, model: str, load_s: float, clients: int = 16) -> dict[str, Any]:
    """``clients`` clients over two server processes while Redis is killed and restarted."""
    server = start_in(tmp, "restart")
    procs: list = []
    log: list[tuple[float, bool, str]] = []
    try:
        # 2x the clients: a client's next request may arrive before the server counted its
        # previous one out (a 429 of the harness, not of Redis)
        flags = ("--max-concurrent", str(2 * clients), "--max-queue", str(4 * clients),
                 "--request-timeout", "300", "--request-deadline", "600")
        procs = [start(tmp, f"restart{i}", model, server.url, *flags) for i in range(2)]
        ports = [port for _, port in procs]
        at = _load(ports, model, server, load_s, clients, log)
        hits = [hit_blocks(p) for p in ports]
        after = _redis_calls(server)
    finally:
        for proc, _ in procs:
            stop(proc)
        server.stop()
    failed = [(t, e) for t, ok, e in log if not ok]
    when = lambda t: "before" if t < at["killed"] else "down" if t < at["restarted"] else "after"  # noqa: E731
    return {"redis.failed_requests_during_restart": len(failed),
            "redis.restart": {
                "clients": clients, "processes": 2, "requests": len(log),
                "requests_by_phase": {p: sum(1 for t, _, _ in log if when(t) == p)
                                      for p in ("before", "down", "after")},
                "failures": sorted({f"{when(t)}: {e}" for t, e in failed}),
                "hits_by_tier": hits, "redis_commands_after_restart": after}}
