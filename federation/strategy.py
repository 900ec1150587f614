"""OpaqueFedAvg: FedAvg over signed, encoded update bytes, driving the ``Grid`` directly.

Why not subclass ``flwr.serverapp.strategy.FedAvg``: its ``start()`` loop carries an
``ArrayRecord`` of plaintext global weights between rounds and evaluates it; here the
server must never hold the model, only bytes and an ``Aggregator`` built from public
material, so the loop is ours (``grid.send_and_receive``, ~one screen of code).

What the strategy holds: the run config, the public CKKS context bytes (checked: no
secret key, else ``SecretKeyPresentError``), the public ``PackingConfig``, an
``UpdateVerifier`` with the nodes' public signing keys, the aggregate history (bytes) and a
client-level privacy accountant. Key provisioning (the dealer) is *not* reachable from it:
``run``/``round`` take an ``admit`` callable as an argument (``KeyService.admit``).

Global versions: aggregate k (``history[k-1]``) turns global v(k-1) into vk. Every
message carries the aggregates the destination node may lack, so a node that skipped
rounds (sampling, a crash, a timeout) catches up before it trains or evaluates.

Each round: admit new nodes (enroll/provision) -> sample among the admitted -> train
(signed update bytes) -> verify signature/round/sender -> ``Aggregator.add`` -> distributed
DP noise top-up for dropped clients -> result -> evaluate.

Faults (a round goes on with the clients that remain; each left-out node is logged with
its reason and listed in the round record's ``dropped``):
* a reply carrying an error (the ClientApp raised) -> left out
* no reply within ``round-timeout`` -> left out
* unsigned / forged / replayed (older round) / reordered (future round) / second update,
  an unknown node, or an update signed for another node than the sender -> left out
* bytes the aggregator rejects (``CodecError``: not a ciphertext, another context/key,
  another packing, wrong length, NaN...) or a malformed reply -> left out
* fewer than ``min-clients`` usable updates (or admitted nodes) -> ``NotEnoughClients``
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from crypto import PrivacyAccountant, SignedUpdate, UpdateVerifier, client_sample_rate, load_context, noise_std
from crypto.errors import SecretKeyPresentError, SignatureError
from federation import protocol
from federation.codec import Aggregator, make_aggregator, packing_for
from federation.config import RunConfig
from federation.results import METRIC_NAMES, RoundRecord, mean, weighted_mean

if TYPE_CHECKING:
    from federation.provisioning import AdmitReport

Admit = Callable[[Grid, list[int]], "AdmitReport"]

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
        dim: int,
        verifier: UpdateVerifier,
        public_context: bytes | None = None,
        wait_for_nodes_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        self.dim = dim
        self.verifier = verifier
        self.public_context = public_context
        self.packing = None
        if cfg.he:
            if public_context is None:
                raise ValueError("he=true needs the dealer's public CKKS context")
            if load_context(public_context).is_private:
                raise SecretKeyPresentError("the strategy must only ever hold the public CKKS context")
            self.packing = packing_for(cfg, dim)
        self.wait_for_nodes_s = wait_for_nodes_s
        self.history: list[bytes] = []
        self.known_version: dict[int, int] = {}
        """Last global version each node confirmed; 0 (resend all) when unknown."""
        self.rng = random.Random(cfg.seed)
        self.noise_rng = np.random.default_rng()
        self.accountant = PrivacyAccountant("rdp") if cfg.dp_mode in ("local", "distributed") else None
        self.client_epsilon = 0.0 if self.accountant is not None else math.nan

    def make_aggregator(self) -> Aggregator:
        return make_aggregator(self.cfg.he, self.dim, self.packing, self.public_context)

    # -- the loop ---------------------------------------------------------------------
    def run(self, grid: Grid, on_round: Callable[[RoundRecord], None], admit: Admit | None = None) -> None:
        """All rounds; ``on_round`` gets each finished round. Raises NotEnoughClients.

        ``admit(grid, node_ids)`` enrolls/provisions nodes and says which are ready; without
        it, nodes whose public keys the verifier already holds take part.
        """
        for rnd in range(1, self.cfg.num_server_rounds + 1):
            on_round(self.round(grid, rnd, admit))

    def round(self, grid: Grid, rnd: int, admit: Admit | None = None) -> RoundRecord:
        rec = RoundRecord(round=rnd, metric=METRIC_NAMES[self.cfg.task])
        nodes = self.wait_for_nodes(grid)
        if admit is not None:
            report = admit(grid, nodes)
            ready = report.ready
            rec.admitted = list(report.admitted)
            rec.dropped.extend(report.dropped)
            rec.seconds["provision"] = report.seconds
        else:
            ready = [n for n in nodes if str(n) in self.verifier.nodes]
        if len(ready) < self.cfg.min_clients:
            raise NotEnoughClients(
                f"round {rnd}: {len(ready)} admitted node(s) < min-clients={self.cfg.min_clients} "
                f"({len(nodes)} connected); left out: {[(d['node'], d['reason']) for d in rec.dropped]}"
            )
        rec.population = len(ready)
        sampled = self.sample(ready)
        rec.sampled = len(sampled)

        t0 = time.perf_counter()
        self.verifier.start_round(rnd)
        replies = grid.send_and_receive(
            self.configure(protocol.TRAIN, rnd, sampled), timeout=self.cfg.round_timeout
        )
        train = self.collect("train", sampled, replies)
        rec.seconds["train_phase"] = time.perf_counter() - t0
        self.aggregate_train(rnd, train, rec)

        t0 = time.perf_counter()
        replies = grid.send_and_receive(
            self.configure(protocol.EVALUATE, rnd, ready), timeout=self.cfg.round_timeout
        )
        evaluated = self.collect("evaluate", ready, replies)
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
        """fraction-train of the nodes, at least min-clients; under HE at most max-clients
        (the packing headroom: contributions per aggregate, noise shares included)."""
        k = max(self.cfg.min_clients, math.ceil(self.cfg.fraction_train * len(nodes)))
        if self.cfg.he and k > self.cfg.max_clients:
            log(WARNING, "sampling %d of %d nodes: max-clients=%d", self.cfg.max_clients, len(nodes), self.cfg.max_clients)
            k = self.cfg.max_clients
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
        required = protocol.TRAIN_METRICS if phase == "train" else protocol.EVAL_METRICS
        seen: set[int] = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            if node in seen:
                log(WARNING, "%s: ignoring a second reply from node %s", phase, node)
                continue
            if reply.has_error():
                self._drop(out, node, phase, f"client error: {reply.error.reason}")
            elif protocol.METRICS not in reply.content.metric_records:
                self._drop(out, node, phase, "reply has no metrics record")
            elif missing := [k for k in required if k not in reply.content.metric_records[protocol.METRICS]]:
                self._drop(out, node, phase, f"reply metrics lack {missing}")
            elif node not in expected:
                self._drop(out, node, phase, "reply from a node that was not asked")
            else:
                out.ok.append(reply)
            seen.add(node)
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
        """Verify each update's signature, feed it to a fresh aggregator, append the result."""
        agg = self.make_aggregator()
        used: list[Message] = []
        agg_s = verify_s = 0.0
        for reply in train.ok:
            node = reply.metadata.src_node_id
            try:
                blob = protocol.array_to_bytes(reply.content.array_records[protocol.UPDATE]["update"])
            except Exception as err:  # noqa: BLE001 - malformed reply: this client only
                self._drop(train, node, "train", f"malformed update record: {type(err).__name__}: {err}")
                continue
            t0 = time.perf_counter()
            try:
                signed = SignedUpdate.from_bytes(blob)
                # sender first: a node relaying another node's captured update must not use
                # up that node's one update of the round in the verifier
                if signed.node_id != str(node):
                    raise SignatureError(f"update signed by node {signed.node_id} arrived from node {node}")
                self.verifier.verify(signed)
            except Exception as err:  # noqa: BLE001 - SignatureError, ReplayError, UnknownNodeError...
                self._drop(train, node, "train", f"signature check failed: {type(err).__name__}: {err}")
                continue
            finally:
                verify_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                agg.add(signed.payload)
            except Exception as err:  # noqa: BLE001 - any rejection drops this client only
                # Aggregators validate fully before touching their sum, so the round goes on.
                self._drop(train, node, "train", f"update rejected: {type(err).__name__}: {err}")
                continue
            finally:
                agg_s += time.perf_counter() - t0
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
            # Each sampled client was to add a share σC/√n; add the shares of those left out
            # (under encryption with he=true) so the sum still carries σC.
            std = noise_std(self.cfg.noise_multiplier, self.cfg.clip_norm, "distributed", rec.sampled)
            t0 = time.perf_counter()
            saturated = agg.add_noise(std, shares=missing, rng=self.noise_rng)
            agg_s += time.perf_counter() - t0
            rec.noise_shares_added = missing
            log(INFO, "round %d: added %d noise share(s) of std %.4g for left-out client(s)%s",
                rnd, missing, std, f" ({saturated} values saturated)" if saturated else "")
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
        values = sum(float(x["num-values"]) for x in m)
        rec.saturated_fraction = sum(float(x["saturated"]) for x in m) / values if values else math.nan
        rec.weight_capped = int(sum(int(x["weight-capped"]) for x in m))
        rec.epsilon_sample = max((float(x["epsilon-sample"]) for x in m), default=math.nan)
        rec.epsilon_client = self._account(rec)
        rec.delta = self.cfg.target_delta
        for key in ("train", "encrypt", "sign", "decrypt", "writeback"):
            rec.seconds[key] = mean([float(x[f"{key}-s"]) for x in m])
        rec.seconds["verify"] = verify_s
        rec.seconds["aggregate"] = agg_s
        self._count_sources(m, rec)

    def _account(self, rec: RoundRecord) -> float:
        """Client-level ε so far (RDP, δ = target-delta) for dp-mode local/distributed.

        One subsampled-Gaussian step per round with q = sampled / admitted nodes and noise
        multiplier: σ for local (each update carries σC); σ for distributed with he=true
        (the server only sees the sum, which carries σC incl. its top-up); σ/√n for
        distributed with he=false (the server sees each update with its share σC/√n).
        Subsampling amplification assumes the sample is secret, which the server that
        samples does not respect: read ε as the guarantee against other parties.
        """
        if self.accountant is None:
            return math.nan
        sigma = self.cfg.noise_multiplier
        if self.cfg.dp_mode == "distributed" and not self.cfg.he:
            sigma /= math.sqrt(rec.sampled)
        if sigma <= 0 or not math.isfinite(self.client_epsilon):
            self.client_epsilon = math.inf
            return math.inf
        self.accountant.step(sigma, client_sample_rate(rec.sampled, rec.population))
        self.client_epsilon = self.accountant.epsilon(self.cfg.target_delta)
        return self.client_epsilon

    def aggregate_evaluate(self, evaluated: PhaseReplies, rec: RoundRecord) -> None:
        rec.dropped.extend(evaluated.dropped)
        m = [r.content[protocol.METRICS] for r in evaluated.ok]
        for r in evaluated.ok:
            self.known_version[r.metadata.src_node_id] = int(r.content[protocol.METRICS]["version"])
        n = [float(x["num-examples"]) for x in m]
        rec.eval_clients = len(m)
        rec.eval_loss = weighted_mean([float(x["eval-loss"]) for x in m], n)
        rec.eval_metric = weighted_mean([float(x["eval-metric"]) for x in m], n)
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
