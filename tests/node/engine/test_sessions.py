"""The node's chat-session API (issue 9 item 7) on the lm task's tiny model (LM_MODEL)."""

import numpy as np
import pytest
import torch

from node.cache_node import CacheNode, NodeSpec
from node.engine.sessions import ClosedSessionError, UnknownSessionError
from node.tasks.tasks import make_task

SYSTEM = b"# You are a helpful Python assistant.\n"  # 38 bytes: 2 full blocks of 16 + 6
BLOCK = 16


@pytest.fixture(scope="module")
def lm_task():
    torch.set_num_threads(1)  # one reduction order: greedy replies are reproducible
    return make_task("lm", 0, 3, 42, 1.0)


@pytest.fixture
def node(lm_task) -> CacheNode:
    return CacheNode(NodeSpec(partition_id=0, num_partitions=3, task="lm"), task=lm_task)


def _uncached_greedy(node: CacheNode, history: bytes, n: int) -> bytes:
    """The reference: full causal attention over the whole history, no cache at all."""
    toks = list(history)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(node.model(torch.tensor([toks]))[0, -1].argmax()))
    return bytes(toks[len(history):])


def test_create_send_reset_close_round_trip(node):
    sid = node.create_session(SYSTEM.decode())  # str is UTF-8 encoded
    assert sid in node.sessions and node.history(sid) == SYSTEM
    r1 = node.send(sid, "def add(a, b):\n", max_new_tokens=8)
    assert isinstance(r1, bytes) and len(r1) == 8
    r2 = node.send(sid, b"    return", 5)
    assert node.history(sid) == SYSTEM + b"def add(a, b):\n" + r1 + b"    return" + r2
    assert node.cache.tokens(node.sessions[sid]) == list(node.history(sid))  # all in the cache
    node.reset_conversation(sid)
    assert node.history(sid) == SYSTEM
    again = node.send(sid, "def add(a, b):\n", max_new_tokens=8)
    assert again == r1  # greedy: the same context gives the same reply
    node.close(sid)
    assert sid not in node.sessions and len(node.sessions) == 0
    assert node.cache.stats()["sessions_open"] == 0


def test_matches_decoding_without_a_cache(node):
    sid = node.create_session(SYSTEM)
    reply = node.send(sid, b"import os\n", 12)
    assert reply == _uncached_greedy(node, SYSTEM + b"import os\n", 12)


def test_sessions_with_the_same_system_prompt_share_its_full_blocks(node):
    a = node.create_session(SYSTEM)
    hits = node.cache.stats()["prefix_hit_blocks"]
    b = node.create_session(SYSTEM)
    stats = node.cache.stats()
    full = len(SYSTEM) // BLOCK
    assert stats["prefix_hit_blocks"] - hits == full
    assert stats["blocks_shared"] == full  # one copy of each full block, two holders
    assert node.send(a, b"x = 1\n", 6) == node.send(b, b"x = 1\n", 6)
    node.close(a)
    assert node.cache.stats()["blocks_shared"] == 0
    assert node.history(b).startswith(SYSTEM)  # b keeps the blocks a gave up


def test_reset_conversation_keeps_exactly_the_system_prompt(node):
    sid = node.create_session(SYSTEM)
    for text in (b"class A:\n", b"    pass\n", b"a = A()\n"):
        node.send(sid, text, 7)
    node.reset_conversation(sid)
    assert node.cache.tokens(node.sessions[sid]) == list(SYSTEM)
    assert node.send(sid, b"x", 6) == node.send(node.create_session(SYSTEM), b"x", 6)
    empty = node.create_session()
    node.send(empty, b"abc", 3)
    node.reset_conversation(empty)
    assert node.history(empty) == b""


def test_close_frees_blocks_and_removes_the_id(node):
    base = node.cache.stats()["blocks_referenced"]
    keep = node.create_session(b"x" * 20)
    for _ in range(20):  # sessions and their blocks do not pile up
        sid = node.create_session(bytes(range(65, 65 + 40)))
        node.send(sid, b"hello", 10)
        assert node.cache.stats()["blocks_referenced"] > base + 2
        node.close(sid)
        assert sid not in node.sessions
    assert list(node.sessions) == [keep]
    assert node.cache.stats()["blocks_referenced"] == base + 2  # keep's 20 tokens: 2 blocks
    assert node.cache.stats()["sessions_open"] == 1


def test_empty_text_continues_the_last_reply(node):
    a, b = node.create_session(SYSTEM), node.create_session(SYSTEM)
    whole = node.send(a, b"for i in", 10)
    assert node.send(b, b"for i in", 4) + node.send(b, b"", 6) == whole
    appended = node.create_session(SYSTEM)
    assert node.send(appended, b"for i in", 0) == b""  # append only, no reply
    assert node.send(appended, b"", 10) == whole


