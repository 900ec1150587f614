"""The engine's batch step: one write and one gather per layer; the shared prefix once."""

import pytest
import torch

from cache import KVCache, ReservationError
from tests.cache.conftest import feed, small_config


def test_batch_step_shares_the_common_prefix_and_gathers_each_tail():
    kv = KVCache(small_config())
    a = kv.open_session()
    feed(kv, a, list(range(8)))  # two full blocks
    b, c = kv.fork(a), kv.fork(a)
    feed(kv, b, [50, 51])
    tail_c, _ = feed(kv, c, [60, 61, 62, 63, 64], seed=4)
    step = kv.begin_batch([a, b, c], [1, 2, 3])
    assert sum(n for _, n in step.prefix) == 8  # attended once for all three sessions
    assert step.tail_valid.sum(1).tolist() == [1, 3, 6]  # own tokens + the new one
    H, D = kv.config.num_heads, kv.config.head_dim
    for layer in range(kv.config.num_layers):
        k = torch.randn(H, 3, D)
        prefix, tk, tv, valid = kv.append_and_read_batch(step, layer, k, -k)
        assert torch.equal(tk[:, 0, 0], k[:, 0]) and torch.equal(tk[:, 2, 5], k[:, 2])
        if layer == 0:
            assert torch.equal(tk[:, 2, :5], tail_c[0])
    assert [kv.length(s) for s in (a, b, c)] == [9, 11, 14]
    assert kv.stats()["blocks_shared"] == 2


def test_batch_layers_must_come_in_order():
    kv = KVCache(small_config())
    s = kv.open_session()
    feed(kv, s, [1, 2])
    step = kv.begin_batch([s], [3])
    H, D = kv.config.num_heads, kv.config.head_dim
    with pytest.raises(ReservationError, match="out of order"):
        kv.append_and_read_batch(step, 1, torch.zeros(H, 1, D), torch.zeros(H, 1, D))
