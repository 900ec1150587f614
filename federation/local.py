"""A whole fedkv federation in one process, without Ray or a SuperLink.

``InProcessGrid`` stands in for Flower's ``Grid``: it keeps one ``Context`` per node (like a
SuperNode / the simulation engine does), calls the real ``federation.client_app.app`` for
each message, turns handler exceptions into Error replies (like the simulation engine), and
only commits a node's context when its handler succeeded. ``faults`` injects the failure
kinds the strategy must survive (tests).

``run_local(run_config, num_nodes)`` does what ``server_app.main`` does
(``federation.run.run_rounds``) over such a grid and returns the ``RunResults``. Pass your own
``grid=InProcessGrid(...)`` to reach the nodes afterwards: ``grid.node(node_id)`` is the
node's ``CacheNode`` (its model holds the final global model once the last evaluate ran).

    grid = InProcessGrid(10, {"task": "digits", "he": True, "dp-mode": "distributed"})
    results = run_local(grid.run_config, 10, grid=grid)
    model = grid.node(grid.node_ids[0]).model

Same code paths as ``flwr run``; what differs: no process boundary (so node objects are
always reused from ``federation.node_host``'s cache, which holds the whole population, its
``num-partitions``), no timeouts (messages run one after another), and the server and nodes
share one process (the cryptography is the same, the isolation is not: node secrets are in
node-local files, ``$FEDKV_NODE_DIR``, but this process can read them).
"""

from __future__ import annotations

import copy
import itertools
import math
import secrets
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from logging import ERROR, INFO
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common import log
from flwr.supercore.task_identity import TaskIdentity

from federation import client_app, node_host

__all__ = ["Fault", "InProcessGrid", "make_context", "run_local", "set_server_identity"]

Fault = Callable[[Message, Context], "Message | None"]
"""Given the message (and node context), return a replacement reply or None to drop it."""

FIRST_NODE_ID = 100
_run_ids = itertools.count(secrets.randbelow(2**48))
"""Run ids of in-process runs: unique across processes too, as Flower's are."""


def set_server_identity(run_id: int = 1) -> None:
    """Messages created outside a Flower process need a task identity."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 1


def make_context(node_id: int, partition_id: int, num_partitions: int, run_config: Mapping[str, Any],
                 run_id: int = 1, node_dir: str = "") -> Context:
    """A node's Context as a SuperNode would build it (partition-id / num-partitions)."""
    node_config: dict[str, Any] = {"partition-id": partition_id, "num-partitions": num_partitions}
    if node_dir:
        node_config["node-dir"] = node_dir
    return Context(
        run_id=run_id,
        node_id=node_id,
        node_config=node_config,
        state=RecordDict(),
        run_config=dict(run_config),
    )


