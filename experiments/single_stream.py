"""One client, one fresh prompt: each backend's time to first token and decode speed
(``experiments.serve_load``'s ``single_fresh`` section).

A user's first question to an idle server: a prompt no cache holds (random tokens, new for
every request, so neither fedkv's nor vLLM's prefix cache can hit), ``new_tokens`` greedy tokens
streamed back. ``ttft_s`` is submit to first token; ``decode_tokens_per_s`` is the tokens after
the first over the time from the first to the last. Each repeat runs every backend once, in
rotated order, each on a fresh backend; figures are medians over repeats.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from node.engine.generation import GenerationRequest

METRICS = ("ttft_s", "decode_tokens_per_s")


@dataclass(frozen=True)
class SingleConfig:
    prompt_tokens: int = 512
    new_tokens: int = 128
    repeats: int = 3
    timeout_s: float = 600.0
    settle_s: float = 2.0
    """Idle seconds before each request (``experiments.serve_load.LoadConfig.settle_s``)."""


def fresh_prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    """``n`` random token ids (special ids 0-3 left out), different for every seed."""
    rng = random.Random(seed)
    return tuple(rng.randrange(4, vocab) for _ in range(n))


def measure(backend: Any, prompt: Sequence[int], new_tokens: int, timeout_s: float,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """One request on ``backend`` (a ``GenerationBackend``): its TTFT and decode speed; NaN
    for what a failed or cut request did not show."""
    t0 = clock()
    times: list[float] = []
    (h,) = backend.submit(GenerationRequest(tuple(prompt), new_tokens, tenant="single"))
    for _ in h.tokens(timeout=timeout_s):
        times.append(clock())
    ttft = times[0] - t0 if times else math.nan
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"ttft_s": ttft, "decode_tokens_per_s": (len(times) - 1) / span if span > 0 else math.nan,
            "tokens": len(times), "finish_reason": h.finish_reason}


def run(make: Callable[[str], Any], systems: Sequence[str], cfg: SingleConfig, vocab: int,
        seed: int, clock: Callable[[], float] = time.perf_counter,
        focus: Callable[[str], None] = lambda system: None) -> dict[str, Any]:
    """Each of ``systems`` (``make(system)`` builds a fresh backend, closed after its request)
    ``cfg.repeats`` times: ``{system: {metric: median, "samples": [...]}}`` plus the settings.
    ``focus(system)`` runs before each system's turn (serve_load pauses the other servers)."""
    samples: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(cfg.repeats):
        k = rep % len(systems)
        for i, system in enumerate(systems[k:] + systems[:k]):
            focus(system)
            time.sleep(cfg.settle_s)
            backend = make(system)
            try:
                prompt = fresh_prompt(cfg.prompt_tokens, vocab, seed * 1000 + rep * 10 + i)
                samples[system].append(measure(backend, prompt, cfg.new_tokens, cfg.timeout_s, clock))
            finally:
                backend.close()
    out: dict[str, Any] = {"prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens,
                           "repeats": cfg.repeats}
    for s, xs in samples.items():
        out[s] = {m: statistics.median(x[m] for x in xs) for m in METRICS}
        out[s]["samples"] = xs
    return out
