"""The node's parameters across messages: a failed handler leaves the committed ones.

The cache directory's committed ``param/`` tensors are what a node restores from (issue 22:
one source of truth); a handler that fails after its write-back must not commit it, and a
fresh process (``forget_all``) must find the committed version's parameters there.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from federation import node_host
from node.cache_node import CacheNode
from tests.federation.fakes import Federation


def _committed(fed: Federation, node_id: int) -> tuple[int, np.ndarray]:
    """(version, flat params) a fresh process restores for the node."""
    node_host.forget_all()
    node = node_host.peek_node(fed.grid.contexts[node_id])
    return node.version, node.flat_params()


def test_a_handler_that_fails_after_the_write_back_leaves_the_committed_parameters(monkeypatch) -> None:
    fed = Federation(2, **{"num-server-rounds": 2})
    fed.round(1)
    before = {n: _committed(fed, n) for n in fed.grid.node_ids}
    assert all(v == 1 for v, _ in before.values())

    def broken_evaluate(self):  # round 2's evaluate fails after catch_up wrote back v2
        assert self.version == 2
        raise RuntimeError("evaluation crashed after the write-back")

    monkeypatch.setattr(CacheNode, "evaluate", broken_evaluate)
    rec = fed.round(2)
    assert rec.eval_clients == 0
    for n, (version, params) in before.items():
        assert int(fed.grid.contexts[n].state.config_records[node_host.META_KEY]["version"]) == 1
        got_version, got = _committed(fed, n)
        assert got_version == version == 1
        np.testing.assert_array_equal(got, params)
        np.testing.assert_array_equal(node_host.stored_params(fed.grid.contexts[n]), params)
    node_dir = Path(os.environ["FEDKV_NODE_DIR"])
    assert not list(node_dir.rglob("params-*.npy"))  # no second stored copy of the parameters


def test_a_handler_that_fails_after_its_commit_still_reaches_the_global_model(monkeypatch) -> None:
    """A crash between the cache's commit and Flower keeping context.state (a killed process):
    the node rejoins and ends at the same global model as the others."""
    fed = Federation(3, **{"num-server-rounds": 2})
    real_save, saves = node_host.save_node, []

    def save_then_crash(context, node):
        real_save(context, node)
        if int(context.node_id) == 100:
            saves.append(node.version)
            if saves == [0, 1]:  # round 1's evaluate: committed v1, then the process dies
                raise OSError("killed after the commit")

    monkeypatch.setattr(node_host, "save_node", save_then_crash)
    records = fed.run_all()
    assert saves[:2] == [0, 1] and records[0].eval_clients == 2 and records[-1].eval_clients == 3
    assert records[-1].num_clients == 3  # node 100 trained in round 2 (from v1)
    finals = [_committed(fed, n) for n in fed.grid.node_ids]
    assert {v for v, _ in finals} == {2}
    for _, params in finals[1:]:
        np.testing.assert_array_equal(finals[0][1], params)