class InProcessGrid:
    """Flower ``Grid`` stand-in: nodes ``100 .. 100+num_nodes-1`` (from ``first_node_id``) =
    partitions ``0 .. n-1``."""

    def __init__(self, num_nodes: int, run_config: Mapping[str, Any], run_id: int = 1, *,
                 node_dir: str | None = None, first_node_id: int = FIRST_NODE_ID) -> None:
        """``node_dir``: the nodes' root, kept (a second grid on it is a second run of the same
        nodes, as two ``flwr run`` on one ``$FEDKV_NODE_DIR``); default a private temporary one,
        removed with the grid. ``first_node_id``: Flower gives each run new node ids."""
        if num_nodes < 1:
            raise ValueError("num_nodes must be >= 1")
        set_server_identity(run_id)
        self.run_id = run_id
        self.run_config = dict(run_config)
        if node_dir is None:
            node_dir = tempfile.mkdtemp(prefix="fedkv-grid-")
            weakref.finalize(self, shutil.rmtree, node_dir, True)
        self.node_dir = str(node_dir)
        """The nodes' key files (``node-dir`` of every node)."""
        self.contexts: dict[int, Context] = {
            first_node_id + i: make_context(first_node_id + i, i, num_nodes, run_config, run_id, self.node_dir)
            for i in range(num_nodes)
        }
        self.faults: dict[tuple[int, str], Fault] = {}
        """(node_id, message_type) -> fault; checked before the handler runs."""
        self.sent: list[Message] = []
        self.received: list[Message] = []
        """Every reply handed to the server (after faults)."""

    @property
    def node_ids(self) -> list[int]:
        return list(self.contexts)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            fault = self.faults.get((node, msg.metadata.message_type))
            if fault is not None:
                reply = fault(msg, self.contexts[node])
                if reply is not None:
                    replies.append(reply)
                continue
            replies.append(self.deliver(msg))
        self.received.extend(replies)
        return replies

    @staticmethod
    def error_reason(ex: Exception) -> str:
        """The reason an Error reply carries for a handler's exception (the short form; a test
        swaps in Flower's own forms, which the strategy reads too)."""
        return f"{type(ex).__name__}: {ex}"

    def deliver(self, msg: Message) -> Message:
        """Run the real ClientApp for one message, as the simulation engine does."""
        node = msg.metadata.dst_node_id
        ctx = copy.deepcopy(self.contexts[node])
        try:
            reply = client_app.app(msg, ctx)
        except Exception as ex:  # the engine reports exceptions as Error replies
            return Message(Error(code=1, reason=self.error_reason(ex)), reply_to=msg)
        self.contexts[node] = ctx
        return reply

    def node(self, node_id: int):
        """The node's ``CacheNode`` (reused from node_host's cache, or rebuilt from its
        committed context.state). Its ``model`` holds the weights of the node's last message:
        after a run, the final global model (evaluate phases reach every node)."""
        return node_host.peek_node(self.contexts[node_id])

    def partition_of(self, node_id: int) -> int:
        return int(self.contexts[node_id].node_config["partition-id"])


def run_local(
    run_config: Mapping[str, Any],
    num_nodes: int,
    *,
    grid: InProcessGrid | None = None,
    run_id: int | None = None,
    results_dir: str | None = None,
    on_round: Callable[[Any], None] | None = None,
) -> Any:
    """Run a whole federation in this process; returns ``federation.results.RunResults``.

    ``run_config`` uses the pyproject keys (dash-separated); missing keys take the
    ``RunConfig`` defaults. ``grid`` (optional) must have ``num_nodes`` nodes and the same
    run config; pass it to inspect the nodes afterwards. ``results_dir`` writes the run's
    JSON like the ServerApp does (default: nothing written). ``RunStopped`` (``NotEnoughClients``,
    ``AggregatesRefused``) is recorded in ``results.status`` ("stopped: ...") and not raised;
    other errors raise.
    """
    from federation.config import RunConfig
    from federation.results import RunResults
    from federation.run import run_rounds
    from federation.strategy import RunStopped

    cfg = RunConfig.from_run_config(run_config)
    if grid is None:
        grid = InProcessGrid(num_nodes, run_config, run_id if run_id is not None else next(_run_ids))
    elif len(grid.contexts) != num_nodes:
        raise ValueError(f"grid has {len(grid.contexts)} nodes, num_nodes={num_nodes}")
    set_server_identity(grid.run_id)
    results = RunResults(config=cfg.as_dict(), mode=cfg.mode, run_id=grid.run_id)

    def record(rec: Any) -> None:
        log(INFO, "fedkv %s", rec.summary(cfg.num_server_rounds))
        if on_round is not None:
            on_round(rec)

    try:
        run_rounds(grid, cfg, grid.run_id, results, wait_for_nodes_s=0.0, on_round=record)
        results.status = "completed"
    except RunStopped as err:  # NotEnoughClients, AggregatesRefused
        results.status = f"stopped: {err}"
        log(ERROR, "fedkv: run stopped: %s", err)
    except Exception as err:
        results.status = f"failed: {type(err).__name__}: {err}"
        raise
    finally:
        if results_dir is not None:
            results.write(results_dir)
        else:
            results.finished_at = _now()
    return results


def _now() -> float:
    import time

    return time.time()


def final_metrics(results: Any) -> dict[str, float]:
    """Last round's eval metric and the privacy spent (NaN when not applicable)."""
    if not results.rounds:
        return {"eval_metric": math.nan, "epsilon_client": math.nan, "epsilon_sample": math.nan}
    last = results.rounds[-1]
    return {"eval_metric": last.eval_metric, "epsilon_client": last.epsilon_client,
            "epsilon_sample": last.epsilon_sample}
