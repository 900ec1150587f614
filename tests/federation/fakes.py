"""In-process stand-ins for Flower's Grid: drive the real ClientApp handlers directly.

``FakeGrid`` is ``federation.local.InProcessGrid`` (the public API): it keeps one
``Context`` per node (like the SuperNode/simulation does), calls ``federation.client_app.app`` for each message, turns exceptions into Error replies
(like the simulation engine), and only commits a node's context when its handler
succeeded. ``faults`` injects the failure kinds the strategy must survive.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Error, Message

from federation.local import Fault, InProcessGrid, make_context, set_server_identity

FakeGrid = InProcessGrid
"""The tests' historical name for ``federation.local.InProcessGrid``."""

__all__ = ["FakeGrid", "Fault", "make_context", "set_server_identity"]


def raise_fault(msg: Message, ctx: Context) -> Message:
    return Message(Error(code=1, reason="ClientAppException: injected failure"), reply_to=msg)


def timeout_fault(msg: Message, ctx: Context) -> None:
    return None


def tamper_fault(grid: FakeGrid, mutate: Callable[[bytes], bytes]) -> Fault:
    """Run the real handler, then replace the (signed) update bytes with ``mutate(bytes)``."""
    from federation import protocol

    def fault(msg: Message, ctx: Context) -> Message:
        reply = grid.deliver(msg)
        rec = reply.content.array_records[protocol.UPDATE]
        blob = protocol.array_to_bytes(rec["update"])
        rec["update"] = protocol.bytes_to_array(mutate(blob))
        return reply

    return fault


def payload_fault(grid: FakeGrid, mutate: Callable[[bytes, Message, Context], bytes]) -> Fault:
    """Run the real handler, replace the *payload* inside the signed update with
    ``mutate(payload, msg, ctx)`` and re-sign it with the node's own key (a node that
    misbehaves, or a bug: the signature is valid, the bytes are not a good update)."""
    from crypto import SignedUpdate
    from federation import protocol, key_service

    def fault(msg: Message, ctx: Context) -> Message:
        reply = grid.deliver(msg)
        node_ctx = grid.contexts[msg.metadata.dst_node_id]
        rec = reply.content.array_records[protocol.UPDATE]
        su = SignedUpdate.from_bytes(protocol.array_to_bytes(rec["update"]))
        keys = key_service.node_keys(node_ctx)
        payload = mutate(su.payload, msg, node_ctx)
        rec["update"] = protocol.bytes_to_array(key_service.sign(
            node_ctx, keys, su.round, payload, su.epoch, key_id=su.key_id, kind=su.kind, tag=su.tag))
        return reply

    return fault


# -- a whole in-process federation: FakeGrid + KeyService + OpaqueFedAvg ---------------------

BASE_CONFIG = {"num-server-rounds": 2, "min-clients": 2, "seed": 42, "task": "digits",
               "he": False, "dp-mode": "none", "dp-sgd": False}
"""Test defaults: digits, plaintext, no DP (the pyproject default job is lm + HE + DP)."""


class Federation:
    """What ``server_app.main`` wires together, exposed for inspection by tests."""

    def __init__(self, num_nodes: int = 3, *, run_id: int = 1, node_dir: str | None = None,
                 first_node_id: int = 100, **overrides: object) -> None:
        from federation.config import RunConfig
        from federation.run import key_service
        from federation.strategy import OpaqueFedAvg
        from node.cache_node import model_layout

        self.run_config = {**BASE_CONFIG, **overrides}
        self.cfg = RunConfig.from_run_config(self.run_config)
        self.dim = model_layout(self.cfg.task, self.cfg.seed).size
        self.grid = FakeGrid(num_nodes, self.run_config, run_id, node_dir=node_dir, first_node_id=first_node_id)
        self.keys = key_service(self.cfg, self.grid.run_id, self.dim)
        self.strategy = OpaqueFedAvg(self.cfg, self.dim, self.keys, wait_for_nodes_s=0.0)

    def round(self, rnd: int):
        return self.strategy.round(self.grid, rnd)

    def run_all(self) -> list:
        records: list = []
        self.strategy.run(self.grid, records.append)
        return records

    def admit(self) -> list[int]:
        return self.keys.admit(self.grid, sorted(self.grid.get_node_ids())).ready
