"""List, pin and remove the node directories of past runs.

    python -m federation.deploy.clean [--node-dir PATH | --kit PATH]            # list runs, size, state
    python -m federation.deploy.clean --run ID | --all | --keep N [--dry-run] [--force]
    python -m federation.deploy.clean --pin ID | --unpin ID

The runs live in ``<root>/run-<run id>/`` (root: ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``)
or, for a deployment kit, in ``<kit>/state/run-<run id>/`` (``--kit PATH``); what counts as a run,
which is newest, completed, pinned or in use, and what is kept are ``federation.run_retention``'s
rules, the same the nodes apply when a run starts (``$FEDKV_KEEP_RUNS``). ``--run ID`` removes one
run, ``--all`` every run, ``--keep N`` all but the newest N completed runs and the newest N others
(N >= 1: the newest run is never removed by ``--keep``; ``--all`` says so explicitly). A pinned
run (``--pin ID``: a ``PINNED`` file in it) is never removed, not even by ``--all``, until
``--unpin ID``; a run a live process holds a lease in (a server serving from its cache
directory, a node of a run in progress) is never removed, not even with ``--force``. A run
written in the last ``ACTIVE_S`` seconds may be live, so it is kept unless ``--force``
(``federation.deploy.stop --clean-nodes`` forces: it has just stopped the SuperLink). Errors are
one line on stderr, exit status 2; exit status 1 when a selected run was kept (pinned, in use or
active).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from federation.run_retention import (
    ACTIVE_S, CleanError, Report, Run, check_root, clean, default_node_root, human, in_use, kept_lines, pin, runs,
    size_of,
)

__all__ = ["human", "main", "print_report"]


def print_report(report: Report, *, dry_run: bool = False, out=None) -> None:
    out = sys.stdout if out is None else out
    verb = "would remove" if dry_run else "removed"
    for name, size in report.removed:
        print(f"{verb} {name} ({human(size)})", file=out)
    for line in kept_lines(report):
        print(line, file=out)
    print(f"{'would free' if dry_run else 'freed'} {human(report.freed)} ({report.freed} bytes)", file=out)


def _list(root: Path) -> None:
    found = runs(root)
    sizes = [size_of(r.path) for r in found]
    print(f"{root}: {len(found)} run(s), {human(sum(sizes))} ({sum(sizes)} bytes); newest first")
    for r, size in zip(found, sizes):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_write))
        print(f"  {r.name:<24} {human(size):>10}  last write {when}  {_state(r)}")


def _state(run: Run) -> str:
    """What retention makes of a run: completed or not, pinned, in use by whom, a symlink."""
    parts = ["completed" if run.completed else "not completed"]
    if run.pinned:
        parts.append("pinned")
    live = in_use(run)
    if live:
        parts.append("in use by " + ", ".join(h.describe() for h in live))
    if run.is_link:
        parts.append("a symlink: only the link is removed")
    return "; ".join(parts)


def _run_name(value: str, flag: str) -> str:
    digits = value[4:] if value.startswith("run-") else value
    if not (digits.isascii() and digits.isdigit()):
        raise CleanError(f"{flag} {value!r}: a run id is digits (e.g. 5 or run-5)")
    return f"run-{digits}"


def _pin(root: Path, args: argparse.Namespace) -> int:
    pinned = args.pin is not None
    name = _run_name(args.pin if pinned else args.unpin, "--pin" if pinned else "--unpin")
    changed = pin(root, name, pinned)
    if pinned:
        print(f"{name} {'is now' if changed else 'was already'} pinned: retention never removes it, --unpin lets it go")
    else:
        print(f"{name} {'is no longer' if changed else 'was not'} pinned")
    return 0


def _root(args: argparse.Namespace) -> tuple[Path, bool]:
    """(root, given): a root given with --node-dir must exist; the default root and a kit's
    state/ are simply absent before the first run."""
    if args.kit is not None:
        kit = Path(args.kit).expanduser()
        if not (kit / "node.json").is_file():
            raise CleanError(f"{kit} is not a node kit (no node.json)")
        return kit / "state", False
    if args.node_dir is not None:
        return Path(args.node_dir).expanduser(), True
    return default_node_root(), False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m federation.deploy.clean",
        description="List or remove the node directories of past runs (<root>/run-<id>/). "
        "Without --run/--all/--keep: list them.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--node-dir", default=None,
                       help="root of the simulation node directories (default: $FEDKV_NODE_DIR, else ~/.fedkv/nodes)")
    where.add_argument("--kit", default=None, help="a deployment node kit: clean its state/run-<id>/")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--run", default=None, metavar="ID", help="remove run ID (its run-ID directory)")
    what.add_argument("--all", action="store_true", help="remove every run")
    what.add_argument("--keep", type=int, default=None, metavar="N",
                      help="keep the newest N completed runs and the newest N others (N >= 1), remove the rest")
    what.add_argument("--pin", default=None, metavar="ID",
                      help="pin run ID (a PINNED file in it): never removed, not counted by --keep/FEDKV_KEEP_RUNS")
    what.add_argument("--unpin", default=None, metavar="ID", help="unpin run ID")
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    parser.add_argument("--force", action="store_true",
                        help=f"also remove runs written in the last {ACTIVE_S:.0f} s (they may be live)")
    args = parser.parse_args(argv)
    try:
        root, given = _root(args)
        pinning = args.pin is not None or args.unpin is not None
        if not given and not pinning and not os.path.lexists(root):
            print(f"{root}: no runs (it does not exist)")
            return 0
        check_root(root)
        if pinning:
            return _pin(root, args)
        if not (args.run is not None or args.all or args.keep is not None):
            _list(root)
            return 0
        run = _run_name(args.run, "--run") if args.run is not None else None
        if args.keep is not None and args.keep < 1:
            raise CleanError("--keep N needs N >= 1 (the newest run is kept); --all removes every run")
        report = clean(root, keep=args.keep, run=run, active_s=0.0 if args.force else ACTIVE_S,
                       dry_run=args.dry_run)
    except (CleanError, OSError) as err:
        print(f"python -m federation.deploy.clean: error: {err}", file=sys.stderr)
        return 2
    print_report(report, dry_run=args.dry_run)
    return 1 if report.active or report.in_use or report.pinned else 0


if __name__ == "__main__":
    raise SystemExit(main())
