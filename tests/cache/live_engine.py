"""Child program of test_cli.py: a live engine on a cache directory, running operations.

Usage: ``python tests/cache/live_engine.py DIRECTORY``

Opens ``KVCache.open(DIRECTORY)``, prints ``ready`` and then loops: a session matches a
prefix (some hit), computes the rest of its prompt, closes; every 100 rounds a ``flush``. It
stops (closing the cache) on SIGTERM, after 120 s, or when its parent is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from cache import CacheConfig, KVCache


def _stop(signum, frame):  # noqa: ANN001 -- signal handler signature
    raise SystemExit(0)


def one_round(kv: KVCache, i: int) -> None:
    c = kv.config
    prompt = list(range(100 * (i % 5), 100 * (i % 5) + 8)) + [i % 7]
    sid = kv.open_session()
    n = kv.match_prefix(sid, prompt)
    kv.reserve(sid, prompt[n:])
    for layer in range(c.num_layers):
        k = torch.randn(c.num_heads, len(prompt) - n, c.head_dim)
        kv.append_and_read(sid, layer, k, k)
    kv.close_session(sid)


def main(directory: str) -> None:
    signal.signal(signal.SIGTERM, _stop)
    parent = os.getppid()
    kv = KVCache.open(directory, CacheConfig(
        num_layers=2, num_heads=2, head_dim=8, block_size=4, pool_bytes=1 << 20,
        managed_block_bytes=16 << 10, warm_bytes=1 << 18))
    print("ready", flush=True)
    deadline, i = time.monotonic() + 120, 0
    try:
        while time.monotonic() < deadline and os.getppid() == parent:
            one_round(kv, i)
            if i % 100 == 99:
                kv.flush()
            i += 1
            time.sleep(0.005)
    finally:
        kv.close()


if __name__ == "__main__":
    main(sys.argv[1])
