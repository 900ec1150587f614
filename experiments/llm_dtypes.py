"""fedkv's model in other weight formats (``node.models.precision``: bf16, weight-only int8) beside the
fp32 reference in ``experiments.bench_llm``: the variant models, their sessions for the
interleaved decode timing, prefill time, quality against fp32, and the fraction of the
memory-bandwidth ceiling each reaches (weight bytes a decode step reads / measured read
bandwidth of one core)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

from cache import huge_pages
from experiments.llm_contenders import FedkvSessions, bytes_per_token, fedkv_cache
from node.models import kernels, precision
from node.models.llama import LlamaConfig, LlamaModel

KEYS = {"bfloat16": ("fedkv_bf16", "bf16"), "int8": ("fedkv_int8_weights", "int8_weights")}
"""Weight format -> (its decode key beside ``fedkv_fp32``, its ``quality`` key). Int8
*weights* are ``int8_weights``: ``fedkv_int8`` / ``quality.int8`` already name the int8 KV
cache."""


def variant_models(model: LlamaModel, dtypes: tuple[str, ...]) -> dict[str, LlamaModel]:
    """Decode key -> a copy of ``model`` (fp32) converted to each format of ``dtypes``."""
    out = {}
    for d in dtypes:
        if d not in KEYS:
            raise ValueError(f"weight format {d!r} is not a variant; use some of {list(KEYS)}")
        copy = LlamaModel.from_state_dict(model.cfg, model.state_dict())
        out[KEYS[d][0]] = precision.convert(copy, d)
    return out


def variant_sessions(variants: dict[str, LlamaModel], prompt: list[int], extra: int,
                     block: int) -> dict[str, FedkvSessions]:
    """Each variant's own session on ``prompt``, prefilled by that variant (untimed) into its
    own cache, in the K/V format its server stores (bf16 for bf16 and int8 weights); greedy
    from its own last logits."""
    out = {}
    for key, m in variants.items():
        kv = fedkv_cache(m, len(prompt) + extra + 2 * block, None, block)
        sid = kv.open_session()
        out[key] = FedkvSessions(m, kv, [sid], m.prefill(prompt, kv, sid)[None])
    return out


def prefill_ms(models: dict[str, LlamaModel], prompt: list[int], repeats: int,
               block: int) -> dict[str, list[float]]:
    """Milliseconds to prefill ``prompt`` into a new session (last logits only), each model
    in turn, the order rotating every repeat."""
    names = list(models)
    out: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            m = models[name]
            kv = fedkv_cache(m, len(prompt) + 2 * block, None, block)
            sid = kv.open_session()
            t0 = time.perf_counter()
            m.prefill(prompt, kv, sid)
            out[name].append(1e3 * (time.perf_counter() - t0))
    return out


def read_size(nbytes: int) -> int:
    """The bytes a reader of about ``nbytes`` reads: whole fp32 values, at least one."""
    return max(1, nbytes // 4) * 4


def reader_names() -> list[str]:
    """Each way this machine has to read a buffer once, as a step reads its weights: torch's
    ``sum`` on ordinary pages, and the kernels' prefetched stream (``read_stream``, the way the
    products read) on ordinary and on huge pages (``cache.huge_pages``)."""
    return ["torch_sum"] + (["stream", "stream_huge_pages"] if kernels.ops() is not None else [])


def reader(name: str, nbytes: int) -> Callable[[], object]:
    """One read of a buffer of :func:`read_size` bytes by ``name`` (of :func:`reader_names`);
    the buffer is made here, for this reader alone."""
    n = read_size(nbytes) // 4
    if name == "torch_sum":
        return torch.ones(n).sum
    ops = kernels.ops()
    buf = huge_pages.zeros((n,), torch.float32) if name == "stream_huge_pages" else torch.empty(n)
    buf.fill_(1.0)
    return lambda: ops.read_stream(buf)


def read_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of reading a buffer of ``nbytes`` again and again (as a step re-reads its
    weights) on the current torch thread count, by each of :func:`reader_names` (one buffer
    at a time)."""
    out = {}
    for name in reader_names():
        read = reader(name, nbytes)
        read()
        xs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            xs.append(time.perf_counter() - t0)
        out[name] = read_size(nbytes) / statistics.median(xs) / 1e9
    return out


