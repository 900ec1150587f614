"""State machines over the block manager: random session workloads (open with prefix reuse,
append, fork, close, use after close, model-version bumps) keep refcounts equal to the block
tables, leak nothing, isolate forks (copy-on-write), forget closed sessions, never serve stale
K/V and never offer a referenced block to the eviction policy."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

import pytest

from cache import CacheFullError, ClosedSessionError, KVCache, StaleSessionError
from tests.cache.conftest import small_config

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=9)  # few symbols: many prefix hits


class CacheMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")
    CONFIG = dict(pool_bytes=256 << 10, kv_dtype="int8", fp_window=4)

    def __init__(self):
        super().__init__()
        self.kv = KVCache(small_config(**self.CONFIG))
        self.model: dict[int, list[int]] = {}  # sid -> tokens we expect
        self.values: dict[int, torch.Tensor] = {}  # sid -> layer-0 keys we wrote

    def _feed(self, sid, toks):
        # like a real model: K/V at position p are a function of tokens[: p + 1]
        c = self.kv.config
        hist = self.model[sid] + toks
        acc = torch.tensor(hist, dtype=torch.float64).add(1).mul(torch.arange(1, len(hist) + 1))
        per_pos = (acc.cumsum(0) % 7)[-len(toks):].float()
        chan = torch.arange(c.head_dim, dtype=torch.float32) / c.head_dim
        k = (per_pos.view(1, -1, 1) + chan.view(1, 1, -1)).expand(c.num_heads, -1, -1).clone()
        try:
            self.kv.reserve(sid, toks)
        except CacheFullError:
            return
        for layer in range(c.num_layers):
            self.kv.write(sid, layer, k, k)
        self.model[sid] = self.model[sid] + toks
        self.values[sid] = torch.cat([self.values[sid], k], dim=1)

    @rule(target=sessions, toks=TOKENS)
    def open(self, toks):
        sid = self.kv.open_session()
        self.model[sid], self.values[sid] = [], torch.empty(2, 0, 8)
        reused = self.kv.match_prefix(sid, toks)
        if reused:  # reused keys are those some session wrote for the same tokens
            self.model[sid] = toks[:reused]
            self.values[sid] = self.kv.read(sid, 0)[0]
        self._feed(sid, toks[reused:])
        return sid

    @rule(sid=sessions, toks=TOKENS)
    def append(self, sid, toks):
        if sid in self.model:
            self._feed(sid, toks)

    @rule(target=sessions, sid=sessions)
    def fork(self, sid):
        if sid not in self.model:
            return sid
        child = self.kv.fork(sid)
        self.model[child], self.values[child] = list(self.model[sid]), self.values[sid].clone()
        return child

    @rule(sid=sessions)
    def close(self, sid):
        if sid in self.model:
            self.kv.close_session(sid)
            del self.model[sid], self.values[sid]

    @rule(sid=sessions, toks=TOKENS)
    def use_closed(self, sid, toks):
        if sid not in self.model:
            with pytest.raises(ClosedSessionError):
                self.kv.reserve(sid, toks)

    @rule()
    def bump(self):
        self.kv.bump_version()
        for sid in list(self.model):
            try:
                self.kv.read(sid, 0)
                raise AssertionError("stale session still served")
            except StaleSessionError:
                pass
            self.kv.reset_session(sid)
            self.model[sid], self.values[sid] = [], torch.empty(2, 0, 8)

    @invariant()
    def refcounts_match_block_tables(self):
        m = self.kv.blocks
        expected: dict[int, int] = {}
        for sid in self.model:
            for b in self.kv.session_table.get(sid, allow_stale=True).blocks:
                expected[b.id] = expected.get(b.id, 0) + 1
                assert m.blocks[b.id] is b  # a table only holds live records
        for b in m.blocks.values():
            assert b.ref_count == expected.get(b.id, 0)
            assert b.start is not None or b.qhandle is not None

    @invariant()
    def nothing_leaks(self):
        m, kv = self.kv.blocks, self.kv
        unreferenced = [b for b in m.blocks.values() if b.ref_count == 0]
        assert len(unreferenced) == len(m.policy)  # each one is a prefix-cache entry
        assert all(m.index.get(b.hash) is b for b in unreferenced)
        held = [b for b in m.blocks.values() if b.start is not None]
        spans = sorted((b.start, b.start + b.capacity) for b in held)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two blocks overlap
        used = sum(b.capacity for b in held) // kv.arena.page
        assert used == kv.arena.num_pages - kv.arena.free_pages
        assert all(len(b.tokens) <= b.capacity for b in held)
        if kv.qpool is not None:
            handles = [b.qhandle for b in m.blocks.values() if b.qhandle is not None]
            assert sorted(handles) == sorted(kv.qpool.blocks)

    @invariant()
    def policy_never_offers_a_referenced_block(self):
        m = self.kv.blocks
        for key in m.policy.victims(len(m.policy)):
            assert m.index[key].ref_count == 0

    @invariant()
    def tables_are_exactly_the_open_sessions(self):
        assert set(self.kv.sessions()) == set(self.model)

    @invariant()
    def contents_match(self):
        for sid, toks in self.model.items():
            assert self.kv.tokens(sid) == toks
            if toks:
                k, _ = self.kv.read(sid, 0)
                assert k.shape == self.values[sid].shape
                assert (k - self.values[sid]).abs().max() <= 0.05 * (1 + self.values[sid].abs().max())

    def teardown(self):
        for sid in list(self.model):
            self.kv.close_session(sid)
        self.kv.bump_version()  # drops the prefix cache: every block returns to the pool
        assert self.kv.stats()["blocks_used"] == 0
        assert self.kv.arena.free_pages == self.kv.arena.num_pages
        assert self.kv.qpool is None or self.kv.qpool.slabs_in_use() == 0


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestCacheMachine = CacheMachine.TestCase


class TightPoolMachine(CacheMachine):
    """A pool so small that allocations evict cached blocks and drop idle read buffers."""

    CONFIG = dict(pool_bytes=64 << 10, kv_dtype="int8", fp_window=4, block_size=4,
                  read_buffer_fraction=0.5)


class FullPrecisionMachine(CacheMachine):
    """fp32 blocks of 8 tokens whose partly filled tails grow in pages of 2 (in place, or
    moved when the next page is taken)."""

    CONFIG = dict(pool_bytes=32 << 10, kv_dtype="fp32", block_size=8, tail_granule=2)


for _machine in (TightPoolMachine, FullPrecisionMachine):
    _machine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                          deadline=None)
TestTightPoolMachine = TightPoolMachine.TestCase
TestFullPrecisionMachine = FullPrecisionMachine.TestCase


def test_freed_blocks_are_reused():
    kv = KVCache(small_config(pool_bytes=256 << 10))
    cap = kv.arena.num_blocks
    for round_ in range(3):  # three times the capacity, one session at a time
        s = kv.open_session()
        for i in range(cap):
            kv.reserve(s, [round_, i, 0, 0])
            for layer in range(2):
                kv.write(s, layer, torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))
        kv.close_session(s)
        assert kv.stats()["blocks_used"] <= cap


def test_a_tight_int8_pool_serves_a_reused_prefix_its_own_keys():
    """TightPoolMachine's shrunk failing example, replayed: the last of 21 sessions reuses a
    cached block whose read buffer is dropped for its next block, which takes the same arena
    pages. ``read`` once returned a view of those pages, so what it had returned changed."""
    state = TightPoolMachine()
    opens = [[0, 0, 2, 0, 0], [0], [0], [0], [0], [0], [0, 0, 0, 2, 0], [0], [0], [0], [0], [0],
             [2, 0, 3, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 3, 0], [0, 0, 1, 0, 0], [0],
             [0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 2, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0],
             [2, 0, 3, 0, 0]]
    for toks in opens:
        state.open(toks=toks)
        state.contents_match()
