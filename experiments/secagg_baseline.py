"""Flower's SecAgg+ (legacy workflow) against plain FedAvg in the same Flower simulation:
bytes one client uploads per round and the time of one round, at one or more model sizes.

    python -m experiments.secagg_baseline --sizes 1e4,1e5 --clients 5 --rounds 3 --json-out r.json

Run it in a process of its own (``experiments.he_cost`` does): ``run_simulation`` starts Ray, and
a separate process is the simplest way to be sure nothing of it outlives the measurement.

Set-up. One ``flwr.simulation.run_simulation`` with ``clients`` virtual SuperNodes (Ray backend,
1 CPU per client: on 2 cores two clients compute at a time). Each client is a ``NumPyClient``
whose ``fit`` returns a fixed pseudo-random update of the size it was sent (N(0, 0.3) clipped to
[-1, 1], float32, one flat array; example count in [500, 1000]) — no training, so only the
aggregation protocol is measured. The ServerApp first runs one untimed round of each mode at 1,000
parameters (starts the Ray actors), then for every size ``rounds`` rounds of plain FedAvg
(``DefaultWorkflow`` with ``default_fit_workflow``) and ``rounds`` rounds of SecAgg+
(``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares, reconstruction_threshold,
clipping_range=1.0))``, Flower's defaults otherwise: quantization range 2^22, modulus 2^32,
max_weight 1000). The client wraps ``secaggplus_mod`` so that it handles only messages carrying a
SecAgg+ config record; the FedAvg rounds go straight to the client. Evaluation is off.

What is measured:

* ``upload_bytes_per_client_round`` — server side, by a proxy around the ServerApp's ``Grid``: for
  every reply a client sends, the bytes Flower 1.42 serialises for it, i.e. the sum of
  ``len(obj.deflate())`` over the reply ``Message`` and all its nested objects (RecordDict,
  ConfigRecord, ArrayRecord, Array chunks) — what a SuperNode pushes to the SuperLink in a
  deployment (``get_all_nested_objects`` + ``push_objects``), without gRPC/HTTP/TLS framing.
  Summed over the four SecAgg+ stages (setup: 2 public keys; share-keys: encrypted key shares;
  collect-masked-vectors: the masked vector, int64 ``np.save`` bytes, + FitRes metadata; unmask:
  key shares), averaged over clients and rounds; by stage in ``upload_bytes_by_stage``.
  FedAvg: the fit reply. ``download_bytes_per_client_round``: the same for what the server sends.
* ``seconds_per_round`` — wall time of one round's fit workflow (SecAgg+: its four stages, incl.
  client masking, server unmasking and FedAvg's ``aggregate_fit``), median over the rounds, minus
  the time the proxy spends counting bytes. It includes Flower's simulation transport, which polls
  for messages every 0.1 s (``InMemoryGrid.pull_interval`` and the simulation engine's fetch
  loop): each request/reply exchange costs ~0.1-0.2 s of waiting at any size, and SecAgg+ has four
  exchanges per round where FedAvg has one.
* ``protocol_seconds`` = ``client_protocol_seconds`` + ``server_protocol_seconds``: the compute
  of the aggregation protocol alone, comparable to the HE modes' encrypt + aggregate + decrypt.
  Client: time inside the ClientApp's mods minus time inside ``fit`` (timing mods outside and
  inside ``secaggplus_mod``), summed over the stages of a round, max over clients (clients work in
  parallel), median over rounds. Server: round wall time minus the time blocked in
  ``send_and_receive``, median over rounds. Neither includes message (de)serialisation.
* ``max_abs_error`` — max |aggregate - float64 weighted mean of the client updates| after the last
  round: evidence that the protocol really ran (SecAgg+ quantizes to 2^22 levels over [-1, 1]).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

UPDATE_STD, CLIP_RANGE = 0.3, 1.0
WARMUP_SIZE = 1000  # one untimed round per mode at this size starts the Ray actors first
MODES = ("fedavg", "secaggplus")


def client_update(seed: int, partition_id: int, size: int) -> tuple[np.ndarray, int]:
    """The fixed update and example count of one client (the server recomputes them)."""
    rng = np.random.default_rng([seed, partition_id, size])
    vec = np.clip(rng.normal(0.0, UPDATE_STD, size), -CLIP_RANGE, CLIP_RANGE).astype(np.float32)
    return vec, int(rng.integers(500, 1001))


def message_nbytes(msg: Any) -> int:
    """Bytes Flower serialises for a Message: itself plus every nested inflatable object."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


def _stage_of(msg: Any) -> str:
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    return str(cfg[Key.STAGE]) if cfg is not None and Key.STAGE in cfg else "fit"


