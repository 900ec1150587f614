"""vLLM's CPU build as a contender of ``experiments.serve_load``: its OpenAI server as a
subprocess of its own venv (``VllmServer``) and a ``GenerationBackend`` that streams
``/v1/completions`` over HTTP (``VllmBackend``), so the load driver's client threads measure
vLLM exactly as they measure fedkv's in-process backends (HTTP and detokenizing are vLLM's cost:
a server pays them).

vLLM is not a fedkv dependency: it pins its own torch, so it lives in its own venv and is
reached only through that venv's python (``--vllm-python`` / ``$FEDKV_VLLM_PYTHON``).

Token counting: a request asks for ``return_token_ids`` (vLLM's extension: each stream chunk
carries the ids it adds, so a chunk that merges tokens still counts each) and, as a fallback,
``stream_options.continuous_usage_stats`` (each chunk's running ``completion_tokens``). Every
token of a chunk is stamped when the chunk arrives. ``ignore_eos`` makes vLLM decode to
``max_tokens`` as the other backends do (``serve_load`` gives them no stop tokens).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from experiments.llm_contenders import StreamHandle
from experiments.served_process import stop_group, wait_healthy
from federation.deploy.flwr_sandbox import free_port
from node.engine.generation import GenerationRequest

ENV_PYTHON = "FEDKV_VLLM_PYTHON"


@dataclass(frozen=True)
class VllmSettings:
    """How the vLLM server runs (reported with the results)."""

    dtype: str = "bfloat16"
    """vLLM's CPU backend runs bf16 (fp32 is slower there and not its serving default)."""
    kvcache_space_gib: int = 2
    """``VLLM_CPU_KVCACHE_SPACE``: its KV pool (far more than serve_load's offered load)."""
    omp_threads: int = 1
    """``OMP_NUM_THREADS``: as many threads as fedkv's torch gets (``--threads``)."""
    threads_bind: str = "nobind"
    """``VLLM_CPU_OMP_THREADS_BIND``: pinned threads collapse on a shared host."""
    max_model_len: int = 2048
    start_timeout_s: float = 900.0
    """Start-up compiles and warms up: minutes on 2 cores."""


def unavailable(python: str | None, timeout_s: float = 300.0) -> str | None:
    """Why ``python`` cannot run vLLM (None: it can)."""
    if not python:
        return f"no vLLM python (--vllm-python or ${ENV_PYTHON})"
    if not os.access(python, os.X_OK):
        return f"{python} is not an executable"
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True,
                              timeout=timeout_s, env=own_env())
    except subprocess.TimeoutExpired:
        return f"{python} -c 'import vllm' took over {timeout_s:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import vllm: {last[:200]}"
    return None


def version(python: str) -> str:
    """The installed vLLM distribution and version (``vllm-cpu 0.32.0``), for the record."""
    code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n"
            "        print(d, m.version(d)); break\n    except m.PackageNotFoundError: pass")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                          env=own_env())
    return done.stdout.strip() or "unknown"


