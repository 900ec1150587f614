"""Closed sessions are removed: no table is left behind, and a closed id stays refused."""

import pytest
import torch

from cache import ClosedSessionError, KVCache, UnknownSessionError
from tests.cache.conftest import feed, small_config


def test_open_close_cycles_leave_no_tables(kv):
    for i in range(500):
        s = kv.open_session()
        feed(kv, s, [i % 7, 1, 2, 3, 4, 5])  # one full block (cached) and a tail (freed)
        kv.close_session(s)
    assert len(kv.session_table) == 0
    st = kv.stats()
    assert st["sessions_open"] == 0 and st["blocks_referenced"] == 0
    # what is left of closed sessions is only unreferenced prefix-cache blocks, one per prompt
    assert st["blocks_used"] == st["blocks_cached_unreferenced"] == 7
    kv.bump_version()  # walks the open sessions only; drops the old prefix cache
    assert kv.stats()["blocks_used"] == 0


def test_a_closed_id_raises_closed_session_error_everywhere(kv):
    s = kv.open_session()
    feed(kv, s, [1, 2, 3, 4, 5])
    kv.close_session(s)
    uses = [lambda: kv.read(s, 0), lambda: kv.reserve(s, [1]), lambda: kv.length(s),
            lambda: kv.tokens(s), lambda: kv.fork(s), lambda: kv.is_stale(s),
            lambda: kv.match_prefix(s, [1, 2]), lambda: kv.reset_session(s),
            lambda: kv.close_session(s),
            lambda: kv.write(s, 0, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))]
    for use in uses:
        with pytest.raises(ClosedSessionError, match=f"session {s} is closed"):
            use()
    assert issubclass(ClosedSessionError, UnknownSessionError)  # a closed id is not held
    with pytest.raises(UnknownSessionError, match="never opened") as err:
        kv.read(s + 1, 0)  # an id not handed out yet is unknown, not closed
    assert not isinstance(err.value, ClosedSessionError)


def test_closing_a_fork_keeps_the_parent_and_frees_only_private_blocks(kv):
    s = kv.open_session()
    ks, _ = feed(kv, s, [1, 2, 3, 4, 5, 6])
    f = kv.fork(s)
    feed(kv, f, [7, 8, 9])  # copies the shared tail, then a private block
    kv.close_session(f)
    assert set(kv.sessions()) == {s}
    st = kv.stats()
    assert st["blocks_referenced"] == 2  # the parent's two blocks
    assert st["blocks_used"] == 3 and st["blocks_cached_unreferenced"] == 1  # f's full block
    assert torch.equal(kv.read(s, 0)[0], ks[0])


def test_closed_ids_are_never_handed_out_again(kv):
    closed = []
    for _ in range(3):
        closed.append(kv.open_session())
        kv.close_session(closed[-1])
    assert kv.open_session() not in closed


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_what_read_returned_never_shows_a_later_sessions_keys(kv_dtype):
    """Another tenant's K/V must not appear in a tensor a caller already holds, even when its
    block lands on the very pages the read came from."""
    kv = KVCache(small_config(kv_dtype=kv_dtype, fp_window=4))
    a = kv.open_session()
    feed(kv, a, [1, 2, 3, 4], seed=1)
    start = kv.session_table.get(a).blocks[0].start
    held_k, held_v = kv.read(a, 0)
    before = held_k.clone(), held_v.clone()
    kv.close_session(a)
    kv.bump_version()  # no prefix-cache entry keeps the pages
    b = kv.open_session()
    feed(kv, b, [5, 6, 7, 8], seed=2)
    assert kv.session_table.get(b).blocks[0].start == start  # the same pages, rewritten
    assert torch.equal(held_k, before[0]) and torch.equal(held_v, before[1])
