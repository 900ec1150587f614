"""A hostile ServerApp for ``test_replay_deploy``: one honest round, then round 1's aggregate
replayed to every node as the next version (in an evaluate message of round 3), after the test
restarted the SuperNodes.

Copied into the test's app folder as ``fedkv_replay_server.py`` (the app's ``serverapp``). It
talks to the test through files in the run's ``results-dir``: it writes ``honest-done`` after
round 1, waits for ``restarted``, then writes every node's answer to ``replay.json``
(``{node id: {"error": reason} | {"version": v}}``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from federation import messages, protocol
from federation.codec import wire_dim
from federation.config import RunConfig
from federation.run import key_service
from federation.strategy import OpaqueFedAvg
from node.cache_node import model_layout

app = ServerApp()
WAIT_S = 300.0


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"replay server: timed out waiting for {what}")
        time.sleep(0.5)


def _answers(replies, sent: dict[str, int]) -> dict[str, dict]:
    out = {}
    for reply in replies:
        node = protocol.reply_sender(reply, sent)
        if reply.has_error():
            out[str(node)] = {"error": reply.error.reason}
        else:
            out[str(node)] = {"version": messages.parse_eval_reply(reply).version}
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_run_config(context.run_config)
    here = Path(cfg.results_dir)
    here.mkdir(parents=True, exist_ok=True)
    dim = wire_dim(cfg, model_layout(cfg.task_id, cfg.seed).size)
    strategy = OpaqueFedAvg(cfg, dim, key_service(cfg, int(context.run_id), dim), wait_for_nodes_s=cfg.round_timeout)
    rounds = []
    strategy.run(grid, rounds.append)  # num-server-rounds = 1: every node applies round 1's aggregate
    nodes = sorted(grid.get_node_ids())
    (here / "honest-done").write_text(json.dumps({"nodes": nodes, "history": len(strategy.history),
                                                  "evaluated": rounds[-1].eval_clients}))
    _wait_for(lambda: (here / "restarted").exists(), "the test to restart the SuperNodes")
    _wait_for(lambda: set(nodes) <= set(grid.get_node_ids()), "the restarted SuperNodes")
    honest = list(strategy.history)
    strategy.history = [*honest, honest[0]]  # round 1's aggregate (its own manifest) as v2
    for node in nodes:
        strategy.known_version[node] = len(honest)
    msgs = strategy.configure(protocol.EVALUATE, 3, nodes)
    replies = grid.send_and_receive(msgs, timeout=cfg.round_timeout)
    (here / "replay.json").write_text(json.dumps(_answers(replies, protocol.destinations(msgs))))