class CountingGrid:
    """Delegates to a Grid; records the serialised size of every message sent and received and
    the time spent blocked in ``send_and_receive``."""

    def __init__(self, grid: Any) -> None:
        self._grid = grid
        self.records: list[dict[str, Any]] = []  # one per message: direction, stage, node, bytes
        self.measure_seconds = 0.0
        self.blocked_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> Iterable[Any]:
        messages = list(messages)
        t = time.perf_counter()
        stages = {}
        for m in messages:
            stages[m.metadata.dst_node_id] = stage = _stage_of(m)
            self.records.append({"direction": "download", "stage": stage, "node": m.metadata.dst_node_id,
                                 "bytes": message_nbytes(m)})
        t1 = time.perf_counter()
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        t2 = time.perf_counter()
        for r in replies:
            if r.has_error():
                raise RuntimeError(f"client {r.metadata.src_node_id} replied with an error: {r.error}")
            node = r.metadata.src_node_id
            self.records.append({"direction": "upload", "stage": stages.get(node, "?"), "node": node,
                                 "bytes": message_nbytes(r)})
        self.measure_seconds += (t1 - t) + (time.perf_counter() - t2)
        self.blocked_seconds += t2 - t1
        return replies


def _no_evaluate(grid: Any, context: Any) -> None:
    return None


def _append_line(path: str, obj: dict[str, Any]) -> None:
    # one short O_APPEND write per line: atomic across the Ray worker processes
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(obj) + "\n").encode())
    finally:
        os.close(fd)


def build_apps(sizes: list[int], clients: int, rounds: int, seed: int, num_shares: int, threshold: int,
               modes: list[str], results: list[dict[str, Any]], timing_file: str,
               warmup: bool = True) -> tuple[Any, Any]:
    import flwr.compat.common.recorddict_compat as compat
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
    from flwr.server.workflow.default_workflows import default_fit_workflow

    class UpdateClient(NumPyClient):
        def __init__(self, partition_id: int) -> None:
            self.partition_id = partition_id

        def fit(self, parameters, config):  # noqa: ANN001, ANN201 - Flower's signature
            vec, n = client_update(seed, self.partition_id, int(parameters[0].size))
            return [vec], n, {}

    def client_fn(context: Context):  # noqa: ANN202
        return UpdateClient(int(context.node_config["partition-id"])).to_client()

    # Flower mods: (msg, context, call_next) -> reply. Outer timer | SecAgg+ if asked | inner timer.
    def outer_timer(msg, ctx, call_next):  # noqa: ANN001, ANN202
        stage, t = _stage_of(msg), time.perf_counter()
        out = call_next(msg, ctx)
        inner = ctx.state.config_records.get("fedkv_timing")
        fit_s = float(inner["fit_s"]) if inner is not None and "fit_s" in inner else 0.0
        if inner is not None:
            del ctx.state.config_records["fedkv_timing"]
        _append_line(timing_file, {"node": msg.metadata.dst_node_id, "round": msg.metadata.group_id,
                                   "stage": stage, "total_s": time.perf_counter() - t, "fit_s": fit_s})
        return out

    def secagg_when_asked(msg, ctx, call_next):  # noqa: ANN001, ANN202
        if RECORD_KEY_CONFIGS in msg.content.config_records:
            return secaggplus_mod(msg, ctx, call_next)
        return call_next(msg, ctx)

    def inner_timer(msg, ctx, call_next):  # noqa: ANN001, ANN202
        from flwr.app import ConfigRecord

        t = time.perf_counter()
        out = call_next(msg, ctx)
        ctx.state.config_records["fedkv_timing"] = ConfigRecord({"fit_s": time.perf_counter() - t})
        return out

    client_app = ClientApp(client_fn=client_fn, mods=[outer_timer, secagg_when_asked, inner_timer])
    server_app = ServerApp()

    def run_rounds(cgrid: CountingGrid, context: Any, mode: str, size: int, n_rounds: int) -> tuple[np.ndarray, list[dict[str, float]]]:
        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients,
                          min_available_clients=clients,
                          initial_parameters=ndarrays_to_parameters([np.zeros(size, np.float32)]))
        lctx = LegacyContext(context=context, config=ServerConfig(num_rounds=n_rounds), strategy=strategy)
        fit = (SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold,
                                  clipping_range=CLIP_RANGE)
               if mode == "secaggplus" else default_fit_workflow)
        per_round: list[dict[str, float]] = []

        def timed_fit(g: Any, ctx: Any) -> None:
            m0, b0, t = cgrid.measure_seconds, cgrid.blocked_seconds, time.perf_counter()
            fit(g, ctx)
            wall = time.perf_counter() - t - (cgrid.measure_seconds - m0)
            per_round.append({"wall": wall, "server": wall - (cgrid.blocked_seconds - b0)})

        DefaultWorkflow(fit_workflow=timed_fit, evaluate_workflow=_no_evaluate)(cgrid, lctx)
        final = parameters_to_ndarrays(compat.arrayrecord_to_parameters(
            lctx.state.array_records[MAIN_PARAMS_RECORD], keep_input=True))[0]
        return final, per_round

    @server_app.main()
    def main(grid, context):  # noqa: ANN001, ANN202
        cgrid = CountingGrid(grid)
        offset = 0
        if warmup:
            for mode in modes:
                run_rounds(cgrid, context, mode, WARMUP_SIZE, 1)
            offset = _file_size(timing_file)
        for size in sizes:
            updates = [client_update(seed, p, size) for p in range(clients)]
            w = np.array([n for _, n in updates], dtype=np.float64)
            expected = sum(wi * v.astype(np.float64) for wi, (v, _) in zip(w, updates)) / w.sum()
            for mode in modes:
                first = len(cgrid.records)
                final, per_round = run_rounds(cgrid, context, mode, size, rounds)
                client_lines, offset = _read_lines(timing_file, offset)
                err = float(np.abs(final.astype(np.float64) - expected).max())
                results.append(_summarise(mode, size, clients, rounds, per_round, cgrid.records[first:],
                                          client_lines, err, num_shares, threshold))

    return server_app, client_app


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _read_lines(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()], offset + len(data)


