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

Each round (``round``, the one loop, in Flower's verbs): admit new nodes (enroll/provision,
``federation.key_service``) -> sample among the admitted -> ``configure_train`` (signed update
bytes come back) -> ``aggregate_train``: verify signature/round/sender/header ->
``Aggregator.add`` -> distributed DP noise top-up for dropped clients
(``federation.noise_topup``) -> the aggregate -> ε (``federation.privacy_ledger.charge_round``)
-> ``configure_evaluate`` -> ``aggregate_evaluate``. The messages' writers and readers are
``federation.messages``.

Faults (a round goes on with the clients that remain; each left-out node is logged with
its reason and listed in the round record's ``dropped``):
* a reply carrying an error (the ClientApp raised) -> left out
* no reply within ``round-timeout`` -> left out
* unsigned / forged / replayed (older round) / reordered (future round) / second update,
  an unknown node, or an update signed for another node than the sender -> left out
* a header that disagrees with the round's public encoding (a malformed MAC tag; an envelope
  field: kind, mode, key id, packing, a tensor layout, values, ciphertexts, contributions) ->
  left out before aggregation, the reason naming the field (``_header_ok``)
* bytes the aggregator rejects (``CodecError``: not a ciphertext, wrong length, NaN...) or a
  malformed reply -> left out
* fewer than ``min-clients`` usable updates (or admitted nodes) -> ``NotEnoughClients``
* an aggregate every node refuses -> the round is discarded (``discard_if_refused``); after
  ``max-rejected-rounds`` such rounds in a row -> ``AggregatesRefused``
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import ERROR, WARNING
from typing import TYPE_CHECKING

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

from crypto import CONTRIBUTION_UPDATE, Manifest, ManifestEntry, SignedUpdate
from crypto import last_modulus, tag_problem, update_header_problem
from federation.privacy_ledger import PrivacyLedger, RoundCharge, RoundRelease, charge_round
from crypto.errors import SignatureError
from federation import messages, protocol
from federation.messages import NodeSource
from federation.codec import Aggregator, make_aggregator, packing_for, run_saturation_delta
from federation.config import RunConfig
from federation.results import METRIC_NAMES, RoundRecord, mean, serving_summary, weighted_mean
from federation.sampling import ClientSampler, SampleOutsideBounds, evaluation_size
from federation.timing import PhaseTimer

from federation.key_service import AdmitReport
from federation.noise_topup import NoiseTopUp

if TYPE_CHECKING:
    from federation.key_service import KeyService



TRAIN_PHASES = protocol.NODE_TRAIN_PHASES
EVAL_PHASES = protocol.NODE_EVAL_PHASES


def _node_phase_sums(metrics: list, phases: tuple[str, ...]) -> dict[str, float]:
    """Each node phase summed over the replying nodes, their handlers' total, and ``other``
    (handler time no phase covers)."""
    out = {p: float(sum(getattr(x, f"{p}_s") for x in metrics)) for p in phases}
    handler = float(sum(x.handler_s for x in metrics))
    out["handler"] = handler
    out["other"] = max(0.0, handler - sum(out[p] for p in phases))
    return out


def sampler_for(cfg: RunConfig) -> ClientSampler:
    """The run's client sampler: OS entropy unless ``sampler-seed >= 0`` (experiments)."""
    return ClientSampler(cfg.client_sampling, cfg.fraction_train, cfg.min_clients,
                         cfg.max_clients if cfg.he else None, cfg.sampler_seed if cfg.sampler_seed >= 0 else None)


class RunStopped(RuntimeError):
    """The run cannot go on: it stops, and the ServerApp records ``status`` "stopped: <reason>"."""


class NotEnoughClients(RunStopped):
    """Fewer usable clients than ``min-clients``: the run stops."""


class AggregatesRefused(RunStopped):
    """``max-rejected-rounds`` rounds in a row whose aggregate every node refused: the run stops
    instead of going on without progress (a key-holding node keeps sending a bad summand)."""


