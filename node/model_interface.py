"""What the node needs of a language model that decodes through fedkv's paged KV cache.

``CachedLM`` is the whole contract between the node (``node.sessions``, ``node.cache_node``,
``node.serve``, ``node.workload_pass``, ``node.lm``) and a model family: the node never names
a concrete model class, so a second family (a Llama-style model with GQA and RoPE, say)
plugs in by implementing these members over the cache's public API, without touching
``cache/`` or the node. ``node.model.TinyTransformer`` is the one implementation today.

The cache side of the contract, as the tiny model honours it:

* **geometry** -- ``cache_config(**overrides)`` gives a ``CacheConfig`` with the model's
  ``num_layers``, ``num_heads`` and ``head_dim`` *as stored*: the K/V heads (fewer than the
  query heads under GQA, which regroups queries over them when it attends).
* **cached forward** -- ``forward_cached(tokens, cache, sid)`` feeds the new tokens of one
  session: positions start at ``cache.length(sid)`` (a RoPE model rotates from there and
  stores post-rotation keys), ``cache.reserve(sid, tokens)`` once, then per layer
  ``cache.append_and_read(sid, layer, k, v)`` with ``k``/``v`` ``[kv_heads, T, head_dim]``
  and attention over the runs it returns (``cache.attention.attend``; a session opened with a
  sparsity policy attends what the policy keeps). Returns logits ``[T, vocab]``.
* **batched forward** -- ``forward_batch(tokens, cache, sids)``: one new token for each of B
  distinct sessions, ``cache.begin_batch(sids, tokens)`` then per layer
  ``cache.append_and_read_batch(step, layer, k, v)`` and ``cache.attention.attend_shared``
  (a prefix the sessions share is attended once). Returns logits ``[B, vocab]``.
* **prefill** -- ``prefill(prompt, cache, sid)`` into an empty session: the cached prefix is
  taken (``cache.match_prefix``) and only the rest computed. Returns the last token's logits.
* **train step** -- ``train_loss(batch)``: the differentiable next-token loss (mean
  cross-entropy, nats per token) of ``batch`` ``[B, T + 1]`` (inputs ``[:, :-1]``, targets
  ``[:, 1:]``); ``trainable_parameters()`` are what the optimizer steps (all of them for a
  model trained whole, the adapters for a LoRA one). The loop around it is ``node.lm``'s.
* **parameter layout** -- ``parameter_layout()``: names, shapes and order of the state-dict
  entries the federation averages, encrypts and writes back (every entry for a model trained
  whole; a LoRA model's adapters only); ``node.tasks.federated_state`` and
  ``load_federated_state`` read and write exactly those.

Plus ``context_len`` (the longest sequence it takes) and ``__call__(idx)``: the cache-free
causal forward ``[B, T] -> [B, T, vocab]`` that evaluation and scoring use. Like
``nn.Module``, a ``CachedLM`` has ``train()``/``eval()``, ``state_dict()`` and
``load_state_dict()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from cache import CacheConfig, KVCache
from crypto import Layout


@runtime_checkable
class CachedLM(Protocol):
    """A language model the node serves through its KV cache (see the module docstring)."""

    @property
    def context_len(self) -> int:
        """The longest sequence (tokens) the model takes."""
        ...

    def cache_config(self, **overrides) -> CacheConfig:
        """A ``CacheConfig`` with the model's K/V geometry, ``overrides`` applied."""
        ...

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward: ``[B, T]`` token ids -> logits ``[B, T, vocab]``."""
        ...

    def forward_cached(self, tokens: torch.Tensor | Sequence[int], cache: KVCache,
                       sid: int) -> torch.Tensor:
        """Append ``tokens`` to session ``sid``; logits ``[T, vocab]`` for them."""
        ...

    def forward_batch(self, tokens: Sequence[int], cache: KVCache,
                      sids: Sequence[int]) -> torch.Tensor:
        """One decode step of distinct sessions ``sids`` (token i to ``sids[i]``); logits
        ``[B, vocab]``."""
        ...

    def prefill(self, prompt: Sequence[int], cache: KVCache, sid: int) -> torch.Tensor:
        """Feed ``prompt`` into the empty session ``sid`` reusing any cached prefix; the
        logits ``[vocab]`` after its last token."""
        ...

    def train_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Differentiable mean next-token cross-entropy of ``batch`` ``[B, T + 1]``."""
        ...

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters local training updates."""
        ...

    def parameter_layout(self) -> Layout:
        """The state-dict entries the federation averages: names, shapes, order."""
        ...
