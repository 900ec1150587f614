"""What the node needs of a language model that decodes through fedkv's paged KV cache.

``CachedLM`` is the whole contract between the node (``node.engine.sessions``, ``node.cache_node``,
``node.serving.serve``, ``node.workload_pass``, ``node.tasks.lm``) and a model family: the node never names
a concrete model class, so a second family (a Llama-style model with GQA and RoPE, say)
plugs in by implementing these members over the cache's public API, without touching
``cache/`` or the node. ``node.models.byte_model.TinyTransformer`` is the one implementation today.

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
* **mixed forward** -- ``forward_mixed(batch, cache)``: one scheduler step in one pass through
  the weights (a :class:`MixedBatch`: decode rows already in a ``cache.begin_batch`` step,
  prefill chunks already ``cache.reserve``-d), rows packed ``[decode..., chunk 1..., ...]``;
  attention splits per row group as above. Returns logits ``[B + chunks, vocab]``: each
  decode row's, then each chunk's last token's (the output projection runs for those only).
* **prefill** -- ``prefill(prompt, cache, sid)`` into an empty session: the cached prefix is
  taken (``cache.match_prefix``) and only the rest computed. Returns the last token's logits.
* **train step** -- ``train_loss(batch)``: the differentiable next-token loss (mean
  cross-entropy, nats per token) of ``batch`` ``[B, T + 1]`` (inputs ``[:, :-1]``, targets
  ``[:, 1:]``); ``trainable_parameters()`` are what the optimizer steps (all of them for a
  model trained whole, the adapters for a LoRA one). The loop around it is ``node.tasks.lm``'s.
* **parameter layout** -- ``parameter_layout()``: names, shapes and order of the state-dict
  entries the federation averages, encrypts and writes back (every entry for a model trained
  whole; a LoRA model's adapters only); ``node.tasks.tasks.federated_state`` and
  ``load_federated_state`` read and write exactly those.

Plus ``context_len`` (the longest sequence it takes) and ``__call__(idx)``: the cache-free
causal forward ``[B, T] -> [B, T, vocab]`` that evaluation and scoring use. Like
``nn.Module``, a ``CachedLM`` has ``train()``/``eval()``, ``state_dict()`` and
``load_state_dict()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from cache import CacheConfig, KVCache
from cache.batch import BatchStep
from crypto import Layout


@dataclass(frozen=True)
class MixedBatch:
    """One scheduler step's rows, their cache slots reserved before the forward (allocation
    is the scheduler's, so a full pool preempts before anything is computed): ``step`` is
    ``cache.begin_batch`` of the decode rows (``None`` without any), ``chunks`` the prefill
    chunks ``(sid, tokens)``, each ``cache.reserve``-d."""

    step: BatchStep | None
    decode_tokens: tuple[int, ...]
    chunks: tuple[tuple[int, tuple[int, ...]], ...]

    def tokens(self) -> list[int]:
        """Every row's token: the decode rows, then each chunk's."""
        return [*self.decode_tokens, *(t for _, toks in self.chunks for t in toks)]

    def spans(self) -> list[tuple[int, int, int]]:
        """``(sid, first row, end row)`` of each chunk in the packed rows."""
        out, a = [], len(self.decode_tokens)
        for sid, toks in self.chunks:
            out.append((sid, a, a + len(toks)))
            a += len(toks)
        return out

    def positions(self, cache: KVCache) -> torch.Tensor:
        """Each row's position: a session's rows start at its length in ``cache``."""
        sids = self.step.sids if self.step is not None else []
        pos = [torch.tensor([cache.length(s) for s in sids], dtype=torch.long)]
        pos += [torch.arange(cache.length(sid), cache.length(sid) + len(toks))
                for sid, toks in self.chunks]
        return torch.cat(pos)

    def output_rows(self) -> torch.Tensor:
        """The rows whose logits a step samples from: every decode row, each chunk's last."""
        return torch.tensor([*range(len(self.decode_tokens)), *(b - 1 for _, _, b in self.spans())],
                            dtype=torch.long)


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

    def forward_mixed(self, batch: MixedBatch, cache: KVCache) -> torch.Tensor:
        """One step's decode rows and prefill chunks in one forward; logits
        ``[len(batch.decode_tokens) + len(batch.chunks), vocab]``."""
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