@dataclass
class PhaseReplies:
    """Replies of one phase, split into usable ones and left-out nodes with reasons."""

    ok: list[tuple[int, object]] = field(default_factory=list)
    """(node id, parsed reply: messages.TrainReply or messages.EvalMetrics)."""
    dropped: list[dict] = field(default_factory=list)


class OpaqueFedAvg:
    """Weighted FedAvg of opaque updates; the server sees bytes and public material only."""

    def __init__(self, cfg: RunConfig, dim: int, keys: KeyService, wait_for_nodes_s: float = 60.0) -> None:
        self.cfg = cfg
        self.dim = dim
        self.keys = keys
        self.packing = packing_for(cfg, dim) if cfg.he else None
        self.saturation_delta = run_saturation_delta(cfg, dim)
        """δ_sat of the run (``crypto.dp.saturation``): the reported δ is δ + (1 + e^ε)·δ_sat."""
        self.wait_for_nodes_s = wait_for_nodes_s
        self.history: list[tuple[bytes, bytes]] = []
        """(aggregate, manifest) per global version: history[k-1] makes v k."""
        self.known_version: dict[int, int] = {}
        """Last global version each node confirmed; 0 (resend all) when unknown."""
        self.sampler = sampler_for(cfg)
        self.rng = random.SystemRandom()  # who evaluates: not derivable from the seed
        self.noise = NoiseTopUp(cfg)
        """Distributed DP: the noise shares of sampled nodes that left a round (``federation.noise_topup``)."""
        self.ledger: PrivacyLedger | None = None
        """ε per observer; created at the first DP round, for that round's population (Flower's
        accountant fixes N); ``federation.privacy_ledger``."""
        self.client_epsilon = 0.0 if cfg.dp_mode in ("local", "distributed") else math.nan
        self._topup_by_node: dict[int, int] = {}
        """This round's noise shares each survivor made for left-out clients (he=true; ``noise.by_node``)."""
        self.rotate_reason: str | None = None
        self.refused_rounds: list[int] = []
        """The rounds since the last accepted aggregate whose aggregate every node refused."""

    @property
    def verifier(self):  # noqa: ANN201 - crypto.UpdateVerifier
        return self.keys.verifier

    def make_aggregator(self) -> Aggregator:
        return make_aggregator(self.cfg.he, self.dim, self.packing, self.keys.public_context)

    # -- the loop ---------------------------------------------------------------------
    def run(self, grid: Grid, on_round: Callable[[RoundRecord], None]) -> None:
        """All rounds; ``on_round`` gets each finished round. Raises ``RunStopped``:
        ``NotEnoughClients``, or ``AggregatesRefused`` after ``max-rejected-rounds`` discarded
        rounds in a row (``count_refusals``)."""
        for rnd in range(1, self.cfg.num_server_rounds + 1):
            rec = self.round(grid, rnd)
            on_round(rec)
            self.count_refusals(rec)

    def count_refusals(self, rec: RoundRecord) -> None:
        """A round whose aggregate every node refused (``discard_if_refused``) is discarded and the
        run goes on; ``max-rejected-rounds`` of them in a row stop it (``AggregatesRefused``). A
        round whose aggregate stands resets the count; a skipped Poisson round has no aggregate
        and leaves it as it is."""
        if rec.aggregate_discarded:
            self.refused_rounds.append(rec.round)
        elif not rec.sampling_skipped:
            self.refused_rounds = []
        k = self.cfg.max_rejected_rounds
        if len(self.refused_rounds) >= k:
            raise AggregatesRefused(
                f"{k} round{'s' if k > 1 else ''} in a row had their aggregate refused by every node (rounds "
                f"{', '.join(map(str, self.refused_rounds))}; a node refuses an aggregate whose MAC, header or "
                f"bound on the mean fails, so a summand came from a node that misbehaves (under HE, one that "
                f"holds the key), and the server cannot tell which; the model stays at v{len(self.history)}; "
                f"max-rejected-rounds={k})"
            )

    def round(self, grid: Grid, rnd: int) -> RoundRecord:
        """One round, every server phase timed into ``rec.server_seconds`` (they sum to
        ``rec.seconds["round"]``; ``other`` is what no phase covers) and the nodes' own phase
        times summed into ``rec.node_seconds`` (see ``RoundRecord``)."""
        timer = PhaseTimer()
        rec = RoundRecord(round=rnd, metric=METRIC_NAMES[self.cfg.task])
        with timer.phase("admit"):
            ready = self.admit(grid, rnd, rec)
            rec.population = len(ready)
            try:
                sampled = self.sample(ready)
            except SampleOutsideBounds as err:
                log(WARNING, "round %d: %s; nobody trains this round", rnd, err)
                rec.sampling_skipped = True
                skipped = RoundRelease(self.sampler.fixed_size(len(ready)), skipped=True)
                rec.epsilon_client = self._account(rec, skipped)
                sampled = None
        if sampled is None:
            return self.evaluate_round(grid, rnd, ready, rec, timer)
        rec.sampled = len(sampled)

        t0 = time.perf_counter()
        self.verifier.start_round(rnd)
        with timer.phase("send"):
            msgs = self.configure_train(rnd, sampled)
        with timer.phase("wait"):
            replies_ = grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)
        with timer.phase("receive"):
            train = self.collect("train", sampled, replies_, protocol.destinations(msgs))
        rec.seconds["train_phase"] = time.perf_counter() - t0
        self.aggregate_train(grid, rnd, train, rec, timer)
        return self.evaluate_round(grid, rnd, ready, rec, timer)

    def evaluate_round(self, grid: Grid, rnd: int, ready: list[int], rec: RoundRecord,
                       timer: PhaseTimer) -> RoundRecord:
        """A sample of the admitted nodes (``evaluation_sample``) evaluates the latest version."""
        t0 = time.perf_counter()
        with timer.phase("eval_send"):
            asked = self.evaluation_sample(ready)
            msgs = self.configure_evaluate(rnd, asked)
        with timer.phase("eval_wait"):
            replies_ = grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)
        with timer.phase("eval_receive"):
            evaluated = self.collect("evaluate", asked, replies_, protocol.destinations(msgs))
        rec.seconds["evaluate_phase"] = time.perf_counter() - t0
        with timer.phase("eval_account"):
            self.discard_if_refused(evaluated, rec)
            self.aggregate_evaluate(evaluated, rec)
            self.note_departures(rec)
        self._close_books(rec, timer)
        return rec

    @staticmethod
    def _close_books(rec: RoundRecord, timer: PhaseTimer) -> None:
        """Round wall time, server phases + their remainder, and the time the two waits spent
        outside any node handler (Flower's queues and polling: ``transport``)."""
        total = timer.total
        rec.seconds["round"] = total
        rec.server_seconds = {**timer.seconds, "other": timer.other(total)}
        waited = timer.seconds.get("wait", 0.0) + timer.seconds.get("eval_wait", 0.0)
        busy = sum(rec.node_seconds.get(k, {}).get("handler", 0.0) for k in ("train", "evaluate"))
        rec.seconds["nodes_busy"] = busy
        rec.seconds["transport"] = max(0.0, waited - busy)

    # -- node selection -----------------------------------------------------------------
    def admit(self, grid: Grid, rnd: int, rec: RoundRecord) -> list[int]:
        """Rotate the key if due, enroll/key new nodes; the admitted nodes (>= min-clients)."""
        nodes = self.wait_for_nodes(grid)
        due = self.cfg.rotate_every > 0 and rnd > 1 and (rnd - 1) % self.cfg.rotate_every == 0
        reason = self.rotate_reason or ("rotate-every" if due else None)
        if reason is not None:
            rotation = AdmitReport()
            rec.key_rotated = self.keys.rotate(grid, nodes, rnd, reason, rotation)
            rec.dropped.extend(rotation.dropped)
            self.rotate_reason = None
        report = self.keys.admit(grid, nodes, rnd)
        rec.admitted = list(report.admitted)
        rec.dropped.extend(report.dropped)
        rec.seconds["provision"] = report.seconds
        rec.key_epoch = self.keys.epoch
        if len(report.ready) < self.cfg.min_clients:
            raise NotEnoughClients(
                f"round {rnd}: {len(report.ready)} admitted node(s) < min-clients={self.cfg.min_clients} "
                f"({len(nodes)} connected); left out: {[(d['node'], d['reason']) for d in rec.dropped]}"
            )
        return report.ready

    def note_departures(self, rec: RoundRecord) -> None:
        """With he=true a node dropped from a round leaves the key group: rotate before the next
        round, so it cannot read later aggregates unless the server re-admits it (a holder then
        re-keys it)."""
        if not self.cfg.he:
            return
        left = {d["node"] for d in rec.dropped if d["phase"] in ("train", "evaluate", "noise")
                and not (rec.aggregate_discarded and protocol.is_aggregate_refusal(d["reason"]))}
        gone = self.keys.depart(sorted(left))
        if gone:
            rec.departed = gone
            self.rotate_reason = f"node(s) {gone} left in round {rec.round}"

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
        """The round's training nodes (``federation.sampling``): fixed = fraction-train of the
        nodes, at least min-clients, under HE at most max-clients (the packing headroom);
        poisson = each node with probability fraction-train (``SampleOutsideBounds`` when the
        draw is outside those bounds)."""
        if self.cfg.he and self.sampler.method == "fixed":
            wanted = max(self.cfg.min_clients, math.ceil(self.cfg.fraction_train * len(nodes)))
            if wanted > self.cfg.max_clients:
                log(WARNING, "sampling %d of %d nodes: max-clients=%d", self.cfg.max_clients, len(nodes),
                    self.cfg.max_clients)
        return self.sampler.sample(nodes)

    def evaluation_sample(self, nodes: list[int]) -> list[int]:
        """Who evaluates: ``evaluation_size`` nodes (fraction-evaluate, capped by
        max-evaluate-clients), drawn afresh each round so every node is scored over time."""
        k = evaluation_size(len(nodes), self.cfg.fraction_evaluate, self.cfg.min_clients,
                            self.cfg.max_evaluate_clients)
        return sorted(self.rng.sample(nodes, k)) if k < len(nodes) else list(nodes)

    # -- messages: Flower's verbs (configure / aggregate, train and evaluate) ---------------
    def configure_train(self, rnd: int, node_ids: list[int]) -> list[Message]:
        """Round ``rnd``'s train messages: each node catches up to v(r-1), then trains."""
        return self.configure(protocol.TRAIN, rnd, node_ids)

    def configure_evaluate(self, rnd: int, node_ids: list[int]) -> list[Message]:
        """Round ``rnd``'s evaluate messages: each node catches up to v r, then evaluates."""
        return self.configure(protocol.EVALUATE, rnd, node_ids)

    def configure(self, message_type: str, rnd: int, node_ids: list[int]) -> list[Message]:
        """One message per node: the aggregates (and manifests) it may lack + the round's config.

        Train messages of round r bring nodes to v(r-1); evaluate messages to v r.
        """
        target = len(self.history)
        return [messages.round_request(message_type, node_id, rnd, self.history,
                                       min(self.known_version.get(node_id, 0), target), len(node_ids))
                for node_id in node_ids]

    def collect(self, phase: str, expected: list[int], replies_: Iterable[Message],
                sent: dict[str, int] | None = None) -> PhaseReplies:
        """Parse every reply (``federation.messages``); errors, silence and bad fields drop the node."""
        out = PhaseReplies()
        dp = self.cfg.dp_mode in ("local", "distributed")
        seen: set[int] = set()
        for reply in replies_:
            node = protocol.reply_sender(reply, sent or {})
            if node in seen or node not in expected:
                log(WARNING, "%s: ignoring an unexpected or second reply from node %s", phase, node)
                continue
            seen.add(node)
            if reply.has_error():
                self.drop(out, node, phase, f"client error: {protocol.error_text(reply)}")
                continue
            try:
                if phase == "train":
                    parsed: object = messages.parse_train_reply(reply, dp=dp, dim=self.dim)
                else:
                    parsed = messages.parse_eval_reply(reply)
            except messages.BadReply as err:
                self.drop(out, node, phase, f"bad reply: {err}")
                continue
            out.ok.append((node, parsed))
        for node in expected:
            if node not in seen:
                self.drop(out, node, phase, f"no reply within round-timeout={self.cfg.round_timeout}s")
        return out

    def drop(self, out: PhaseReplies, node: int, phase: str, reason: str) -> None:
        """Leave ``node`` out of this phase with ``reason`` (and resend it the whole history)."""
        log(WARNING, "%s: leaving out node %s: %s", phase, node, reason)
        out.dropped.append({"node": node, "phase": phase, "reason": reason})
        self.known_version[node] = 0  # unknown state: resend the whole history next time

    # -- aggregation --------------------------------------------------------------------
    def _verified(self, out: PhaseReplies, node: int, phase: str, blob: bytes, kind: int) -> SignedUpdate | None:
        """The verified contribution, or None (the node is dropped with the reason)."""
        try:
            signed = SignedUpdate.from_bytes(blob)
            # sender first: a node relaying another node's captured update must not use
            # up that node's one update of the round in the verifier
            if signed.node_id != str(node):
                raise SignatureError(f"update signed by node {signed.node_id[:40]} arrived from node {node}")
            return self.verifier.verify(signed, kind)
        except Exception as err:  # noqa: BLE001 - SignatureError, ReplayError, UnknownNodeError...
            self.drop(out, node, phase, f"signature check failed: {messages.safe_reason(err)}")
            return None

    def admit_summand(self, agg: Aggregator, out: PhaseReplies, node: int, phase: str, blob: bytes, kind: int,
                      shares: int) -> SignedUpdate | None:
        """A contribution into ``agg`` after every check (signature, header, the aggregator's own):
        the verified update, or None with the node dropped (``noise_topup.SummandGate``)."""
        signed = self._verified(out, node, phase, blob, kind)
        if signed is None or not self._header_ok(agg, out, node, phase, signed, shares):
            return None
        return signed if self._add(agg, out, node, phase, signed) else None

    def _add(self, agg: Aggregator, out: PhaseReplies, node: int, phase: str, signed: SignedUpdate) -> bool:
        try:
            agg.add(signed.payload)  # validates fully before touching the sum
            return True
        except Exception as err:  # noqa: BLE001 - any rejection drops this client only
            self.drop(out, node, phase, f"update rejected: {messages.safe_reason(err)}")
            return False

    def aggregate_train(self, grid: Grid, rnd: int, train: PhaseReplies, rec: RoundRecord,
                        timer: PhaseTimer | None = None) -> None:
        """Verify each update's signature, add it, top up missing noise, append the aggregate."""
        timer = timer or PhaseTimer()
        agg = self.make_aggregator()
        used: list[tuple[int, messages.TrainReply]] = []
        entries: list[ManifestEntry] = []
        verify_s = add_s = 0.0
        for node, reply in train.ok:
            t0 = time.perf_counter()
            signed = self._verified(train, node, "train", reply.blob, CONTRIBUTION_UPDATE)
            t1 = time.perf_counter()
            ok = (signed is not None and self._header_ok(agg, train, node, "train", signed, 1)
                  and self._add(agg, train, node, "train", signed))
            verify_s, add_s = verify_s + t1 - t0, add_s + time.perf_counter() - t1
            if not ok:
                continue
            entries.append(ManifestEntry(signed.node_id, CONTRIBUTION_UPDATE, signed.digest, signed.tag))
            used.append((node, reply))
            rec.upload_bytes[str(node)] = len(reply.blob)
        rec.seconds["verify"], rec.seconds["aggregate"] = verify_s, add_s
        timer.add("verify", verify_s)
        agg_phases = dict(agg.seconds)  # parse / deserialize / add inside add_s; the rest is dropping
        for name in ("parse", "deserialize", "add"):
            timer.add(name, agg_phases[name])
        timer.add("reject", max(0.0, add_s - sum(agg_phases[n] for n in ("parse", "deserialize", "add"))))
        rec.dropped.extend(train.dropped)
        rec.num_clients = len(used)
        if len(used) < self.cfg.min_clients:
            raise NotEnoughClients(
                f"round {rnd}: {len(used)} usable update(s) < min-clients={self.cfg.min_clients}; "
                f"left out: {[(d['node'], d['reason']) for d in train.dropped]}"
            )
        with timer.phase("noise"):
            noise_out = PhaseReplies()
            shares = self.noise.top_up(grid, rnd, agg, [n for n, _ in used], rec, entries, self, noise_out)
            rec.dropped.extend(noise_out.dropped)
            self._topup_by_node = self.noise.by_node
        with timer.phase("serialize"):
            self.history.append((agg.result(), self._manifest(rnd, entries)))
        rec.aggregate_bytes = len(self.history[-1][0])
        with timer.phase("account"):
            for node, reply in used:
                self.known_version[node] = reply.metrics.version
            self._summarize_train([r.metrics for _, r in used], rec)
            rec.node_seconds["train"] = _node_phase_sums([r.metrics for _, r in train.ok], TRAIN_PHASES)
            rec.epsilon_client = self._account(rec, self._release(rec, [n for n, _ in used], shares))

    def _manifest(self, rnd: int, entries: list[ManifestEntry]) -> bytes:
        if not self.cfg.he:
            return b""
        return Manifest(self.verifier.run_id, rnd, self.keys.epoch, tuple(entries)).to_bytes()

    def _header_ok(self, agg: Aggregator, out: PhaseReplies, node: int, phase: str, signed: SignedUpdate,
                   shares: int) -> bool:
        """Before a summand is added, every public field of its header must be what the round
        declares (issue 20: a validly signed update with a crafted header is refused here, not by
        every node after aggregation): its MAC tag's format (``crypto.binding.tag_problem``: a
        manifest with a malformed tag parses on no node), and each field of its envelope
        (``crypto.update_header_problem``: kind, packing mode and fingerprint, key id, no tensor
        layout, values, ciphertexts, and the contributions it stands for: 1 for a client update,
        the shares asked for in a noise reply, which the aggregator's headroom check relies on).
        The reason names the field. he=false has no envelope and no tag: nothing to check."""
        if not self.cfg.he:
            return True
        context = agg.context  # the public CKKS context of the round's key
        problem = tag_problem(signed.tag, last_modulus(context))
        field = "tag"
        if problem is None:
            try:
                found = update_header_problem(signed.payload, context, self.packing, self.dim, shares)
            except Exception:  # noqa: BLE001 - malformed: the aggregator's own check refuses it next
                return True
            if found is None:
                return True
            field, problem = found
        self.drop(out, node, phase, f"{phase} reply {problem} (header field {field})")
        return False

    def _summarize_train(self, m: list[messages.TrainMetrics], rec: RoundRecord) -> None:
        n = [float(x.num_examples) for x in m]
        rec.upload_bytes_mean = mean([float(b) for b in rec.upload_bytes.values()])
        dp = self.cfg.dp_mode in ("local", "distributed")
        if not dp:  # under DP these are private values nodes do not send
            rec.train_loss = weighted_mean([float(x.train_loss) for x in m], n)
            rec.clipped_fraction = mean([float(x.clipped) for x in m])
            values = sum(float(x.num_values) for x in m)
            rec.saturated_fraction = sum(float(x.saturated) for x in m) / values if values else math.nan
        rec.weight_capped = int(sum(int(x.weight_capped) for x in m))
        rec.epsilon_sample = max((x.epsilon_sample for x in m if x.epsilon_sample is not None), default=math.nan)
        rec.delta = self.cfg.target_delta
        for key in ("train", "encrypt", "sign", "decrypt", "writeback"):
            rec.seconds[key] = mean([float(getattr(x, f"{key}_s")) for x in m])
        self._count_sources(m, rec)

    def _release(self, rec: RoundRecord, survivors: list[int], added: int) -> RoundRelease:
        """What this round released, for the ledger: each survivor's own share plus the top-up
        shares it made (he=true), or the server's top-up (he=false)."""
        by_node = {n: 1 + self._topup_by_node.get(n, 0) for n in survivors}
        server = 0 if self.cfg.he else added
        return RoundRelease(rec.sampled, by_node, server)

    def _account(self, rec: RoundRecord, release: RoundRelease) -> float:
        """Client-level ε so far per observer (δ = target-delta) for dp-mode local/distributed;
        returns the third parties' (``epsilon_client``). One release per round, for the sampler
        (``federation.client_accounting``) and observer (``federation.privacy_ledger``: third
        parties amplified; the server, a curious node and ``colluding-nodes`` colluding nodes
        without amplification, each at the noise it does not know): ``charge_round``."""
        if self.cfg.dp_mode not in ("local", "distributed"):
            return math.nan
        run = RoundCharge(self.cfg, self.sampler, self.saturation_delta, self.packing, self.dim)
        self.ledger, self.client_epsilon = charge_round(run, self.ledger, rec, release, len(self._topup_by_node))
        return self.client_epsilon

    def discard_if_refused(self, evaluated: PhaseReplies, rec: RoundRecord) -> None:
        """If no node accepted the round's aggregate and some refused it, drop it.

        Which summand was bad cannot be found without showing a node two different sums (their
        difference would be a single update), so the round is discarded, not recomputed: every
        node stays at the last accepted version, nothing of this round was decrypted. With
        he=false the same (a node refuses a plaintext mean beyond the public bound too)."""
        if not self.history:
            return
        accepted = any(x.version == len(self.history) for _, x in evaluated.ok)
        refused = [d for d in evaluated.dropped if protocol.is_aggregate_refusal(d["reason"])]
        if accepted or not refused:
            return
        self.history.pop()
        rec.aggregate_discarded = True
        for d in refused:
            self.known_version[d["node"]] = len(self.history)
        log(WARNING, "round %d: every node refused the aggregate; round discarded (summands: %s)",
            rec.round, sorted(rec.upload_bytes))

    def aggregate_evaluate(self, evaluated: PhaseReplies, rec: RoundRecord) -> None:
        rec.dropped.extend(evaluated.dropped)
        m = [x for _, x in evaluated.ok]
        for node, x in evaluated.ok:
            self.known_version[node] = x.version
        n = [float(x.num_examples) for x in m]
        rec.eval_clients = len(m)
        rec.eval_loss = weighted_mean([x.eval_loss for x in m], n)
        rec.eval_metric = weighted_mean([x.eval_metric for x in m], n)
        based = [(x.base_metric, w) for x, w in zip(m, n) if x.base_metric is not None]
        rec.base_metric = weighted_mean([b for b, _ in based], [w for _, w in based])
        rec.samples = [{"question": q, "reply": r} for x in m for q, r in x.samples]
        rec.seconds["eval_decrypt"] = mean([x.decrypt_s for x in m])
        rec.seconds["eval_writeback"] = mean([x.writeback_s for x in m])
        rec.node_seconds["evaluate"] = _node_phase_sums(m, EVAL_PHASES)
        totals: dict[str, float] = {}
        for x in m:
            for k, v in x.serve.items():
                totals[k] = totals.get(k, 0) + v
        rec.serving = serving_summary(totals)
        if not m:
            log(ERROR, "round %d: no evaluation replies", rec.round)
        self._count_sources(m, rec)

    @staticmethod
    def _count_sources(metrics: list, rec: RoundRecord) -> None:
        for x in metrics:
            name = NodeSource(x.node_source).label  # in range: messages checked it
            rec.node_sources[name] = rec.node_sources.get(name, 0) + 1
            if x.pid not in rec.pids:
                rec.pids.append(x.pid)
            rec.kv_blocks_on_disk += x.kv_on_disk
