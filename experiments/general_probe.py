"""A general-knowledge probe: does fine-tuning on Python docstrings cost the chat model what it
knew before? Ten fixed questions outside the fine-tuning data (and away from the general pairs
the chat task rehearses, ``node.tasks.general_data``), each with its expected answer and a plausible
wrong one, asked as a chat user asks them: no system prompt (the template's default). Scores:
how often the model gives the expected answer the higher log-likelihood (the whole answer, its
end-of-turn included) and the mean margin in nats -- a likelihood comparison, so it moves
smoothly -- and, what a user sees, how often the greedy reply contains the expected answer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from node.tasks import instruct_data as qa
from node.models.chat import ChatCodec

PROBE: tuple[tuple[str, str, str], ...] = (
    ("What is the capital of France?", "Paris", "Berlin"),
    ("How many days are there in a week?", "Seven", "Five"),
    ("What color is the sky on a clear day?", "Blue", "Green"),
    ("What is 2 plus 2?", "4", "5"),
    ("Which planet is known as the Red Planet?", "Mars", "Venus"),
    ("What do bees make?", "Honey", "Milk"),
    ("What is the largest ocean on Earth?", "The Pacific Ocean", "The Arctic Ocean"),
    ("How many legs does a spider have?", "Eight", "Six"),
    ("What is frozen water called?", "Ice", "Steam"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare", "Charles Dickens"),
)
"""(question, expected answer, distractor)."""
ALSO_RIGHT: dict[str, tuple[str, ...]] = {
    "Seven": ("7",), "4": ("four",), "Eight": ("8",), "The Pacific Ocean": ("Pacific",),
    "William Shakespeare": ("Shakespeare",)}
"""Other spellings of an expected answer that a greedy reply may use ("7 days", "8 legs")."""


def reply_is_right(expected: str, reply: str) -> bool:
    """Whether ``reply`` contains ``expected`` or one of its ``ALSO_RIGHT`` forms as whole words
    (case-folded: "8 legs" is right for "Eight", "48" is not "4", "price" is not "Ice")."""
    return any(re.search(rf"\b{re.escape(form.casefold())}\b", reply.casefold())
               for form in (expected, *ALSO_RIGHT.get(expected, ())))


@dataclass(frozen=True)
class ProbeScore:
    accuracy: float
    """Share of questions whose expected answer is more likely than the distractor."""
    margin: float
    """Mean log-likelihood of the expected answer minus the distractor's (nats)."""
    greedy: float
    """Share of questions whose greedy reply contains the expected answer (``reply_is_right``)."""
    replies: tuple[str, ...]
    """The greedy replies, in ``PROBE``'s order."""


def _log_likelihood(model: torch.nn.Module, codec: ChatCodec, question: str, answer: str,
                    max_len: int) -> float:
    """log p(answer | chat-templated question) under ``model``."""
    ids, labels = qa.batch(codec, [qa.QAPair("probe", question, answer, system=None)], max_len)
    return -float(qa.answer_loss(model, ids, labels, reduction="sum"))


def probe_score(model: torch.nn.Module, codec: ChatCodec, max_len: int = 384,
                reply_tokens: int = 24) -> ProbeScore:
    """The model's score on ``PROBE`` (eval mode, no gradients; ``reply_tokens`` per greedy reply)."""
    model.eval()
    margins, replies = [], []
    with torch.no_grad():
        for question, good, bad in PROBE:
            margins.append(_log_likelihood(model, codec, question, good, max_len)
                           - _log_likelihood(model, codec, question, bad, max_len))
            replies.append(qa.greedy_reply(model, codec, question, reply_tokens, system=None))
    if not all(math.isfinite(m) for m in margins):
        raise FloatingPointError("the probe's log-likelihoods are not finite")
    hits = [reply_is_right(good, reply) for (_, good, _), reply in zip(PROBE, replies)]
    return ProbeScore(sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins),
                      sum(hits) / len(hits), tuple(replies))
