"""Soak test of the OpenAI server: does a long-running server keep its speed and its size?

    python -m experiments.serve_soak [--quick] [--json] [--model smollm2|byte] [--requests 1000]
        [--clients 4] [--load-minutes M] [--no-restart] [--model-dir DIR] [--sample-s 5]
        [--server-arg=--flag ...]

Starts ``python -m node.serving.openai_api`` as a subprocess through its command line (its own port,
a token file of ``--clients`` tenants written here, 0600 in a 0700 folder; ``OMP_NUM_THREADS=1``
unless the environment sets it) and talks to it only over HTTP (``httpx``), so it measures
whatever HTTP stack serves those routes. Then:

1. *probes at the start*: a fresh ``probe_prompt``-token prompt (its first token differs per
   probe, so nothing of it is cached) and a cached prompt (sent once unmeasured, then again),
   each streamed greedily ``probe_repeats`` times: TTFT and decode tokens/s (completion tokens
   after the first over the seconds from the first chunk to the last), medians;
2. the server's resources: RSS (``/proc/<pid>/status`` VmRSS), threads, open fds, and what
   ``/metrics`` shows (requests waiting/running, preemptions, KV blocks and sessions held);
3. ``requests`` requests of a mixed load from ``clients`` threads: prompts from a few shared
   prefixes plus their own tails (the prefix cache fills and evicts), streamed and not,
   completions and chat, ``n > 1`` and sampled ones, some cancelled mid-stream by closing the
   connection, a few invalid (an expected 400); resources sampled every ``sample_s`` s;
4. the same probes again -- and, unless ``--no-restart``, on a second server started now
   (the control the issue's "restarted, the same prompts gave ..." asks for), in alternation
   with the soaked one, so a change of the shared machine's load falls on both -- then the
   resources again (every client connection closed first, and after ``settle_s``, so an
   idle keep-alive connection's thread is not counted).

Before the start probes each server is warmed up as it would be after a while anyway: the
cached prompt sent once, one chat request (the tokenizer starts its worker threads, two here,
on the first).

The JSON (``--json`` prints it last): ``probe.{start,end,restarted}.{ttft_s,
decode_tokens_per_s}`` (the fresh prompt; ``.cached.*`` the cached one; ``.spread`` the
probes' min and max), ``ratio_end_vs_start`` (end / start), ``ratio_end_vs_restarted``
(soaked / restarted: the control), ``rss_mib``, ``threads`` and ``fds`` (each ``boot``,
``start``, ``end``, ``max``), ``metrics.{start,end}`` (the ``fedkv_*`` series of
``/metrics``), ``requests``, ``failed`` (requests that ended otherwise than asked: an error
status, a stream error or a cut stream; cancels and the expected 400s are not failures),
``cancelled``, ``load`` (wall seconds, tokens/s), ``load_average``, ``server_pids`` and the
periodic ``samples``. A slowdown is a ratio away from 1 beyond the probes' own spread; growth
is an end above the start that ``max`` confirms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from experiments.output import add_common_args, make_run_dir, print_results_dir, write_json
from experiments.served_process import Job, Result, ServerProcess, api, call, resources, scrape


# -- settings ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A served model's sizes: its vocabulary (prompts are token ids) and the lengths used."""

    model_id: str
    vocab: int
    probe_prompt: int
    probe_new: int
    prefix: int
    """Tokens of each shared prefix of the load."""
    max_tail: int
    """A load prompt's own tokens after its prefix: 8 to this many."""
    max_new: int


SHAPES = {"smollm2": Shape("smollm2-135m-instruct", 49152, 512, 32, 64, 256, 24),
          "byte": Shape("fedkv-byte", 256, 64, 16, 16, 64, 24)}
"""``byte``: context 128 (prompt + new tokens must fit); ``smollm2``: the issue's 512-token
fresh prompt."""


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 1000
    clients: int = 4
    probe_repeats: int = 3
    sample_s: float = 5.0
    """Seconds between resource samples during the load."""
    settle_s: float = 1.0
    """Wait after closing connections before the start/end resource sample."""
    prefixes: int = 8
    """Shared prefixes of the load (each ``Shape.prefix`` tokens)."""
    timeout_s: float = 300.0
    load_s: float | None = None
    """Stop sending load requests after this many seconds (None: all ``requests``)."""
    seed: int = 0
    mix: tuple[tuple[str, float], ...] = (
        ("stream", 0.30), ("whole", 0.22), ("chat", 0.10), ("n", 0.10), ("sampled", 0.08),
        ("cancel", 0.15), ("invalid", 0.05))
    """Kinds of load request and their shares (see ``load_jobs``)."""


