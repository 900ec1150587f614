"""Issue 30.7: every path that changes a node's weights moves the cache's model version.

The flower-central baseline loads Flower's weights (``CacheNode.set_weights``) and trains them in
place (``train_in_place``) without a write-back; K/V cached before either was served after it (a
red-team control was off by 2.74 in logits). After each, the logits through the cache must equal
those of a fresh cache under the same weights.
"""

from __future__ import annotations

import pytest
import torch

from node.cache_node import CacheNode, NodeSpec

PROMPT = list(b"def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n")


@pytest.fixture()
def node(one_thread) -> CacheNode:
    return CacheNode(NodeSpec(0, 3, task="lm"))


def _cache_prompt(node: CacheNode) -> None:
    node.model.eval()
    assert len(PROMPT) > 2 * node.cache.config.block_size
    node.model.prefill(PROMPT, node.cache, node.cache.open_session())
    assert node.cache.cached_prefix_tokens(PROMPT) >= node.cache.config.block_size


def _logits_through_the_cache(node: CacheNode) -> torch.Tensor:
    node.model.eval()
    with torch.no_grad():
        return node.model.prefill(PROMPT, node.cache, node.cache.open_session())


def _fresh_logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
    fresh = CacheNode(NodeSpec(0, 3, task="lm"))
    fresh.set_weights(state)
    return _logits_through_the_cache(fresh)


def test_kv_cached_before_set_weights_is_not_served_after_it(node) -> None:
    _cache_prompt(node)
    gen = torch.Generator().manual_seed(0)
    other = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in node.get_weights().items()}
    version = node.version
    node.set_weights(other)
    reused = node.cache.cached_prefix_tokens(PROMPT)
    got = _logits_through_the_cache(node)
    torch.testing.assert_close(got, _fresh_logits(other), rtol=1e-5, atol=1e-5)
    assert reused == 0 and node.version > version


def test_kv_cached_before_train_in_place_is_not_served_after_it(node) -> None:
    _cache_prompt(node)
    version = node.version
    node.train_in_place(1, 0.05, server_round=1)
    reused = node.cache.cached_prefix_tokens(PROMPT)
    got = _logits_through_the_cache(node)
    torch.testing.assert_close(got, _fresh_logits(node.get_weights()), rtol=1e-5, atol=1e-5)
    assert reused == 0 and node.version > version
