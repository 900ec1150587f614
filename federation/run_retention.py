"""Retention of the node directories of past runs: which runs exist, and removing old ones.

A simulation node keeps its keys, model and KV cache in ``<root>/run-<run id>/node-<node id>/``
(root: ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``; ``federation.node_store``), about 3.5 MB per
lm node per run; a deployment kit keeps a run's state in ``<kit>/state/run-<run id>/``. When a
simulation node makes the directory of a new run it calls ``prune`` with ``$FEDKV_KEEP_RUNS``
(default 3, 0 = keep all), sparing its own run, so runs do not pile up. The operator's command
over the same functions is ``python -m federation.deploy.clean``.

Safety: only entries named exactly ``run-<digits>`` directly under the root are touched; a
symlink of that name is unlinked, never followed (its target stays), and ``shutil.rmtree``
does not follow symlinks inside a run. Newest = latest write: the newest mtime of the run
directory and its direct entries (each node directory's mtime moves with every file the node
writes). A run written in the last ``ACTIVE_S`` seconds may be live (another SuperLink can share
the root), so it is kept unless forced (``active_s=0``). Removing what another process is
removing at the same time is not an error.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_DIR_ENV = "FEDKV_NODE_DIR"
KEEP_ENV = "FEDKV_KEEP_RUNS"
DEFAULT_KEEP = 3
ACTIVE_S = 300.0
"""A run written this recently may still be live: kept unless forced."""
_RUN_NAME = re.compile(r"run-[0-9]+")


class CleanError(Exception):
    """A root or argument that cannot be cleaned; its text is the one-line message."""


def default_node_root() -> Path:
    """Where simulation nodes keep their runs: ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``
    (what ``NodeStore.for_context`` uses without a ``node-dir`` node config)."""
    return Path(os.environ.get(NODE_DIR_ENV) or Path.home() / ".fedkv" / "nodes")


def keep_from_env() -> int:
    """``$FEDKV_KEEP_RUNS`` (default 3; 0 = keep all); CleanError when it is not an integer >= 0."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP
    if not raw.isdigit():
        raise CleanError(f"{KEEP_ENV}={raw!r} is not an integer >= 0 (0 keeps every run)")
    return int(raw)


def is_run_name(name: str) -> bool:
    return _RUN_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class Run:
    path: Path
    last_write: float
    is_link: bool

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def number(self) -> int:
        return int(self.name[4:])


@dataclass
class Report:
    removed: list[tuple[str, int]] = field(default_factory=list)
    """(run name, bytes) removed, or that would be removed under dry_run."""
    active: list[tuple[str, float]] = field(default_factory=list)
    """(run name, seconds since its last write) kept because it may be live."""

    @property
    def freed(self) -> int:
        return sum(b for _, b in self.removed)


def _last_write(path: Path, st: os.stat_result) -> float:
    """Newest mtime of the run directory and its direct entries (lstat: never follows links)."""
    newest = st.st_mtime
    if stat.S_ISLNK(st.st_mode):
        return newest
    with os.scandir(path) as it:
        for entry in it:
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def check_root(root: Path) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise CleanError(f"{root} is not a directory")
    return root


def runs(root: Path) -> list[Run]:
    """The runs directly under ``root``, newest write first (ties: higher run id first).

    Only directories and symlinks named ``run-<digits>``; an entry that vanishes while being
    looked at (another process removing it) is skipped."""
    found: list[Run] = []
    with os.scandir(check_root(root)) as it:
        for entry in it:
            if not is_run_name(entry.name):
                continue
            path = Path(root) / entry.name
            try:
                st = os.lstat(path)
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue
                found.append(Run(path, _last_write(path, st), stat.S_ISLNK(st.st_mode)))
            except (FileNotFoundError, NotADirectoryError):
                continue
    return sorted(found, key=lambda r: (r.last_write, r.number), reverse=True)


def size_of(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks counted as links, never followed)."""
    total = 0
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total


def _ignore_vanished(func, path, exc_info) -> None:  # shutil.rmtree onerror
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


def remove(run: Run) -> int:
    """Remove one run (a symlink: only the link); its bytes, 0 when it was already gone."""
    if run.is_link:
        try:
            os.unlink(run.path)
        except FileNotFoundError:
            return 0
        return 0
    size = size_of(run.path)
    shutil.rmtree(run.path, onerror=_ignore_vanished)
    return size


def clean(root: Path, *, keep: int | None = None, run: str | None = None, spare: tuple[str, ...] = (),
          active_s: float = ACTIVE_S, dry_run: bool = False, now: float | None = None) -> Report:
    """Remove runs under ``root``: the one named ``run``, else all but the newest ``keep``
    (``keep=None``: all). Runs named in ``spare`` are never removed; runs written in the last
    ``active_s`` seconds are kept and reported. The command and the retention hook both end here."""
    everything = runs(root)
    if run is not None:
        chosen = [r for r in everything if r.name == run]
        if not chosen:
            raise CleanError(f"no {run} under {root}")
    else:
        chosen = everything[keep:] if keep is not None else everything
    now = time.time() if now is None else now
    report = Report()
    for r in chosen:
        if r.name in spare:
            continue
        age = now - r.last_write
        if age < active_s:
            report.active.append((r.name, age))
            continue
        report.removed.append((r.name, size_of(r.path) if dry_run else remove(r)))
    return report


def prune(root: Path, keep: int, *, current: str) -> Report:
    """Retention for a new run: keep the newest ``keep`` runs (0 = all) and always ``current``."""
    if keep <= 0:
        return Report()
    return clean(root, keep=keep, spare=(current,))
