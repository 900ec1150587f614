"""Retention of the node directories of past runs: which runs exist, and removing old ones.

A simulation node keeps its keys, model and KV cache in ``<root>/run-<run id>/node-<node id>/``
(root: ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``; ``federation.node_store``), about 3.5 MB per
lm node per run; a deployment kit keeps a run's state in ``<kit>/state/run-<run id>/``. When a
simulation node makes the directory of a new run it calls ``prune`` with ``$FEDKV_KEEP_RUNS``
(default 3, 0 = keep all), sparing its own run, so runs do not pile up. The operator's command
over the same functions is ``python -m federation.deploy.clean``.

What is kept (issue 30: retention once deleted the fine-tuned node a server was serving):

* the newest N *completed* runs, and apart from them the newest N others (failed, stopped or
  still running), so failed attempts never push a completed run out. A run is completed when
  its ``COMPLETED`` marker exists: a node writes it once it has evaluated the last round
  (``NodeStore.mark_completed``), i.e. after the final aggregate was applied;
* any run in use by a live process: a lease (``node.serving.dir_lease``) anywhere in its tree, held by a
  serving process on its cache directory (``node.serving.param_follower``) or by a node process on the
  run directory for as long as that process lives (``NodeStore.for_context``); a lease of a dead
  process is stale and pins nothing. Never overridden, not even by ``--force``;
* a pinned run (a ``PINNED`` file in the run directory; ``clean --pin ID``): never removed, not
  even by ``--all``, and not counted;
* a run written in the last ``ACTIVE_S`` seconds (it may be live), unless forced.

Safety: only entries named exactly ``run-<digits>`` directly under the root are touched; a
symlink of that name is unlinked, never followed (its target stays), and ``shutil.rmtree``
does not follow symlinks inside a run. Newest = latest write: the newest mtime of the run
directory and its direct entries (each node directory's mtime moves with every file the node
writes). Removing what another process is removing at the same time is not an error. A
serving process that starts on a run in the instant between the lease check and the removal
is not seen; a run this old is not one a serving process is expected to start on.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.serving.dir_lease import Holder, holders

NODE_DIR_ENV = "FEDKV_NODE_DIR"
KEEP_ENV = "FEDKV_KEEP_RUNS"
DEFAULT_KEEP = 3
ACTIVE_S = 300.0
"""A run written this recently may still be live: kept unless forced."""
COMPLETED = "COMPLETED"
"""Marker file in a run directory: the run completed (a node evaluated its last round)."""
PINNED = "PINNED"
"""Marker file in a run directory: the user pinned the run; retention never removes it."""
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


def human(n: float) -> str:
    """Bytes for a person: ``512 B``, ``3.5 MB`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


@dataclass(frozen=True)
class Run:
    path: Path
    last_write: float
    is_link: bool
    completed: bool = False
    pinned: bool = False

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
    in_use: list[tuple[str, list[Holder]]] = field(default_factory=list)
    """(run name, the live leases under it) kept because a live process uses it."""
    pinned: list[str] = field(default_factory=list)
    """Runs selected (``--run``, ``--all``) but kept because they are pinned."""

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
            if entry.name == PINNED:
                continue
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
                found.append(Run(path, _last_write(path, st), stat.S_ISLNK(st.st_mode),
                                 completed=os.path.lexists(path / COMPLETED),
                                 pinned=os.path.lexists(path / PINNED)))
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


def in_use(run: Run) -> list[Holder]:
    """The live leases under a run (none for a symlinked run: only the link is removed)."""
    return [] if run.is_link else holders(run.path)


def select(everything: list[Run], keep: int) -> list[Run]:
    """Runs past the newest ``keep`` completed ones and past the newest ``keep`` others;
    pinned runs are not counted (nor selected)."""
    unpinned = [r for r in everything if not r.pinned]
    done = [r for r in unpinned if r.completed]
    others = [r for r in unpinned if not r.completed]
    return sorted(done[keep:] + others[keep:], key=everything.index)


def clean(root: Path, *, keep: int | None = None, run: str | None = None, spare: tuple[str, ...] = (),
          active_s: float = ACTIVE_S, dry_run: bool = False, now: float | None = None) -> Report:
    """Remove runs under ``root``: the one named ``run``, else those ``select`` picks for
    ``keep`` (``keep=None``: all). Never removed: runs named in ``spare``, pinned runs, runs a
    live process holds a lease in; runs written in the last ``active_s`` seconds are kept and
    reported. The command and the retention hook both end here."""
    everything = runs(root)
    if run is not None:
        chosen = [r for r in everything if r.name == run]
        if not chosen:
            raise CleanError(f"no {run} under {root}")
    else:
        chosen = select(everything, keep) if keep is not None else everything
    now = time.time() if now is None else now
    report = Report()
    for r in chosen:
        if r.name in spare:
            continue
        if r.pinned:
            report.pinned.append(r.name)
            continue
        live = in_use(r)
        if live:
            report.in_use.append((r.name, live))
            continue
        age = now - r.last_write
        if age < active_s:
            report.active.append((r.name, age))
            continue
        report.removed.append((r.name, size_of(r.path) if dry_run else remove(r)))
    return report


def pin(root: Path, run: str, pinned: bool = True) -> bool:
    """Pin (or unpin) ``run`` under ``root``; True when that changed something."""
    path = check_root(root) / run
    if not path.is_dir():
        raise CleanError(f"no {run} under {root}")
    marker = path / PINNED
    if pinned == os.path.lexists(marker):
        return False
    st = os.stat(path)
    if pinned:
        marker.write_text("pinned: retention (FEDKV_KEEP_RUNS, federation.deploy.clean) never removes this run\n")
    else:
        marker.unlink()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # pinning is not a write: the run keeps its age
    return True


def kept_lines(report: Report) -> list[str]:
    """One line per run kept although selected: why, and what would remove it."""
    lines = [f"kept {name}: in use by {', '.join(h.describe() for h in live)}; stop it to let the run go"
             for name, live in report.in_use]
    lines += [f"kept {name}: pinned (python -m federation.deploy.clean --unpin {name} lets it go)"
              for name in report.pinned]
    lines += [f"kept {name}: written {age:.0f} s ago, it may be live; --force removes it"
              for name, age in report.active]
    return lines


def prune(root: Path, keep: int, *, current: str) -> Report:
    """Retention for a new run: keep the newest ``keep`` completed runs and the newest ``keep``
    others (0 = all), and always ``current``, pinned runs and runs in use."""
    if keep <= 0:
        return Report()
    return clean(root, keep=keep, spare=(current,))
