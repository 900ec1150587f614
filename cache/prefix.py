"""Content addresses of full blocks: a chained hash of (parent hash, token ids, model version).

Chaining makes a block's address depend on everything before it, so a hit on block i implies
hits on blocks 0..i-1 (vLLM's and nano-vllm's scheme). blake2b is in the standard library and
collision-resistant; the engine still compares token ids on a hit.
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