def read_bandwidths(models: dict[str, LlamaModel]) -> tuple[dict[str, float], dict[str, dict]]:
    """Per model, the fastest :func:`read_bandwidth` of a buffer the size of its weights, and
    every reader's figure."""
    by_reader = {k: read_bandwidth(precision.weight_bytes_per_token(m)) for k, m in models.items()}
    return {k: max(v.values()) for k, v in by_reader.items()}, by_reader


class ReadProbe:
    """A contender in the decode rotation (``experiments.llm_contenders.interleave``) that
    reads a buffer the size of a model's weights by the reader :func:`read_bandwidths` found
    fastest: one read a step, so its rate times ``nbytes`` is the read bandwidth of the
    same minutes the decode segments beside it ran in (this machine's bandwidth drifts by
    a fifth within a run)."""

    PREFIX = "read_probe:"
    """Its key in the rotation: this prefix and the model's decode key."""

    def __init__(self, nbytes: int, name: str):
        self.nbytes = read_size(nbytes)
        self.read = reader(name, nbytes)

    def step(self) -> int:
        self.read()
        return 1


def read_probes(models: dict[str, LlamaModel],
                by_reader: dict[str, dict[str, float]]) -> dict[str, ReadProbe]:
    """Rotation key -> a :class:`ReadProbe` per model, by its fastest reader."""
    return {ReadProbe.PREFIX + k: ReadProbe(precision.weight_bytes_per_token(m),
                                            max(by_reader[k], key=by_reader[k].get))
            for k, m in models.items()}


def probed_bandwidths(samples: dict[str, list[float]],
                      probes: dict[str, ReadProbe]) -> dict[str, list[float]]:
    """Model key -> GB/s of its probe in each rotation (segment), the probes' samples (reads/s)
    taken out of ``samples``."""
    return {key[len(ReadProbe.PREFIX):]: [r * p.nbytes / 1e9 for r in samples.pop(key)]
            for key, p in probes.items()}


def ceiling_fraction(tokens_per_s: float, model: LlamaModel, gbs: float) -> float:
    """Measured decode rate over the rate at which one step's weights can be read."""
    return tokens_per_s * precision.weight_bytes_per_token(model) / (gbs * 1e9)


def paired_ceiling_fraction(rates: list[float], model: LlamaModel, gbs: list[float]) -> float:
    """The median over rotations of :func:`ceiling_fraction`, each decode segment's rate over
    the bandwidth its own rotation's probe read: where the bandwidth moves between rotations,
    the median rate and the median bandwidth may come from different ones."""
    return statistics.median(ceiling_fraction(r, model, g)
                             for r, g in zip(rates, gbs, strict=True))


def step_bytes_fraction(tokens_per_s: float, model: LlamaModel, gbs: float,
                        context: float) -> float:
    """:func:`ceiling_fraction` counting what else a decode step reads: the K/V of its
    ``context`` tokens (the timed steps' mean length) in the format the model's cache stores
    them. Where this nears 1 and :func:`ceiling_fraction` does not, the step is bound by the
    K/V it reads."""
    kv = context * bytes_per_token(model, None)
    return tokens_per_s * (precision.weight_bytes_per_token(model) + kv) / (gbs * 1e9)


def quality(base: tuple[torch.Tensor, float], variants: dict[str, LlamaModel],
            score: Callable[[LlamaModel], tuple[torch.Tensor, float]]) -> tuple[dict, dict]:
    """``quality.<bf16|int8_weights>``: Δppl and top-1 agreement of each variant against
    ``base`` (fp32's log-probabilities and mean NLL over the same held-out windows);
    ``score(model)`` teacher-forces them as the KV-dtype rows are."""
    base_lp, base_nll = base
    out: dict[str, Any] = {}
    info: dict[str, Any] = {}
    by_key = {k[0]: k[1] for k in KEYS.values()}
    for key, m in variants.items():
        lp, nll = score(m)
        q = by_key[key]
        out[q] = {"ppl_delta": math.exp(nll) - math.exp(base_nll),
                  "top1_agreement": float((lp.argmax(-1) == base_lp.argmax(-1)).float().mean())}
        info[q] = {"ppl": math.exp(nll), "weight_bytes_per_token":
                   precision.weight_bytes_per_token(m)}
    return out, info
