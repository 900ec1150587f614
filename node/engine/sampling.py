"""How a generation request picks each token: OpenAI's and vLLM's sampling options.

``SamplingParams`` is what a request asks for (defaults are OpenAI's: temperature 1, nothing
else on); ``Sampler`` is one sample's state (its seeded ``torch.Generator``, the tokens it
produced, its grammar matcher) and ``pick`` the per-token step, in vLLM's order:

1. logprobs, when asked, of the **raw** model logits (``log_softmax`` before any processor:
   vLLM's default ``raw_logprobs``), the chosen token's and the ``logprobs`` most likely;
2. penalties (``apply_penalties``): ``repetition_penalty`` over prompt + output tokens as in
   Hugging Face (a seen token's positive logit divided by it, a negative one multiplied),
   ``presence_penalty`` / ``frequency_penalty`` over the output tokens only, as OpenAI defines;
3. the grammar's mask (``node.engine.structured_output``), when the request constrains its output;
4. temperature 0: argmax; else softmax(logits / temperature), then ``min_p``, ``top_k``,
   ``top_p`` on the probabilities, and one draw with the sample's generator.

The processors are pure functions of tensors so each is tested alone.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_LOGPROBS = 20
"""Most ``top_logprobs`` a request may ask for (OpenAI's chat limit, vLLM's default)."""


class Token(int):
    """A generated token id -- an ``int``, so a consumer that wants only the id keeps working --
    carrying its ``logprob`` (of the raw model logits; None unless the request asked) and
    ``top_logprobs``: ``(id, logprob)`` of the most likely tokens, most likely first."""

    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]

    def __new__(cls, token: int, logprob: float | None = None,
                top: tuple[tuple[int, float], ...] = ()) -> "Token":
        self = super().__new__(cls, token)
        self.logprob, self.top_logprobs = logprob, top
        return self


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling options (checked here: a ValueError names the field)."""

    temperature: float = 1.0
    """0: greedy (argmax); OpenAI's default 1."""
    top_p: float = 1.0
    """Nucleus: the smallest set of tokens whose probability reaches it, in (0, 1]."""
    top_k: int = -1
    """The k most likely tokens only; -1: all (vLLM's convention)."""
    min_p: float = 0.0
    """Tokens less likely than ``min_p`` times the most likely one are dropped, in [0, 1]."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """> 0; 1: off. Over prompt + output, as Hugging Face and vLLM apply it."""
    logprobs: int | None = None
    """None: no logprobs; k in [0, 20]: each token carries its logprob and the k most likely."""
    grammar: Any = field(default=None, compare=False)
    """A compiled constraint (``node.engine.structured_output.Grammar``): each sample gets a matcher."""

    def __post_init__(self) -> None:
        _check("temperature", self.temperature, 0.0, math.inf)
        _check("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check("min_p", self.min_p, 0.0, 1.0)
        _check("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True)
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) \
            != (0.0, 0.0, 1.0)

    @classmethod
    def of(cls, sampling: Any) -> "SamplingParams":
        """``sampling`` itself, or a ``node.engine.sessions.Sampling`` (temperature, top_p) as params."""
        if isinstance(sampling, cls):
            return sampling
        return cls(temperature=sampling.temperature, top_p=sampling.top_p)


def _check(name: str, v: float, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    if not ok or not (lo < v if lo_open else lo <= v) or v > hi:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be a number in {span}, got {v!r}")


GREEDY = SamplingParams(temperature=0.0)


# -- the processors (pure) ----------------------------------------------------------------------
def apply_penalties(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
                    presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """``logits`` ``[vocab]`` penalized (a new tensor; the same one when all are neutral)."""
    if (presence, frequency, repetition) == (0.0, 0.0, 1.0):
        return logits
    vocab = logits.shape[-1]
    out = logits.float().clone()
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)[:vocab]
    if repetition != 1.0:
        seen = counts > 0
        ids = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.long)
        seen[ids] = True
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    return out - frequency * counts - presence * (counts > 0)


def apply_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero the probabilities below ``min_p`` times the largest (the largest always stays)."""
    if min_p <= 0:
        return probs
    return torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))


def apply_top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest probabilities (-1 or k >= vocab: all)."""
    if k < 1 or k >= probs.shape[-1]:
        return probs
    top = probs.topk(k)
    return torch.zeros_like(probs).scatter_(0, top.indices, top.values)


def apply_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep a token while the mass of those more likely is below ``top_p`` (the first stays)."""
    if top_p >= 1:
        return probs
    p, idx = probs.sort(descending=True)
    keep = (p.cumsum(0) - p) < top_p
    return torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(token id, logprob)``, most likely first."""
    if k <= 0:
        return ()
    top = logprobs.topk(min(k, logprobs.shape[-1]))
    return tuple(zip(top.indices.tolist(), top.values.tolist()))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the index of its first largest logit (a NaN counts as largest,
    as in ``torch.max``), int64 of ``logits.shape[:-1]``. numpy's ``argmax`` where numpy reads
    the tensor in place (a CPU fp32/fp64 tensor): torch's CPU index reductions (``max``'s
    indices, ``argmax``) compare element by element, numpy's run on the CPU's vector units --
    over a 49,152-token vocabulary on every step, the gap is a visible share of a decode step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.as_tensor(logits.detach().resolve_neg().numpy().argmax(-1))
    return logits.max(-1).indices


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from processed ``logits``: argmax at temperature 0, else a draw."""
    if params.greedy:
        return int(greedy(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    probs = apply_top_p(apply_top_k(apply_min_p(probs, params.min_p), params.top_k), params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


# -- one sample's state -------------------------------------------------------------------------
class Sampler:
    """One sample's token picker: its generator, its own output so far, its grammar matcher."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], seed: int | None = None):
        self.params = params
        self.prompt = tuple(prompt) if params.repetition_penalty != 1.0 else ()
        self.output: list[int] = []
        self.generator = None if params.greedy else \
            torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
        self.matcher = params.grammar.matcher() if params.grammar is not None else None

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def pick(self, logits: torch.Tensor) -> Token | None:
        """The next token from the model's ``logits`` ``[vocab]``, recorded as this sample's;
        None when a grammar allows no token at all (its output is complete: stop)."""
        p = self.params
        logprob, top = None, ()
        if p.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
        processed = apply_penalties(logits, self.prompt, self.output, p.presence_penalty,
                                    p.frequency_penalty, p.repetition_penalty)
        if self.matcher is not None:
            processed = self.matcher.mask(processed)
            if processed is None:
                return None
        token = draw(processed, p, self.generator)
        if p.logprobs is not None:
            logprob, top = float(lp[token]), top_logprobs(lp, p.logprobs)
        if self.matcher is not None:
            self.matcher.accept(token)
        if p.penalized:
            self.output.append(token)
        return Token(token, logprob, top)
