"""Child program of the kill -9 test in test_segments.py: commits records in a loop until killed.

Usage: ``python tests/cache/segment_writer.py DIRECTORY KEY_HEX SEED``

Each transaction stages 1-4 puts (payloads derived from the key by ``payload_for``, so the test can
check them byte for byte) and sometimes deletes, prints ``BEGIN P <keys> D <keys>`` *before*
committing and ``OK`` right after ``commit()`` (every 10th transaction: ``compact()``) returns. So
for the test a transaction followed by ``OK`` is certainly durable and the last ``BEGIN`` without
``OK`` may or may not be.

It loads ``cache/segments/`` without running ``cache/__init__`` (which imports torch, ~1.5 s):
a bare ``cache`` package object stands in, so only ``cache.errors``, ``cache.fsperm`` and ``cache.segments`` load.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def payload_for(key: bytes) -> bytes:
    """Deterministic payload of 0..6 KiB for ``key``."""
    n = int.from_bytes(hashlib.sha256(key).digest()[:2], "big") % 6144
    return hashlib.shake_256(b"payload:" + key).digest(n) if n else b""


def _load_segments():
    if "cache" not in sys.modules:
        pkg = types.ModuleType("cache")
        pkg.__path__ = [os.path.join(ROOT, "cache")]
        sys.modules["cache"] = pkg
    import cache.segments
    return cache.segments


def main(directory: str, key_hex: str, seed: int) -> None:
    seg = _load_segments()
    store = seg.SegmentStore.open(directory, key=bytes.fromhex(key_hex) or None,
                                  segment_bytes=32 << 10)
    i = 1 + max((store.meta(k)["i"] for k in store.keys()), default=-1)
    rng = random.Random(seed)
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    txn = 0
    while True:
        puts = []
        for _ in range(rng.randint(1, 4)):
            k = f"k{i:07d}".encode()
            store.put(k, payload_for(k), {"i": i, "last_access": float(i)})
            puts.append(k)
            i += 1
        live = [k for k in store.keys() if k not in puts]
        dels = []
        if live and (len(live) > 120 or rng.random() < 0.3):
            dels = rng.sample(live, min(len(live), rng.randint(1, 4)))
        for k in dels:
            store.delete(k)
        out.write(f"BEGIN P {','.join(k.decode() for k in puts)} D "
                  f"{','.join(k.decode() for k in dels)}\n")
        out.flush()
        if txn % 10 == 9:
            store.compact()
        else:
            store.commit()
        out.write("OK\n")
        out.flush()
        txn += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
