"""One serving pass of a node's chat workload through its cache (between rounds,
``CacheNode.serve_between_rounds``), and what it measured.
(The HTTP serving agent, ``python -m node.serving.serve``, is ``node/serving/serve.py``.)

``serve_workload`` opens the sessions of a ``node.tasks.workload`` plan behind the shared system
prompt, plays their turns in arrival order and closes them; the system prompt's blocks stay
cached for the next pass (and, persisted, for the next process). The report is per pass:
prefix hits, hits per tier, tokens/s, tokens recomputed because a write-back made K/V stale,
the blocks the last write-back invalidated, and perplexity twice -- as served through the
cache and as a cache-free forward under the current weights computes it. Under
``kv-stale-policy=invalidate`` the two agree to float error (no stale K/V was used); under
``keep-k`` their ratio is the quality cost of serving K/V of older versions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from cache import KVCache
from node.models.interface import CachedLM
from node.engine.sessions import Sessions, TurnResult
from node.tasks.workload import Turn

TIERS = ("hot", "warm", "cold")


@dataclass
class ServeReport:
    """Counts of one pass; rates over nodes are derived where the counts are summed
    (``federation.results.serving_summary``)."""

    sessions: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    """System-prompt tokens looked up in the prefix cache (one prompt per session)."""
    prefix_hit_tokens: int = 0
    decode_tokens: int = 0
    """Reply tokens generated (one decode step each)."""
    seconds: float = 0.0
    """Time spent serving turns (the cache-free scoring of ``ppl_fresh`` excluded)."""
    tier_hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    lookups: int = 0
    """Prefix-cache block lookups (hits of any tier + the first miss of each chain)."""
    recomputed_tokens: int = 0
    """Tokens whose K/V had to be computed again because a write-back made them stale: an
    open session's conversation, or a system prompt cached under an older version."""
    invalidated_blocks: int = 0
    """Blocks the write-back(s) since the previous pass invalidated, in every tier."""
    stale_tokens_served: int = 0
    """Prefix tokens served from K/V of an older model version (``keep-k`` only)."""
    nll: float = 0.0
    nll_fresh: float = 0.0
    scored: int = 0
    shape: str = ""
    """Where the session shapes came from: ``mooncake`` (the trace) or ``synthetic``."""
    turn_ms: list[float] = field(default_factory=list, repr=False)
    """Wall time of each turn (session creation included for a session's first)."""

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.scored) if self.scored else math.nan

    @property
    def ppl_fresh(self) -> float:
        return math.exp(self.nll_fresh / self.scored) if self.scored else math.nan


def _counters(cache: KVCache) -> dict:
    s = cache.stats()
    return {"hit_tokens": s["prefix_hit_tokens"], "stale_tokens": s["stale_hit_tokens"],
            "lookups": s["prefix_hit_blocks"] + s["prefix_miss_blocks"],
            **{t: s["tier_hits"].get(t, 0) for t in TIERS}}


@torch.no_grad()
def _fresh_nll(model: CachedLM, history: list[int], n: int) -> float:
    """Log-loss of the last ``n`` tokens of ``history`` from a cache-free forward."""
    logits = model(torch.as_tensor(history, dtype=torch.long)[None])[0]
    target = torch.as_tensor(history[-n:], dtype=torch.long)
    return float(torch.nn.functional.cross_entropy(logits[-n - 1 : -1], target, reduction="sum"))


def _count(rep: ServeReport, r: TurnResult, model: CachedLM, history: bytes) -> None:
    rep.turns += 1
    rep.decode_tokens += len(r.reply)
    rep.recomputed_tokens += r.recomputed
    rep.prompt_tokens += r.recomputed  # offered to the prefix cache again
    if r.scored:  # the reply follows the text in the conversation: score the text, not it
        rep.nll += r.nll
        rep.nll_fresh += _fresh_nll(model, list(history[: -len(r.reply) or None]), r.scored)
        rep.scored += r.scored


def serve_workload(sessions: Sessions, system_prompt: bytes, turns: list[Turn]) -> ServeReport:
    """Play ``turns`` through ``sessions`` (each session opened on first use, all closed at
    the end, also on an error) and report what serving them cost and hit."""
    cache, model = sessions.cache, sessions.model
    before, rep = _counters(cache), ServeReport()
    rep.recomputed_tokens = cache.stale_prefix_tokens(list(system_prompt))
    rep.invalidated_blocks = cache.take_invalidated()
    ids: dict[int, str] = {}
    try:
        for turn in turns:
            t0 = time.perf_counter()
            if turn.session not in ids:
                ids[turn.session] = sessions.create(system_prompt)
                rep.prompt_tokens += len(system_prompt)
            sid = ids[turn.session]
            r = sessions.turn(sid, turn.text, turn.reply_bytes)
            rep.turn_ms.append((time.perf_counter() - t0) * 1e3)  # serving only, not scoring
            _count(rep, r, model, sessions.history(sid))
    finally:
        for sid in ids.values():
            sessions.close(sid)
    rep.seconds = sum(rep.turn_ms) / 1e3
    after = _counters(cache)
    rep.sessions = len(ids)
    rep.prefix_hit_tokens = after["hit_tokens"] - before["hit_tokens"]
    rep.stale_tokens_served = after["stale_tokens"] - before["stale_tokens"]
    rep.lookups = after["lookups"] - before["lookups"]
    rep.tier_hits = {t: after[t] - before[t] for t in TIERS}
    return rep
