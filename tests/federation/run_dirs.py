"""Run directories for the retention and clean tests: real directories, staged mtimes."""

from __future__ import annotations

import os
import time
from pathlib import Path

HOUR = 3600.0


def stage_run(root: Path, name: str, age_s: float, size: int = 1000, nodes: int = 2, *,
              completed: bool = False, pinned: bool = False) -> Path:
    """A run directory with ``nodes`` node dirs of one ``size``-byte file each, last written
    ``age_s`` seconds ago (the run dir, its node dirs and their files all get that mtime).
    ``completed``/``pinned``: the run's ``COMPLETED``/``PINNED`` marker (empty files)."""
    run = root / name
    when = time.time() - age_s
    for i in range(nodes):
        node = run / f"node-{i}"
        node.mkdir(parents=True, exist_ok=True)
        (node / "identity.key").write_bytes(b"k" * size)
        os.utime(node / "identity.key", (when, when))
        os.utime(node, (when, when))
    for marker, wanted in (("COMPLETED", completed), ("PINNED", pinned)):
        if wanted:
            (run / marker).write_bytes(b"")
            os.utime(run / marker, (when, when))
    age(run, age_s)
    return run


def age(path: Path, age_s: float) -> None:
    """Set the mtime of ``path`` and of its direct entries to ``age_s`` seconds ago."""
    when = time.time() - age_s
    for entry in path.iterdir():
        os.utime(entry, (when, when), follow_symlinks=False)
    os.utime(path, (when, when))


def names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}
