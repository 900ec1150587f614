"""Issue 30.1: an old aggregate replayed after a node restarts.

The round of the last aggregate a node applied was kept in Flower's ``context.state``, which a
SuperNode holds in memory only: after a restart a node took round 1's aggregate again as a later
version (its parameters moved by 1.40 L2), and again after another restart. A restart here is
what a SuperNode restart leaves: a fresh ``Context`` (empty state), a fresh process (no node
objects, no loaded keys), the same node directory. ``tests/federation/deploy/test_replay_deploy.py``
does it with real SuperNode processes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from federation import node_host, node_store, protocol
from tests.federation.fakes import Federation

HE = {"he": True, "dp-mode": "distributed", "noise-multiplier": 0.05}


def restart(fed: Federation, node: int) -> None:
    """What a SuperNode restart leaves of ``node``: its node directory only."""
    old = fed.grid.contexts[node]
    fed.grid.contexts[node] = Context(run_id=old.run_id, node_id=old.node_id, node_config=dict(old.node_config),
                                      state=RecordDict(), run_config=dict(old.run_config))
    node_host.forget_all()
    node_store._CONTEXTS.clear()


def replay(fed: Federation, node: int, index: int, rnd: int):
    """A hostile server offers aggregate ``history[index]`` (with its own manifest) to ``node`` as
    the next version, in an evaluate message of round ``rnd``."""
    honest = fed.strategy.history
    fed.strategy.history = [*honest, honest[index]]
    fed.strategy.known_version[node] = len(honest)
    try:
        (msg,) = fed.strategy.configure(protocol.EVALUATE, rnd, [node])
    finally:
        fed.strategy.history = honest
    return fed.grid.deliver(msg)


def state_of(fed: Federation, node: int) -> tuple[int, np.ndarray]:
    ctx = fed.grid.contexts[node]
    return node_host.peek_node(ctx).version, node_host.stored_params(ctx)


def assert_refused_as_replay(reply) -> None:
    assert reply.has_error(), "the replayed aggregate was applied"
    reason = reply.error.reason
    assert reason.endswith(protocol.AGGREGATE_REJECTED) and "replayed" in reason, reason
    assert not re.search(r"\d", reason), reason  # nothing secret-dependent: no number at all


def test_a_replayed_aggregate_is_refused_after_restarts_and_the_node_goes_on() -> None:
    fed = Federation(3, **HE, **{"num-server-rounds": 2})
    fed.run_all()
    assert [state_of(fed, n)[0] for n in fed.grid.node_ids] == [2, 2, 2]
    for n in fed.grid.node_ids:
        restart(fed, n)
    before = {n: state_of(fed, n) for n in fed.grid.node_ids}
    for n in fed.grid.node_ids:  # rounds 1 and 2 offered again as round 3
        for index in (0, 1):
            assert_refused_as_replay(replay(fed, n, index, 3))
        restart(fed, n)  # and again after another restart
        assert_refused_as_replay(replay(fed, n, 0, 3))
    for n, (version, params) in before.items():
        got_version, got = state_of(fed, n)
        assert got_version == version == 2 and np.array_equal(got, params)
    rec = fed.round(3)  # the honest run goes on: round 3's aggregate is applied by every node
    assert not rec.aggregate_discarded and rec.num_clients == 3
    assert [state_of(fed, n)[0] for n in fed.grid.node_ids] == [3, 3, 3]


def test_a_message_that_fails_after_catch_up_is_answered_again(monkeypatch) -> None:
    """The record is written when the aggregate is applied, the parameters committed at the end of
    the message: a message that fails in between leaves the node at its old version, and the same
    aggregate, offered again, is applied (a restart in between changes nothing)."""
    real_save, failed = node_host.save_node, []

    def crash_once(context, node):
        if int(context.node_id) == 100 and node.version == 1 and not failed:
            failed.append(True)
            raise OSError("disk full")
        return real_save(context, node)

    monkeypatch.setattr(node_host, "save_node", crash_once)
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.run_all()
    assert failed and state_of(fed, 100)[0] == 0
    restart(fed, 100)
    fed.strategy.known_version[100] = 0
    (msg,) = fed.strategy.configure(protocol.EVALUATE, 2, [100])
    reply = fed.grid.deliver(msg)
    assert not reply.has_error(), reply.error.reason
    assert state_of(fed, 100)[0] == 1 and np.array_equal(state_of(fed, 100)[1], state_of(fed, 101)[1])


def test_an_aggregate_of_an_older_key_epoch_is_refused(monkeypatch) -> None:
    """A later round under an older key epoch (a departed node still holds that epoch's keys) is
    refused once the node applied an aggregate of a newer epoch."""
    from federation.applied_log import AppliedLog, AppliedRound
    from tests.federation.fakes import timeout_fault

    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.grid.faults[(100, protocol.EVALUATE)] = timeout_fault  # node 100 stays at v0
    fed.run_all()
    log = AppliedLog.for_context(fed.grid.contexts[100])
    log.note(AppliedRound(version=0, round=0, epoch=1), committed=0)  # as if v0 came from epoch 1
    fed.strategy.known_version[100] = 0
    (msg,) = fed.strategy.configure(protocol.EVALUATE, 2, [100])
    assert_refused_as_replay(fed.grid.deliver(msg))  # round 1 > 0, but epoch 0 < 1
    assert state_of(fed, 100)[0] == 0


def test_the_record_is_per_run_and_kept_private(tmp_path) -> None:
    """A fresh run on the same node directory starts with no record; the file is 0600 and holds
    what the node applied at each version of the message that wrote it."""
    from federation.applied_log import AppliedLog, AppliedRound
    from federation.local import make_context

    ctx = make_context(100, 0, 3, {"task": "digits"}, run_id=7, node_dir=str(tmp_path))
    log = AppliedLog.for_context(ctx)
    log.note(AppliedRound(1, 1, 0), committed=0)
    log.note(AppliedRound(2, 4, 1), committed=0)
    assert log.at(0) is None and log.at(1) == AppliedRound(1, 1, 0) and log.at(9) == AppliedRound(2, 4, 1)
    log.note(AppliedRound(3, 5, 1), committed=2)  # v1 is below the committed v2: dropped
    assert log.at(1) is None and log.at(2) == AppliedRound(2, 4, 1)
    log.note(AppliedRound(3, 6, 1), committed=2)  # v3 written again (its first write never committed)
    assert log.at(3) == AppliedRound(3, 6, 1)
    assert (log.path.stat().st_mode & 0o777) == 0o600
    other = AppliedLog.for_context(make_context(100, 0, 3, {"task": "digits"}, run_id=8, node_dir=str(tmp_path)))
    assert other.at(5) is None and other.path != log.path


@pytest.mark.parametrize("content", [b"", b"{", b'{"format": 1, "applied": [[1, "x", 0]]}'])
def test_a_damaged_record_fails_loudly_naming_the_file(tmp_path, content) -> None:
    from crypto import write_secret_file
    from federation.applied_log import AppliedLog
    from federation.local import make_context

    log = AppliedLog.for_context(make_context(100, 0, 3, {"task": "digits"}, node_dir=str(tmp_path)))
    log.path.parent.mkdir(parents=True, exist_ok=True)
    write_secret_file(log.path, content)
    with pytest.raises(node_store.NodeFileError, match=re.escape(str(log.path))):
        log.at(1)
