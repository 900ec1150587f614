"""federation.node_host: an actor keeps the whole population, within bounds."""

from __future__ import annotations

import pytest
from flwr.app import Context, RecordDict

from federation import node_host


def _context(node_id: int, num_partitions: object) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": 0, "num-partitions": num_partitions},
                   state=RecordDict(), run_config={})


@pytest.mark.parametrize("population, capacity", [(5, 64), (100, 100), (300, 300), (10_000, 512),
                                                  ("junk", 64), (None, 64)])
def test_capacity_follows_the_population(population, capacity) -> None:
    assert node_host.cache_capacity(_context(1, population)) == capacity


def test_a_100_node_population_is_not_evicted(monkeypatch) -> None:
    """At 64 nodes per actor (the old fixed size) a 100-node run restored nodes from disk."""
    runtime = node_host.NodeRuntime()
    for n in range(100):
        runtime._remember((1, n), object(), 1, node_host.cache_capacity(_context(n, 100)))
    assert len(runtime.nodes) == 100 and (1, 0) in runtime.nodes
    runtime._remember((1, 100), object(), 1, 100)
    assert (1, 0) not in runtime.nodes and len(runtime.nodes) == 100  # least recent goes first
