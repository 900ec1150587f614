"""Distributed DP's noise top-up: the noise shares of sampled nodes that left a round.

Under dp-mode distributed each sampled node adds σC/√k of noise; when only some of the k
replied, the aggregate lacks the shares of those that left. They are made up before the round's
aggregate is final:

* he=true: survivors make the missing shares (``query.fedkv_noise``; signed, tagged
  contributions of kind noise, ``federation.contribution.make_noise_shares``), so every summand
  of an aggregate is a node's and a node can check it (``crypto.binding``); each survivor knows
  only its own extra shares, and which survivor makes how many is drawn from OS entropy. A
  noise reply passes the same checks as an update (``SummandGate``) before it is added.
* he=false: the server draws the shares itself.

``by_node`` (the shares each survivor made this round) goes to the privacy ledger: a node
knows the noise it made itself (``federation.privacy_ledger``).
"""

from __future__ import annotations

import random
import time
from logging import INFO
from typing import Any, Protocol

import numpy as np
from flwr.common import log

from crypto import CONTRIBUTION_NOISE, ManifestEntry, noise_std
from federation import messages, protocol
from federation.codec import Aggregator, wire_noise
from federation.config import RunConfig
from federation.results import RoundRecord

__all__ = ["NoiseTopUp", "SummandGate"]


class SummandGate(Protocol):
    """What the strategy checks of every summand (``OpaqueFedAvg``): drop a node with a reason,
    and admit a signed contribution into the aggregate (signature, header, the aggregator's checks)."""

    def drop(self, out: Any, node: int, phase: str, reason: str) -> None: ...

    def admit_summand(self, agg: Aggregator, out: Any, node: int, phase: str, blob: bytes, kind: int,
                      shares: int) -> Any: ...


class NoiseTopUp:
    """Makes up a round's missing noise shares (see the module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rng = random.SystemRandom()  # who makes missing noise shares: not derivable from the seed
        self.noise_rng = np.random.default_rng()
        self.by_node: dict[int, int] = {}
        """This round's noise shares each survivor made for left-out nodes (he=true)."""

    def top_up(self, grid: Any, rnd: int, agg: Aggregator, survivors: list[int], rec: RoundRecord,
               entries: list[ManifestEntry], gate: SummandGate, replies_out: Any) -> int:
        """Add the noise shares of the sampled nodes that are not among ``survivors``; returns the
        shares added beyond the survivors' own (``rec.noise_shares_added``). Noise replies that
        fail a check drop their node into ``replies_out`` (``strategy.PhaseReplies``)."""
        self.by_node = {}
        missing = rec.sampled - len(survivors)
        if self.cfg.dp_mode != "distributed" or missing <= 0 or self.cfg.noise_multiplier <= 0:
            return 0
        clip, sigma = wire_noise(self.cfg)  # (1, σ_Δ) under adaptive clipping: updates travel as Δ/C
        std = noise_std(sigma, clip, "distributed", rec.sampled)
        t0 = time.perf_counter()
        if self.cfg.he:
            added = self._from_survivors(grid, rnd, agg, survivors, missing, rec, entries, gate, replies_out)
        else:
            agg.add_noise(std, shares=missing, rng=self.noise_rng)
            added = missing
        rec.seconds["noise"] = time.perf_counter() - t0
        rec.noise_shares_added = added
        log(INFO, "round %d: added %d of %d missing noise share(s) of std %.4g", rnd, added, missing, std)
        return added

    def plan(self, survivors: list[int], missing: int) -> dict[int, int]:
        """How many shares each survivor makes: ``missing`` spread evenly, in a random order."""
        plan = {n: missing // len(survivors) + (1 if i < missing % len(survivors) else 0)
                for i, n in enumerate(self.rng.sample(survivors, len(survivors)))}
        return {n: k for n, k in plan.items() if k > 0}

    def _from_survivors(self, grid: Any, rnd: int, agg: Aggregator, survivors: list[int], missing: int,
                        rec: RoundRecord, entries: list[ManifestEntry], gate: SummandGate, out: Any) -> int:
        plan = self.plan(survivors, missing)
        msgs = [messages.noise_request(n, messages.NoiseRequest(rnd, k, rec.sampled)) for n, k in plan.items()]
        added = 0
        got = grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)
        sent = protocol.destinations(msgs)
        for reply in got:
            node = protocol.reply_sender(reply, sent)
            if node not in plan or any(e.node_id == str(node) and e.kind == CONTRIBUTION_NOISE for e in entries):
                continue
            if reply.has_error():
                gate.drop(out, node, "noise", f"client error: {protocol.error_text(reply)}")
                continue
            try:
                blob = messages.parse_noise_reply(reply)
            except messages.BadReply as err:
                gate.drop(out, node, "noise", f"bad reply: {err}")
                continue
            signed = gate.admit_summand(agg, out, node, "noise", blob, CONTRIBUTION_NOISE, plan[node])
            if signed is not None:
                entries.append(ManifestEntry(signed.node_id, CONTRIBUTION_NOISE, signed.digest, signed.tag))
                added += plan[node]
                self.by_node[node] = plan[node]
        return added
