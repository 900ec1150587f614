"""The chat workload a node serves between rounds: multi-turn sessions behind one system prompt.

User texts are slices of the node's held-out share (bytes it never trains on); how many turns a
session has, how long each text and reply are and the order in which turns of different
sessions arrive come from the Mooncake conversation trace when one is given (requests that
share their first two block ids are one conversation; its new input per turn and its output
lengths are scaled down to the tiny model's context), and from a seeded geometric shape
otherwise. Only lengths and order are taken from the trace: it holds no text.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_ENV = "FEDKV_SERVE_TRACE"
"""Path of a Mooncake conversation trace that shapes the workload (unset: the synthetic shape;
the project never needs one, and looks nowhere else for it)."""


@dataclass(frozen=True)
class Turn:
    session: int
    """Index of the session (0 .. sessions-1) this turn belongs to."""
    text: bytes
    reply_bytes: int


@dataclass(frozen=True)
class Conversation:
    """One session's shape: (new input length, output length) per turn, in trace units."""

    turns: list[tuple[int, int]]


def find_trace() -> Path | None:
    """The conversation trace ``$FEDKV_SERVE_TRACE`` names, if that file exists."""
    env = os.environ.get(TRACE_ENV)
    return Path(env) if env and Path(env).is_file() else None


@functools.lru_cache(maxsize=4)  # a node serves every round: parse the trace once
def load_conversations(path: str | os.PathLike, limit: int = 4000) -> list[Conversation]:
    """Group a Mooncake trace's first ``limit`` requests into conversations, in arrival order."""
    groups: dict[tuple, list[dict]] = {}
    with open(path) as fh:
        for i, line in enumerate(fh):
            if i >= limit:
                break
            row = json.loads(line)
            groups.setdefault(tuple(row["hash_ids"][:2]), []).append(row)
    out = []
    for rows in groups.values():
        prev, turns = 0, []
        for r in sorted(rows, key=lambda r: r["timestamp"]):
            turns.append((max(1, int(r["input_length"]) - prev), max(1, int(r["output_length"]))))
            prev = int(r["input_length"]) + int(r["output_length"])
        out.append(Conversation(turns))
    if not out:
        raise ValueError(f"trace {path} holds no requests")
    return out


def synthetic_conversations(n: int, rng: random.Random, max_turns: int) -> list[Conversation]:
    """Geometric turn counts (mean ~2), text 2-4x as long as the reply, like chat traces."""
    out = []
    for _ in range(n):
        k = 1
        while k < max_turns and rng.random() < 0.5:
            k += 1
        out.append(Conversation([(rng.randint(2, 4), 1) for _ in range(k)]))
    return out


def _scale(conv: Conversation, budget: int, max_turns: int, max_reply: int) -> list[tuple[int, int]]:
    """Turn lengths in bytes: the conversation's proportions squeezed into ``budget`` bytes."""
    turns = conv.turns[:max_turns]
    total = sum(a + b for a, b in turns)
    out = []
    for a, b in turns:
        reply = max(1, min(max_reply, budget * b // total))  # floors: the shares fit
        text = max(1, budget * a // total)
        if sum(x + y for x, y in out) + text + reply > budget:
            break  # rounding up to 1 byte each must not pass the context
        out.append((text, reply))
    return out or [(max(1, budget - 1), 1)]


@dataclass(frozen=True)
class WorkloadConfig:
    sessions: int = 4
    """Chat sessions per serving pass (run-config ``serve-sessions``; 0 = serve nothing)."""
    max_turns: int = 4
    """Turns kept per session (longer trace conversations are cut)."""
    max_reply: int = 8
    """Reply bytes per turn at most (each one a decode step)."""
    context_budget: int = 72
    """Bytes of text + replies per session after the system prompt (the lm model's context
    is 128 bytes; the system prompt takes 54)."""


def plan_turns(cfg: WorkloadConfig, heldout: bytes, seed: int,
               trace: str | os.PathLike | None = None) -> list[Turn]:
    """Every turn of ``cfg.sessions`` sessions, interleaved in arrival order (turn t of each
    session before turn t+1 of any: conversations alternate with their users' think time)."""
    if cfg.sessions < 0 or cfg.max_turns < 1 or cfg.max_reply < 1 or cfg.context_budget < 2:
        raise ValueError(f"invalid workload {cfg}")
    rng = random.Random(seed)
    pool = load_conversations(trace) if trace else synthetic_conversations(
        max(cfg.sessions, 1) * 4, rng, cfg.max_turns)
    convs = [pool[rng.randrange(len(pool))] for _ in range(cfg.sessions)]
    shaped = [_scale(c, cfg.context_budget, cfg.max_turns, cfg.max_reply) for c in convs]
    turns = []
    for t in range(max((len(s) for s in shaped), default=0)):
        for i, s in enumerate(shaped):
            if t < len(s):
                text_len, reply = s[t]
                start = rng.randrange(max(1, len(heldout) - text_len))
                turns.append(Turn(i, heldout[start : start + text_len], reply))
    return turns
