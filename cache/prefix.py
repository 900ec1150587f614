"""Content addresses of full blocks: a chained hash of (parent hash, token ids, model version).

Chaining makes a block's address depend on everything before it, so a hit on block i implies
hits on blocks 0..i-1 (vLLM's and nano-vllm's scheme). blake2b is in the standard library and
collision-resistant; the engine still compares token ids on a hit.

A chain starts at ``ROOT``, or at a namespace's root (``namespace_root``): blocks are shared
only between sessions of one namespace, so a serving agent that opens each tenant's sessions in
the tenant's namespace gives no tenant a prefix hit (or its latency) on another's prompt.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = b""


def block_hash(parent: bytes, tokens: list[int], version: int) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(version.to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def namespace_root(namespace: bytes | str) -> bytes:
    """The root of a namespace's hash chains: ``ROOT`` for the empty (shared) namespace, else
    a digest no block hash of another namespace (or of ``ROOT``) starts from."""
    if isinstance(namespace, str):
        namespace = namespace.encode("utf-8")
    if not namespace:
        return ROOT
    return hashlib.blake2b(namespace, digest_size=16, person=b"fedkv-prefix-ns").digest()
