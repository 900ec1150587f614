"""A fedkv OpenAI server as a subprocess, measured from outside: started through its command
line (``python -m node.serving.openai_api``, so it measures whatever HTTP stack serves the routes),
reached only over HTTP (``httpx``), its resources read from ``/proc`` and its gauges from
``/metrics``. ``experiments.serve_soak`` drives it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from federation.deploy.flwr_sandbox import alive, free_port, stop_pids

ROOT = Path(__file__).resolve().parent.parent


# -- the server ----------------------------------------------------------------------------
def write_tokens(path: Path, tenants: int) -> list[str]:
    """A token file of ``tenants`` tenants ``soak0``... (0600, its folder 0700); the tokens.
    One tenant per client: the server's per-tenant concurrency cap never refuses the load."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tokens = [secrets.token_urlsafe(32) for _ in range(tenants)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"soak{i}:{t}\n" for i, t in enumerate(tokens))
    return tokens


class ServerProcess:
    """``python -m node.serving.openai_api`` on a free loopback port, logging to ``log``; ``close``
    stops it by its pid (SIGTERM, then SIGKILL), also after a failed start."""

    def __init__(self, model: str, folder: Path, log: Path, tenants: int,
                 model_dir: str | None = None, extra: tuple[str, ...] = (),
                 start_timeout_s: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token_file = folder / "serve-token"
        self.tokens = write_tokens(token_file, tenants)
        cmd = [sys.executable, "-m", "node.serving.openai_api", "--model", model, "--port",
               str(self.port), "--token-file", str(token_file), *extra]
        if model_dir:
            cmd += ["--model-dir", model_dir]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        env.setdefault("OMP_NUM_THREADS", "1")
        self.threads_env = env["OMP_NUM_THREADS"]
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.pid, self.log = self.proc.pid, log
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.proc, self.url, timeout_s, "the server", self.log, poll_s=0.5)

    def close(self) -> None:
        if alive(self.pid):
            stop_pids([self.pid], grace_s=30.0)
        self.proc.wait(timeout=30)


def resources(pid: int) -> dict[str, float]:
    """RSS (MiB), threads and open fds of process ``pid``, from ``/proc``."""
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024,
            "threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def scrape(client: httpx.Client) -> dict[str, float]:
    """The server's own gauges from ``/metrics`` (``fedkv_*`` samples, labels folded into
    the name; ``{}`` when the route is missing or needs a token it refuses)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        r = client.get("/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        if not fam.name.startswith("fedkv_") or fam.type not in ("gauge", "counter"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


# -- one request over HTTP -------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    status: int = 0
    ttft_s: float | None = None
    decode_s: float | None = None
    """Seconds from the first content chunk to the last one."""
    tokens: int = 0
    cached_tokens: int = 0
    cancelled: bool = False
    error: str | None = None


@dataclass(frozen=True)
class Job:
    kind: str
    path: str
    body: dict[str, Any]
    cancel_after: int | None = None
    """Close the connection after this many content chunks (a client that walks away)."""
    expect: int = 200


def call(client: httpx.Client, job: Job, timeout_s: float) -> Result:
    """One request; never raises (an HTTP failure is a failed ``Result``)."""
    t0 = time.perf_counter()
    try:
        if not job.body.get("stream"):
            r = client.post(job.path, json=job.body, timeout=timeout_s)
            return _whole_result(r, job, time.perf_counter() - t0)
        with client.stream("POST", job.path, json=job.body, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                return Result(r.status_code == job.expect, r.status_code, error=r.text[:200])
            return _read_stream(r, job, t0)
    except httpx.HTTPError as e:
        return Result(False, error=f"{type(e).__name__}: {str(e)[:200]}")


def _whole_result(r: httpx.Response, job: Job, elapsed: float) -> Result:
    if r.status_code != 200:
        return Result(r.status_code == job.expect, r.status_code, error=r.text[:200])
    usage = r.json().get("usage") or {}
    return Result(job.expect == 200, 200, ttft_s=elapsed, tokens=usage.get("completion_tokens", 0),
                  cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _content(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or ():
        text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
        if text:
            return True
    return False


def _read_stream(r: httpx.Response, job: Job, t0: float) -> Result:
    """Server-sent events up to ``[DONE]`` (or ``job.cancel_after`` content chunks: then the
    connection is closed as the context manager leaves); a cut stream fails."""
    res, first, last, chunks = Result(False, 200), None, None, 0
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            res.ok = job.expect == 200
            break
        chunk = json.loads(data)
        if "error" in chunk:
            res.error = str(chunk["error"].get("message"))[:200]
            break
        if _content(chunk):
            last = time.perf_counter()
            first, chunks = first or last, chunks + 1
        if usage := chunk.get("usage"):
            res.tokens = usage.get("completion_tokens", 0)
            res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if job.cancel_after is not None and chunks >= job.cancel_after:
            res.ok = res.cancelled = True
            break
    else:
        res.error = res.error or "the stream ended before [DONE]"
    if first is not None:
        res.ttft_s, res.decode_s = first - t0, last - first
    res.tokens = res.tokens or chunks
    return res


def api(url: str, token: str, timeout_s: float) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                        timeout=httpx.Timeout(timeout_s, connect=10.0))


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str, log: Path,
                 poll_s: float) -> None:
    """Poll ``url``/health until it answers 200; a clear error when ``proc`` exits first or
    ``timeout_s`` passes (both name the log to read)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it served (see {log})")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what} did not serve within {timeout_s:.0f} s (see {log})")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads (a server started with
    ``start_new_session``: it shuts its children down), then SIGKILL to whatever of the group
    is left, also when the leader itself already exited. A paused group is continued first
    (stopped processes act on SIGTERM only once continued)."""
    resume_group(proc)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    proc.wait(timeout=30)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, SIGTERM (``timeout``, a job scheduler, a CI runner) raises ``SystemExit(143)``
    in the main thread, so the ``finally`` blocks that stop the servers a run started run too:
    Python's default dies at once and leaves them serving. The previous handler is restored on
    the way out; off the main thread (where no handler can be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_143(signum: int, frame: object) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def pause_group(proc: subprocess.Popen) -> None:
    """SIGSTOP to the process group ``proc`` leads: an idle server's polling threads (vLLM's
    engine polls between requests) take no CPU from a system measured beside it. Continued by
    :func:`resume_group` (or :func:`stop_group`)."""
    _signal_group(proc, signal.SIGSTOP)


def resume_group(proc: subprocess.Popen) -> None:
    """SIGCONT to the process group ``proc`` leads (harmless on a running group)."""
    _signal_group(proc, signal.SIGCONT)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the group is gone: nothing to pause or continue


def machine_busy_seconds() -> float:
    """CPU seconds all of this machine's CPUs spent busy so far (``/proc/stat``: everything but
    idle and I/O wait), whoever used them; NaN where there is no ``/proc``. Beside a run's own
    CPU it tells how much else ran during it."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return math.nan
    return (sum(ticks[:7]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # not steal


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``
    (a contender server started with ``start_new_session``: its leader's pid), read from
    ``/proc``; NaN where there is no ``/proc``."""
    if not os.path.isdir("/proc"):
        return math.nan
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we read
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")
