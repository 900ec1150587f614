"""Model-version coherence between a node's agents: the trainer's write-back vs its servers.

The node's parameters are one coherence entry, ``param``, in a directory kept inside the
node's cache directory (``cache.coherence_file``). A serving agent (``node.serve``) creates
the directory and holds ``param`` shared; the trainer -- a ClientApp process per message in
deployment -- takes ``param`` in M for each write-back, so in strong mode the write-back starts
only after every server has dropped its K/V and ACKed, and servers read again only after it
released. Without a serving agent there is no directory and a write-back costs nothing extra.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cache.coherence import Mode

COHERENCE_DIR = "coherence"
PARAM_ENTRY = "param"


def _open(where: Path, mode: Mode, timeout_s: float):
    """The directory in the mode its serving agent created it with (``mode`` first)."""
    from cache.coherence import CoherenceConfigError
    from cache.coherence_file import FileDirectory

    try:
        return FileDirectory(where, mode=mode, timeout_s=timeout_s)
    except CoherenceConfigError:
        other = Mode.RELAXED if mode == Mode.STRONG else Mode.STRONG
        return FileDirectory(where, mode=other, timeout_s=timeout_s)


def directory_of(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / COHERENCE_DIR


@contextmanager
def exclusive_params(cache_dir: str | os.PathLike | None, mode: Mode = Mode.STRONG,
                     timeout_s: float = 30.0) -> Iterator[int]:
    """Hold ``param`` in M while the body writes the parameters back (yields the number of
    other agents it had to invalidate; 0 and no directory when nobody serves)."""
    where = directory_of(cache_dir) if cache_dir else None
    if where is None or not where.exists():
        yield 0
        return
    directory = _open(where, mode, timeout_s)
    agent = directory.join("trainer")
    try:
        before = directory.stats().get("invalidations_sent", 0)
        agent.acquire_write(PARAM_ENTRY)
        try:
            yield directory.stats().get("invalidations_sent", 0) - before
        finally:
            agent.release(PARAM_ENTRY)
    finally:
        agent.leave()