# -- probes ----------------------------------------------------------------------------------
def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def probe_prompts(shape: Shape, seed: int) -> tuple[list[int], list[int]]:
    """(fresh prompt base, cached prompt): fixed per seed, unlike any load prompt."""
    rng = random.Random(f"probe-{seed}")
    return _ids(rng, shape.probe_prompt, shape.vocab), _ids(rng, shape.probe_prompt, shape.vocab)


def _probe_job(shape: Shape, prompt: list[int]) -> Job:
    return Job("probe", "/v1/completions", {
        "model": shape.model_id, "prompt": prompt, "max_tokens": shape.probe_new,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})


def _summary(results: list[Result]) -> dict[str, Any]:
    ttft = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    rate = [(r.tokens - 1) / r.decode_s for r in results
            if r.ok and r.decode_s and r.tokens > 1]
    med = (lambda xs: statistics.median(xs) if xs else None)
    return {"ttft_s": med(ttft), "decode_tokens_per_s": med(rate),
            "spread": {"ttft_s": [min(ttft), max(ttft)] if ttft else None,
                       "decode_tokens_per_s": [min(rate), max(rate)] if rate else None},
            "tokens": [r.tokens for r in results], "cached_tokens": [r.cached_tokens for r in results],
            "failed": sum(not r.ok for r in results)}


