"""OpaqueFedAvg: FedAvg over encoded update bytes, driving the ``Grid`` directly.

Why not subclass ``flwr.serverapp.strategy.FedAvg``: its ``start()`` loop carries an
``ArrayRecord`` of plaintext global weights between rounds and evaluates it; here the
server must never hold the model, only bytes and an ``Aggregator`` built from public
material, so the loop is ours (``grid.send_and_receive``, ~one screen of code).

Global versions: aggregate k (``history[k-1]``) turns global v(k-1) into vk. Every
message carries the aggregates the destination node may lack, so a node that skipped
rounds (sampling, a crash, a timeout) catches up before it trains or evaluates.

Faults (a round goes on with the clients that remain):
* a reply carrying an error (the ClientApp raised) -> left out, reason logged
* no reply within ``round-timeout`` -> left out
* bytes the aggregator rejects (any exception from ``add``: ``CodecError``, crypto
  errors) or a malformed reply -> left out
* fewer than ``min-clients`` usable updates (or connected nodes) -> ``NotEnoughClients``
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from federation import protocol
from federation.codec import Aggregator
from federation.config import RunConfig
from federation.results import RoundRecord, mean, weighted_mean

SOURCES = {0: "built", 1: "restored", 2: "reused"}


class NotEnoughClients(RuntimeError):
    """Fewer usable clients than ``min-clients``: the run stops."""


@dataclass
class PhaseReplies:
    """Replies of one phase, split into usable ones and left-out nodes with reasons."""

    ok: list[Message] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)


class OpaqueFedAvg:
    """Weighted FedAvg of opaque updates; the server sees bytes and public material only."""

    def __init__(
        self,
        cfg: RunConfig,
        make_aggregator: Callable[[], Aggregator],
        wait_for_nodes_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        self.make_aggregator = make_aggregator
        self.wait_for_nodes_s = wait_for_nodes_s
        self.history: list[bytes] = []
        self.known_version: dict[int, int] = {}
        """Last global version each node confirmed; 0 (resend all) when unknown."""
        self.rng = random.Random(cfg.seed)
        self.noise_rng = np.random.default_rng()

    # -- the loop ---------------------------------------------------------------------
    def run(self, grid: Grid, on_round: Callable[[RoundRecord], None]) -> None:
        """All rounds; ``on_round`` gets each finished round. Raises NotEnoughClients."""
        for rnd in range(1, self.cfg.num_server_rounds + 1):
            on_round(self.round(grid, rnd))

    def round(self, grid: Grid, rnd: int) -> RoundRecord:
        rec = RoundRecord(round=rnd)
        nodes = self.wait_for_nodes(grid)
        sampled = self.sample(nodes)
        rec.sampled = len(sampled)

        t0 = time.perf_counter()
        replies = grid.send_and_receive(
            self.configure(protocol.TRAIN, rnd, sampled), timeout=self.cfg.round_timeout
        )
        train = self.collect("train", sampled, replies)
        rec.seconds["train_phase"] = time.perf_counter() - t0
        self.aggregate_train(rnd, train, rec)

        t0 = time.perf_counter()
        replies = grid.send_and_receive(
            self.configure(protocol.EVALUATE, rnd, nodes), timeout=self.cfg.round_timeout
        )
        evaluated = self.collect("evaluate", nodes, replies)
        rec.seconds["evaluate_phase"] = time.perf_counter() - t0
        self.aggregate_evaluate(evaluated, rec)
        return rec

    # -- node selection -----------------------------------------------------------------
    def wait_for_nodes(self, grid: Grid) -> list[int]:
        """Connected node ids, waiting up to ``wait_for_nodes_s`` for ``min-clients``."""
        deadline = time.monotonic() + self.wait_for_nodes_s
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= self.cfg.min_clients:
                return nodes
            if time.monotonic() >= deadline:
                raise NotEnoughClients(
                    f"only {len(nodes)} node(s) connected after {self.wait_for_nodes_s:.0f}s; "
                    f"min-clients={self.cfg.min_clients}"
                )
            time.sleep(1.0)

    def sample(self, nodes: list[int]) -> list[int]:
        k = max(self.cfg.min_clients, math.ceil(self.cfg.fraction_train * len(nodes)))
        return sorted(self.rng.sample(nodes, min(k, len(nodes))))

    # -- messages -----------------------------------------------------------------------
    def configure(self, message_type: str, rnd: int, node_ids: list[int]) -> list[Message]:
        """One message per node: the aggregates it may lack + the round's config.

        Train messages of round r bring nodes to v(r-1); evaluate messages to v r.
        """
        target = len(self.history)
        messages = []
        for node_id in node_ids:
            have = min(self.known_version.get(node_id, 0), target)
            content = RecordDict(
                {
                    protocol.AGGREGATES: protocol.pack_aggregates(self.history, have),
                    protocol.CONFIG: ConfigRecord(
                        {"server-round": rnd, "target-version": target, "num-sampled": len(node_ids)}
                    ),
                }
            )
            messages.append(Message(content, dst_node_id=node_id, message_type=message_type))
        return messages

    def collect(self, phase: str, expected: list[int], replies: Iterable[Message]) -> PhaseReplies:
        """Split replies into usable ones and dropped nodes (error, missing, malformed)."""
        out = PhaseReplies()
        seen: set[int] = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            seen.add(node)
            if reply.has_error():
                self._drop(out, node, phase, f"client error: {reply.error.reason}")
            elif protocol.METRICS not in reply.content.metric_records:
                self._drop(out, node, phase, "reply has no metrics record")
            else:
                out.ok.append(reply)
        for node in expected:
            if node not in seen:
                self._drop(out, node, phase, f"no reply within round-timeout={self.cfg.round_timeout}s")
        return out

    def _drop(self, out: PhaseReplies, node: int, phase: str, reason: str) -> None:
        log(WARNING, "%s: leaving out node %s: %s", phase, node, reason)
        out.dropped.append({"node": node, "phase": phase, "reason": reason})
        self.known_version[node] = 0  # unknown state: resend the whole history next time

    # -- aggregation --------------------------------------------------------------------
    def aggregate_train(self, rnd: int, train: PhaseReplies, rec: RoundRecord) -> None:
        """Feed every usable update to a fresh aggregator; append the result to history."""
        agg = self.make_aggregator()
        used: list[Message] = []
        agg_s = 0.0
        for reply in train.ok:
            node = reply.metadata.src_node_id
            try:
                blob = protocol.array_to_bytes(reply.content.array_records[protocol.UPDATE]["update"])
                t0 = time.perf_counter()
                agg.add(blob)
                agg_s += time.perf_counter() - t0
            except Exception as err:  # noqa: BLE001 - any rejection drops this client only
                # Aggregators validate fully before touching their sum, so the round goes on.
                self._drop(train, node, "train", f"update rejected: {type(err).__name__}: {err}")
                continue
            used.append(reply)
            rec.upload_bytes[str(node)] = len(blob)
        rec.dropped.extend(train.dropped)
        rec.num_clients = len(used)
        if len(used) < self.cfg.min_clients:
            raise NotEnoughClients(
                f"round {rnd}: {len(used)} usable update(s) < min-clients={self.cfg.min_clients}; "
                f"left out: {[(d['node'], d['reason']) for d in train.dropped]}"
            )
        missing = rec.sampled - len(used)
        if self.cfg.dp_mode == "distributed" and missing > 0 and self.cfg.noise_multiplier > 0:
            # Each client added σC/√n; make up the share of those that dropped out.
            std = self.cfg.noise_multiplier * self.cfg.clip_norm * math.sqrt(missing / rec.sampled)
            t0 = time.perf_counter()
            agg.add_noise(std, rng=self.noise_rng)
            agg_s += time.perf_counter() - t0
            log(INFO, "round %d: added noise std %.4g for %d dropped client(s)", rnd, std, missing)
        t0 = time.perf_counter()
        result = agg.result()
        agg_s += time.perf_counter() - t0
        self.history.append(result)
        rec.aggregate_bytes = len(result)

        m = [r.content[protocol.METRICS] for r in used]
        for r in used:
            self.known_version[r.metadata.src_node_id] = int(r.content[protocol.METRICS]["version"])
        n = [float(x["num-examples"]) for x in m]
        rec.train_loss = weighted_mean([float(x["train-loss"]) for x in m], n)
        rec.upload_bytes_mean = mean([float(b) for b in rec.upload_bytes.values()])
        rec.clipped_fraction = mean([float(x["clipped"]) for x in m])
        rec.epsilon = max((float(x["epsilon"]) for x in m), default=math.nan)
        for key in ("train", "encrypt", "decrypt", "writeback"):
            rec.seconds[key] = mean([float(x[f"{key}-s"]) for x in m])
        rec.seconds["aggregate"] = agg_s
        self._count_sources(m, rec)

    def aggregate_evaluate(self, evaluated: PhaseReplies, rec: RoundRecord) -> None:
        rec.dropped.extend(evaluated.dropped)
        m = [r.content[protocol.METRICS] for r in evaluated.ok]
        for r in evaluated.ok:
            self.known_version[r.metadata.src_node_id] = int(r.content[protocol.METRICS]["version"])
        n = [float(x["num-examples"]) for x in m]
        rec.eval_clients = len(m)
        rec.eval_loss = weighted_mean([float(x["eval-loss"]) for x in m], n)
        rec.eval_acc = weighted_mean([float(x["eval-acc"]) for x in m], n)
        rec.seconds["eval_decrypt"] = mean([float(x["decrypt-s"]) for x in m])
        rec.seconds["eval_writeback"] = mean([float(x["writeback-s"]) for x in m])
        if not m:
            log(ERROR, "round %d: no evaluation replies", rec.round)
        self._count_sources(m, rec)

    @staticmethod
    def _count_sources(metrics: list, rec: RoundRecord) -> None:
        for x in metrics:
            name = SOURCES.get(int(x["node-source"]), "?")
            rec.node_sources[name] = rec.node_sources.get(name, 0) + 1
            if int(x["pid"]) not in rec.pids:
                rec.pids.append(int(x["pid"]))