def _summarise(mode: str, size: int, clients: int, rounds: int, per_round: list[dict[str, float]],
               records: list[dict[str, Any]], client_lines: list[dict[str, Any]], err: float,
               num_shares: int, threshold: int) -> dict[str, Any]:
    per_client = {d: defaultdict(int) for d in ("upload", "download")}
    per_stage: dict[str, float] = defaultdict(float)
    for r in records:
        per_client[r["direction"]][r["node"]] += r["bytes"]
        if r["direction"] == "upload":
            per_stage[r["stage"]] += r["bytes"]
    if len(per_client["upload"]) != clients or len(per_round) != rounds:
        raise RuntimeError(f"{mode}: expected {clients} clients x {rounds} rounds, got "
                           f"{len(per_client['upload'])} clients, {len(per_round)} rounds")
    # client protocol time: per (round, node) sum over stages of (time in mods - time in fit)
    proto: dict[tuple[str, int], float] = defaultdict(float)
    for line in client_lines:
        proto[(line["round"], line["node"])] += line["total_s"] - line["fit_s"]
    by_round: dict[str, list[float]] = defaultdict(list)
    for (rnd, _), s in proto.items():
        by_round[rnd].append(s)
    if len(by_round) != rounds or any(len(v) != clients for v in by_round.values()):
        raise RuntimeError(f"{mode}: client timing lines do not cover {clients} clients x {rounds} rounds")
    client_s = statistics.median(max(v) for v in by_round.values())
    server_s = statistics.median(r["server"] for r in per_round)
    up = statistics.mean(per_client["upload"].values()) / rounds
    down = statistics.mean(per_client["download"].values()) / rounds
    return {
        "mode": mode,
        "params": size,
        "clients": clients,
        "rounds": rounds,
        "upload_bytes_per_client_round": up,
        "upload_bytes_per_param": up / size,
        "download_bytes_per_client_round": down,
        "download_bytes_per_param": down / size,
        "upload_bytes_by_stage": {k: v / (clients * rounds) for k, v in per_stage.items()},
        "seconds_per_round": statistics.median(r["wall"] for r in per_round),
        "round_seconds": [r["wall"] for r in per_round],
        "client_protocol_seconds": client_s,
        "server_protocol_seconds": server_s,
        "protocol_seconds": client_s + server_s,
        "max_abs_error": err,
        "num_shares": num_shares if mode == "secaggplus" else 0,
        "reconstruction_threshold": threshold if mode == "secaggplus" else 0,
    }


def measure(sizes: list[int], clients: int = 5, rounds: int = 3, seed: int = 0, num_shares: int = 3,
            threshold: int = 2, modes: tuple[str, ...] = MODES, verbose: bool = False) -> list[dict[str, Any]]:
    """Run one simulation over every size and mode; return one summary dict per (size, mode)."""
    if clients < 3:
        raise ValueError("SecAgg+ needs at least 3 clients")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive parameter counts, not {sizes}")
    if unknown := set(modes) - set(MODES):
        raise ValueError(f"unknown mode(s) {sorted(unknown)}; known: {MODES}")
    for k, v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"),
                 ("RAY_DEDUP_LOGS", "0"), ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(k, v)
    from flwr.simulation import run_simulation

    results: list[dict[str, Any]] = []
    fd, timing_file = tempfile.mkstemp(prefix="fedkv-secagg-timing-", suffix=".jsonl")
    os.close(fd)
    try:
        server_app, client_app = build_apps(sizes, clients, rounds, seed, num_shares, threshold, list(modes),
                                            results, timing_file)
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"include_dashboard": False}},
                       verbose_logging=verbose)
    finally:
        os.unlink(timing_file)
    expected = len(sizes) * len(modes)
    if len(results) != expected:
        raise RuntimeError(f"the simulation produced {len(results)} of {expected} results (see its log)")
    return results


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m experiments.secagg_baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e4", help="comma-separated parameter counts, e.g. 1e4,1e5")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-shares", type=int, default=3)
    p.add_argument("--threshold", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the results list to this JSON file")
    args = p.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    logging.getLogger("flwr").setLevel(logging.WARNING)
    results = measure(sizes, args.clients, args.rounds, args.seed, args.num_shares, args.threshold)
    text = json.dumps(results, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text)
    else:
        print(text)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