def warm_up(client: httpx.Client, shape: Shape, cfg: SoakConfig) -> None:
    """What a server does once and keeps: the cached probe prompt into its prefix cache, and
    a chat request (the tokenizer starts its worker threads on the first one)."""
    call(client, _probe_job(shape, probe_prompts(shape, cfg.seed)[1]), cfg.timeout_s)
    call(client, Job("chat", "/v1/chat/completions", {
        "model": shape.model_id, "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2}), cfg.timeout_s)


def probe(clients: dict[str, httpx.Client], shape: Shape, cfg: SoakConfig,
          first_marker: int) -> dict[str, dict]:
    """Per server (``clients``, each warmed up already): the fresh prompt ``probe_repeats``
    times (its first token ``first_marker``, ``first_marker + 1``...: never cached) and the
    cached prompt as often. Rounds alternate between the servers, in rotated order, so a
    change of the machine's load falls on both."""
    base, cached = probe_prompts(shape, cfg.seed)
    fresh: dict[str, list[Result]] = {k: [] for k in clients}
    hot: dict[str, list[Result]] = {k: [] for k in clients}
    names = list(clients)
    for i in range(cfg.probe_repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            job = _probe_job(shape, [first_marker + i] + base[1:])
            fresh[name].append(call(clients[name], job, cfg.timeout_s))
            hot[name].append(call(clients[name], _probe_job(shape, cached), cfg.timeout_s))
    return {k: {**_summary(fresh[k]), "cached": _summary(hot[k])} for k in clients}


# -- the load --------------------------------------------------------------------------------
def load_jobs(shape: Shape, cfg: SoakConfig, n: int) -> list[Job]:
    """``n`` requests of ``cfg.mix``: ``stream``/``whole`` greedy completions, ``chat``
    (text, streamed or not), ``n`` (2-3 sampled choices), ``sampled`` (temperature and
    top_p), ``cancel`` (streamed, the connection closed after 1-3 chunks), ``invalid``
    (``max_tokens: -1``: a 400 is the right answer). Prompts: one of ``prefixes`` shared
    prefixes (most of them) then 8 to ``max_tail`` tokens of their own."""
    rng = random.Random(f"load-{cfg.seed}")
    prefixes = [_ids(rng, shape.prefix, shape.vocab) for _ in range(cfg.prefixes)]
    kinds, weights = zip(*cfg.mix)
    jobs = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        head = rng.choice(prefixes) if rng.random() < 0.8 else []
        prompt = head + _ids(rng, rng.randrange(8, shape.max_tail + 1), shape.vocab)
        body: dict[str, Any] = {"model": shape.model_id, "prompt": prompt, "temperature": 0,
                                "max_tokens": rng.randrange(4, shape.max_new + 1),
                                "stream": kind in ("stream", "cancel") or rng.random() < 0.3}
        path, cancel, expect = "/v1/completions", None, 200
        if kind == "chat":
            path = "/v1/chat/completions"
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, shape.max_tail // 8)))
            body = {k: v for k, v in body.items() if k != "prompt"}
            body["messages"] = [{"role": "user", "content": f"Request {i}: {words}?"}]
        elif kind == "n":
            body.update(n=rng.randrange(2, 4), temperature=0.8, seed=i,
                        max_tokens=min(body["max_tokens"], 12))
        elif kind == "sampled":
            body.update(temperature=0.9, top_p=0.9)
        elif kind == "cancel":
            cancel = rng.randrange(1, 4)
            body["max_tokens"] = shape.max_new
        elif kind == "invalid":
            body["max_tokens"], expect = -1, 400
        jobs.append(Job(kind, path, body, cancel, expect))
    return jobs


WORDS = ("cache", "node", "privacy", "federated", "token", "block", "prefix", "weights",
         "server", "client", "encrypted", "noise", "round", "model", "tenant", "stream")


@dataclass
class Tally:
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, job: Job, r: Result) -> None:
        with self.lock:
            self.done += 1
            self.failed += not r.ok
            self.cancelled += r.cancelled
            self.tokens += r.tokens
            self.by_kind[job.kind] = self.by_kind.get(job.kind, 0) + 1
            if not r.ok and len(self.errors) < 10:
                self.errors.append(f"{job.kind} {r.status}: {r.error}")


def drive(url: str, tokens: list[str], jobs: list[Job], cfg: SoakConfig, tally: Tally) -> float:
    """Each client thread (its own tenant and connections) sends its share of ``jobs`` back
    to back, counted in ``tally``, until ``cfg.load_s`` has passed; the wall seconds. Every
    client is closed when done."""
    end = time.monotonic() + (cfg.load_s if cfg.load_s is not None else float("inf"))

    def client(c: int) -> None:
        with api(url, tokens[c], cfg.timeout_s) as http:
            for job in jobs[c::cfg.clients]:
                if time.monotonic() >= end:
                    return
                tally.add(job, call(http, job, cfg.timeout_s))

    threads = [threading.Thread(target=client, args=(c,), name=f"soak-client-{c}")
               for c in range(cfg.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


class Sampler:
    """Resources and ``/metrics`` every ``every_s`` seconds on a thread, until ``stop``."""

    def __init__(self, server: ServerProcess, token: str, tally: Tally, every_s: float):
        self.server, self.token, self.tally, self.every_s = server, token, tally, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def take(self, http: httpx.Client) -> dict[str, Any]:
        s = {"t_s": round(time.perf_counter() - self._t0, 1), "requests_done": self.tally.done,
             **resources(self.server.pid), "metrics": scrape(http)}
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        with api(self.server.url, self.token, 30.0) as http:
            while not self._stop.wait(self.every_s):
                self.take(http)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the run ---------------------------------------------------------------------------------
GAUGES = ("waiting", "running", "preemptions", "kv_")
"""``/metrics`` samples kept in the periodic samples (the rest only at start and end)."""


def settled(server: ServerProcess, token: str, settle_s: float) -> dict[str, Any]:
    """Resources with no client connection open (after ``settle_s``), then ``/metrics``."""
    time.sleep(settle_s)
    out: dict[str, Any] = dict(resources(server.pid))
    with api(server.url, token, 30.0) as http:
        out["metrics"] = scrape(http)
    return out


def soak(server: ServerProcess, shape: Shape, cfg: SoakConfig,
         restart: Callable[[], ServerProcess] | None = None) -> dict[str, Any]:
    """Probes, the load (sampled), probes again -- beside a freshly started server when
    ``restart`` starts one (the control: the same probes, alternated); the figures."""
    token, boot, load_start = server.tokens[0], resources(server.pid), os.getloadavg()
    with api(server.url, token, cfg.timeout_s) as http:
        warm_up(http, shape, cfg)
        start = probe({"soaked": http}, shape, cfg, 1)["soaked"]
    before = settled(server, token, cfg.settle_s)
    tally = Tally()
    with Sampler(server, token, tally, cfg.sample_s) as sampler:
        wall = drive(server.url, server.tokens, load_jobs(shape, cfg, cfg.requests), cfg, tally)
    end, control = _end_probes(server, shape, cfg, restart)
    after = settled(server, token, cfg.settle_s)
    samples = sampler.samples
    return {
        "probe": {"start": start, "end": end, **({"restarted": control} if control else {})},
        "ratio_end_vs_start": ratios(start, end),
        **({"ratio_end_vs_restarted": ratios(control, end)} if control else {}),
        **{k: {"boot": boot[k], "start": before[k], "end": after[k],
               "max": max([before[k], after[k]] + [x[k] for x in samples])}
           for k in ("rss_mib", "threads", "fds")},
        "metrics": {"start": before["metrics"], "end": after["metrics"]},
        "requests": tally.done, "failed": tally.failed, "cancelled": tally.cancelled,
        "by_kind": tally.by_kind, "errors": tally.errors,
        "load": {"wall_s": wall, "completion_tokens": tally.tokens,
                 "tokens_per_s": tally.tokens / wall if wall else None},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "samples": [{**x, "metrics": {k: v for k, v in x["metrics"].items()
                                      if any(g in k for g in GAUGES)}} for x in samples],
    }


def _end_probes(server: ServerProcess, shape: Shape, cfg: SoakConfig,
                restart: Callable[[], ServerProcess] | None) -> tuple[dict, dict | None]:
    """The end probes of ``server`` (after its load) and, with ``restart``, of a new server
    started now, warmed up as the first was, probed in alternation, then stopped."""
    fresh = restart() if restart is not None else None
    try:
        with api(server.url, server.tokens[0], cfg.timeout_s) as http:
            clients = {"soaked": http}
            if fresh is None:
                return probe(clients, shape, cfg, 1 + cfg.probe_repeats)["soaked"], None
            with api(fresh.url, fresh.tokens[0], cfg.timeout_s) as other:
                warm_up(other, shape, cfg)
                got = probe({**clients, "restarted": other}, shape, cfg, 1 + cfg.probe_repeats)
                got["restarted"]["rss_mib"] = resources(fresh.pid)["rss_mib"]
                return got["soaked"], got["restarted"]
    finally:
        if fresh is not None:
            fresh.close()


def ratios(start: dict, end: dict) -> dict[str, float | None]:
    """end / start of each probe figure (None where either is missing); ``start`` may be
    another server's probes (the restarted one)."""
    def r(a: float | None, b: float | None) -> float | None:
        return b / a if a and b is not None else None
    return {"ttft_s": r(start["ttft_s"], end["ttft_s"]),
            "decode_tokens_per_s": r(start["decode_tokens_per_s"], end["decode_tokens_per_s"]),
            "cached_ttft_s": r(start["cached"]["ttft_s"], end["cached"]["ttft_s"]),
            "cached_decode_tokens_per_s": r(start["cached"]["decode_tokens_per_s"],
                                            end["cached"]["decode_tokens_per_s"])}


def summary(result: dict[str, Any]) -> str:
    f = (lambda v: "-" if v is None else f"{v:.3g}")
    probes = result["probe"]
    lines = [f"serve_soak: {result['requests']} requests ({result['failed']} failed, "
             f"{result['cancelled']} cancelled) in {result['load']['wall_s']:.0f} s"]
    for kind, get in (("fresh", lambda p: p), ("cached", lambda p: p["cached"])):
        lines.append(f"  {kind} probe, " + "; ".join(
            f"{name}: TTFT {f(get(p)['ttft_s'])} s, decode {f(get(p)['decode_tokens_per_s'])} tok/s"
            for name, p in probes.items()))
    lines.append(f"  RSS {result['rss_mib']['start']:.0f} -> {result['rss_mib']['end']:.0f} MiB "
                 f"(max {result['rss_mib']['max']:.0f}), threads {result['threads']['start']} -> "
                 f"{result['threads']['end']}, fds {result['fds']['start']} -> {result['fds']['end']}")
    lines.append(f"  load average {result['load_average']['start'][0]:.2f} -> "
                 f"{result['load_average']['end'][0]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, quick_help="100 requests instead of 1,000")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--requests", type=int, default=None, help="load requests (default 1000; "
                   "100 with --quick)")
    p.add_argument("--clients", type=int, default=SoakConfig.clients)
    p.add_argument("--load-minutes", type=float, default=None,
                   help="stop sending load requests after this long (the JSON's 'requests' "
                        "says how many ran)")
    p.add_argument("--probe-repeats", type=int, default=SoakConfig.probe_repeats)
    p.add_argument("--sample-s", type=float, default=SoakConfig.sample_s)
    p.add_argument("--no-restart", action="store_true",
                   help="no control: the end probes only on the soaked server (default: also "
                        "on a server started after the load, in alternation)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for the server (repeat; e.g. --server-arg=--max-running=8)")
    args = p.parse_args(argv)
    cfg = SoakConfig(requests=args.requests or (100 if args.quick else 1000),
                     clients=args.clients, probe_repeats=args.probe_repeats,
                     sample_s=args.sample_s, seed=args.seed,
                     load_s=None if args.load_minutes is None else 60 * args.load_minutes)
    out = make_run_dir(args.out, "serve_soak")
    with tempfile.TemporaryDirectory(prefix="serve-soak-") as secret:  # the tokens: gone after
        pids: list[int] = []

        def start(name: str) -> ServerProcess:
            server = ServerProcess(args.model, Path(secret) / name, out / f"{name}.log",
                                   cfg.clients, args.model_dir, tuple(args.server_arg))
            pids.append(server.pid)
            return server
        server = start("server")
        try:
            result = soak(server, SHAPES[args.model], cfg,
                          None if args.no_restart else (lambda: start("restarted")))
        finally:
            server.close()
    result.update(model=args.model, server_pids=pids, config={**asdict(cfg), "server_args": args.server_arg,
                                            "omp_num_threads": server.threads_env},
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_json(out / "serve_soak.json", result)
    print(summary(result))
    print_results_dir(out)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