def test_reply_after_a_write_back_uses_the_new_weights(node):
    sid = node.create_session(SYSTEM)
    r1 = node.send(sid, b"def f(x):\n", 8)
    history = SYSTEM + b"def f(x):\n" + r1 + b"    "
    old = _uncached_greedy(node, history, 10)
    delta = np.random.default_rng(0).normal(0, 0.05, node.layout.size).astype(np.float32)
    node.apply_mean_update(delta, node.version + 1)
    assert node.cache.is_stale(node.sessions[sid])
    r2 = node.send(sid, b"    ", 10)
    assert not node.cache.is_stale(node.sessions[sid])
    assert node.history(sid) == history + r2
    assert r2 == _uncached_greedy(node, history, 10) != old
    fresh = node.create_session(SYSTEM + b"def f(x):\n" + r1)
    assert node.send(fresh, b"    ", 10) == r2


@pytest.mark.parametrize("call", [
    lambda n, s: n.send(s, b"hi"),
    lambda n, s: n.close(s),
    lambda n, s: n.reset_conversation(s),
    lambda n, s: n.history(s),
    lambda n, s: n.sessions[s],
])
def test_unknown_and_closed_ids_are_refused(node, call):
    for bad in ("chat-99", "nope", 7, None):
        with pytest.raises(UnknownSessionError, match="never created") as e:
            call(node, bad)
        assert not isinstance(e.value, ClosedSessionError)
    sid = node.create_session(SYSTEM)
    node.close(sid)
    with pytest.raises(ClosedSessionError, match="closed"):
        call(node, sid)
    with pytest.raises(KeyError):  # both are KeyErrors: dict-like lookups keep working
        call(node, sid)
    assert node.sessions.get(sid) is None and sid not in node.sessions


def test_bad_turns_are_refused_and_leave_the_session_alone(node):
    sid = node.create_session(SYSTEM)
    node.send(sid, b"a", 2)
    before = node.history(sid)
    with pytest.raises(ValueError, match="context_len"):
        node.send(sid, b"z" * 100, 32)
    with pytest.raises(ValueError, match="max_new_tokens"):
        node.send(sid, b"a", -1)
    with pytest.raises(TypeError, match="str or bytes"):
        node.send(sid, 42)
    assert node.history(sid) == before
    with pytest.raises(ValueError, match="empty"):
        node.send(node.create_session(), b"", 4)  # nothing to reply to
    with pytest.raises(ValueError, match="context_len"):
        node.create_session(b"s" * 200)
    assert node.cache.stats()["sessions_open"] == len(node.sessions) == 2


def test_a_digits_node_has_no_sessions():
    node = CacheNode(NodeSpec(0, 3, task="digits"))
    with pytest.raises(ValueError, match="lm task"):
        node.create_session(SYSTEM)
    with pytest.raises(UnknownSessionError):
        node.close("chat-0")


def test_sessions_share_system_prompt_blocks_only_within_a_namespace(node):
    a = node.sessions.create(SYSTEM, namespace="alice")
    hits = node.cache.stats()["prefix_hit_blocks"]
    node.sessions.create(SYSTEM, namespace="bob")
    node.sessions.create(SYSTEM)  # the shared namespace is another one again
    assert node.cache.stats()["prefix_hit_blocks"] == hits
    b = node.sessions.create(SYSTEM, namespace="alice")
    assert node.cache.stats()["prefix_hit_blocks"] - hits == len(SYSTEM) // BLOCK
    assert node.sessions.send(a, b"x = 1\n", 6) == node.sessions.send(b, b"x = 1\n", 6)


def test_a_recompute_that_finds_the_pool_full_keeps_the_conversation(node):
    """After a write-back a session's K/V are gone; when the pool cannot hold them again the
    turn fails, the conversation stays whole, and the next turn recomputes it."""
    from cache import KVCache
    from cache.errors import CacheFullError
    from node.engine.sessions import Sessions
    from node.tasks.tasks import LM_MODEL
    sessions = Sessions(node.model, KVCache(LM_MODEL.cache_config(pool_bytes=8 * 16 * 1024)))
    sid = sessions.create(SYSTEM)
    sessions.send(sid, b"ab", 4)  # 44 tokens: 3 blocks of 8
    history = sessions.history(sid)
    sessions.cache.set_version(1)  # a write-back: the session's blocks are dropped
    other = sessions.create(b"z" * 100)  # 7 blocks
    with pytest.raises(CacheFullError):
        sessions.send(sid, b"x", 4)
    assert sessions.history(sid) == history
    with pytest.raises(CacheFullError):
        sessions.rollback(sid, len(history) - 2)
    assert sessions.history(sid) == history[:-2]
    sessions.close(other)
    assert sessions.send(sid, b"x", 4) == _uncached_greedy(node, history[:-2] + b"x", 4)
    assert sessions.history(sid) == history[:-2] + b"x" + _uncached_greedy(node, history[:-2] + b"x", 4)