def own_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without ``PYTHONPATH`` (fedkv's packages must not shadow
    anything in vLLM's venv), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **(extra or {})}


class VllmServer:
    """``vllm.entrypoints.openai.api_server`` in its own process group, logging to ``log``;
    ``close`` (also on a failed start) kills that group by its id."""

    def __init__(self, python: str, model_dir: Path, log: Path, name: str,
                 settings: VllmSettings = VllmSettings(),
                 extra_env: Mapping[str, str] | None = None):
        self.name, self.settings, self.log, self.python = name, settings, log, python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
               "--no-enable-log-requests"]
        env = own_env({"VLLM_CPU_OMP_THREADS_BIND": settings.threads_bind,
                       "OMP_NUM_THREADS": str(settings.omp_threads),
                       "VLLM_CPU_KVCACHE_SPACE": str(settings.kvcache_space_gib),
                       **(extra_env or {})})
        t0 = time.perf_counter()
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(settings.start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0

    def _wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.proc, self.url, timeout_s, "vLLM", self.log, poll_s=2.0)

    def backend(self, clients: int) -> "VllmBackend":
        return VllmBackend(self.url, self.name, clients)

    def report(self) -> dict[str, Any]:
        return {"start_s": round(self.start_s, 1), "version": version(self.python),
                **asdict(self.settings)}

    def close(self) -> None:
        """The server's whole process group: ``experiments.served_process.stop_group``."""
        stop_group(self.proc)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HttpHandle(StreamHandle):
    """One streamed completion; ``cancel`` tells its thread to close the stream."""

    def __init__(self, rid: str, prompt_tokens: int):
        super().__init__(rid, prompt_tokens)
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class VllmBackend:
    """``submit`` streams ``/v1/completions`` on a thread of its own; every failure (HTTP
    status, broken or cut stream, a chunk's ``error``) ends the handle ``error``. Another
    server's streaming API is a subclass: its ``endpoint``, ``body`` and ``parse``."""

    endpoint = "/v1/completions"
    prefix = "vllm"
    ends_at_finish = False
    """True: the chunk with a finish reason is the stream's last (no ``[DONE]`` follows)."""

    def __init__(self, url: str, model_id: str, clients: int, timeout_s: float = 600.0):
        self.url, self.model_id, self.version = url, model_id, 0
        n = 2 * max(clients, 1)  # a client's next request may start before its last one's
        # stream is closed (its tokens are all read by then): no waiting for a connection
        self._http = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                  limits=httpx.Limits(max_connections=n,
                                                      max_keepalive_connections=n))
        self._ids = itertools.count(1)
        self._live: dict[str, tuple[_HttpHandle, threading.Thread]] = {}
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest) -> list[_HttpHandle]:
        if request.n != 1 or not request.sampling.greedy:
            raise ValueError("the vLLM contender decodes one greedy sample per request")
        h = _HttpHandle(f"{self.prefix}-{next(self._ids)}", len(request.prompt))
        t = threading.Thread(target=self._run, args=(request, h), name=h.request_id, daemon=True)
        with self._lock:
            self._live[h.request_id] = (h, t)
        t.start()
        return [h]

    def body(self, request: GenerationRequest) -> dict[str, Any]:
        return {"model": self.model_id, "prompt": list(request.prompt),
                "max_tokens": request.max_tokens, "temperature": 0.0,
                "ignore_eos": not request.stop_token_ids,
                "stop_token_ids": sorted(request.stop_token_ids), "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    def parse(self, chunk: dict[str, Any], counted: int) -> tuple[list[int], str | None]:
        """(the token ids a chunk adds, its finish reason if it gives one)."""
        finish = None
        for c in chunk.get("choices") or ():
            finish = c.get("finish_reason") or finish
        return _new_tokens(chunk, counted), finish

    def _run(self, request: GenerationRequest, h: _HttpHandle) -> None:
        try:
            h.finish_reason = self._stream(request, h)
        except Exception as e:  # a failed request ends its handle, never the run
            h.finish_reason, h.error = "error", f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            h.stream.end()
            with self._lock:
                self._live.pop(h.request_id, None)

    def _stream(self, request: GenerationRequest, h: _HttpHandle) -> str:
        finish, counted = None, 0
        with self._http.stream("POST", self.endpoint, json=self.body(request)) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if h.cancelled.is_set():
                    return "cancelled"
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if finish is None:
                        raise ValueError("the stream ended without a finish_reason")
                    return finish
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":
                    raise ValueError(f"server error: {str(chunk.get('error', chunk))[:200]}")
                tokens, finished = self.parse(chunk, counted)
                for tok in tokens:
                    h.stream.put(tok)
                    counted += 1
                finish = finished or finish
                if finished and self.ends_at_finish:
                    return finish
        raise ValueError("the stream was cut before its end")

    def close(self) -> None:
        with self._lock:
            live = list(self._live.values())
        for h, _ in live:
            h.cancel()
        for _, t in live:
            t.join(timeout=30)
        self._http.close()


def _new_tokens(chunk: dict[str, Any], counted: int) -> list[int]:
    """The token ids a chunk adds: its choice's ``token_ids``, else as many ``-1`` as its
    running ``usage.completion_tokens`` exceeds ``counted`` (the count, without ids)."""
    choices = chunk.get("choices") or ()
    given = [c["token_ids"] for c in choices if c.get("token_ids") is not None]
    if given:  # (vLLM writes ``"token_ids": null`` when they were not asked for)
        return [int(t) for ids in given for t in ids]
    usage = chunk.get("usage") or {}
    return [-1] * max(0, int(usage.get("completion_tokens", counted)) - counted)
