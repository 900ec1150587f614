"""Stop the local SuperLink that a run of this FLWR_HOME left running, and only that one.

    python -m federation.deploy.stop [--flwr-home PATH] [--clean-nodes [--node-dir PATH]]

Flower has no command to stop the detached local ``flower-superlink``. This stops, in
*this* FLWR_HOME (default ``$FLWR_HOME``, else ``~/.flwr``):

- the SuperLink ``federation.deploy.check`` started and recorded in
  ``$FLWR_HOME/local-superlink/fedkv-superlink.json``, by its pid, while that pid is still the
  recorded process (same start time, this user);
- any ``flower-superlink`` of this user that a plain ``flwr run`` started for this FLWR_HOME
  (its ``--log-file`` lies in ``$FLWR_HOME/local-superlink``; ``flwr run`` records no pid).

For each it remembers all descendants (superexec, flwr-simulation, Ray), stops the SuperLink
by pid and then every descendant still alive, by pid. SuperLinks of other FLWR_HOMEs or users
(a colleague's on Flower's default port, a test sandbox's) are left alone, and named when
nothing of ours runs.

Prints the pids it stopped. Exit status 0 when everything it found is gone (also when
nothing was running), 1 if a process survived SIGKILL.

``--clean-nodes`` then removes every run's node directories under the node root
(``--node-dir``, else ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``): ``python -m
federation.deploy.clean --all --force`` (forced: the runs' last writes are seconds old, and the
SuperLink that made them has just stopped). Nothing is removed when a process survived.
A root shared with a SuperLink of another FLWR_HOME still running would lose that run's
files too: use ``federation.deploy.clean --keep``/``--run`` there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from federation import run_retention
from federation.deploy import local_superlink as link
from federation.deploy.clean import print_report
from federation.deploy.flwr_sandbox import alive, descendants, stop_pids
from federation.deploy.local_superlink import default_flwr_home
from federation.deploy.port_owner import describe, listeners


def _homes(flwr_home: Path) -> list[Path]:
    """The path as given and as an absolute path: the SuperLink's command line has the
    FLWR_HOME spelling that ``flwr run`` was started with."""
    given = Path(flwr_home).expanduser()
    out = [given]
    absolute = Path(os.path.abspath(given))
    for other in (absolute, absolute.resolve()):
        if other not in out:
            out.append(other)
    return out


def _ours(flwr_home: Path) -> tuple[dict[int, list[int]], link.Record | None]:
    """{SuperLink pid: its descendants} of this FLWR_HOME, and its record (None if none)."""
    record = link.load_record(Path(os.path.abspath(Path(flwr_home).expanduser())))
    found: dict[int, list[int]] = {}
    if record is not None and link.running(record):
        found[record.pid] = descendants(record.pid)
    for home in _homes(flwr_home):
        for pid in link.own_superlink_pids(home):
            found.setdefault(pid, descendants(pid))
    return found, record


def stop(flwr_home: Path) -> tuple[dict[int, list[int]], list[int]]:
    """Stop this FLWR_HOME's SuperLink(s) and their descendants, by pid.

    Returns ({superlink pid: [descendant pids]}, survivors).
    """
    found, record = _ours(flwr_home)
    survivors: list[int] = []
    for pid, family in found.items():
        stop_pids([pid])
        stop_pids([p for p in family if alive(p)])
        survivors += [p for p in [pid, *family] if alive(p)]
    if record is not None and not link.running(record):
        link.forget_record(Path(os.path.abspath(Path(flwr_home).expanduser())), record)
    return found, sorted(set(survivors))


def _not_ours_note() -> str:
    """Who holds the port a plain ``flwr run`` would use, when that is not this FLWR_HOME's."""
    port = os.environ.get(link.HTTP_PORT_ENV, "").strip()
    port_n = int(port) if port.isdigit() else link.FLOWER_DEFAULT_HTTP_PORT
    holders = listeners(port_n)
    return f" (127.0.0.1:{port_n} is held by {describe(holders)}: not this FLWR_HOME's, left alone)" if holders else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m federation.deploy.stop",
        description="Stop the local SuperLink(s) that `flwr run` started for this FLWR_HOME, "
        "and their descendants, by pid.",
    )
    parser.add_argument(
        "--flwr-home", type=Path, default=None,
        help="FLWR_HOME of the run to clean up (default: $FLWR_HOME, else ~/.flwr)",
    )
    parser.add_argument(
        "--clean-nodes", action="store_true",
        help="then remove every run's node directories (python -m federation.deploy.clean --all --force)",
    )
    parser.add_argument(
        "--node-dir", type=Path, default=None,
        help="root of the node directories for --clean-nodes (default: $FEDKV_NODE_DIR, else ~/.fedkv/nodes)",
    )
    args = parser.parse_args(argv)
    if args.node_dir is not None and not args.clean_nodes:
        parser.error("--node-dir goes with --clean-nodes")
    home = args.flwr_home if args.flwr_home is not None else default_flwr_home()
    found, survivors = stop(home)
    if not found:
        print(f"no local SuperLink running for FLWR_HOME={home}{_not_ours_note()}")
    for link, family in found.items():
        kids = ", ".join(map(str, family)) if family else "none"
        print(f"stopped SuperLink pid {link} (FLWR_HOME={home}); descendants stopped: {kids}")
    if survivors:
        print(f"still alive after SIGKILL: {', '.join(map(str, survivors))}", file=sys.stderr)
        if args.clean_nodes:
            print("node directories not removed: a process of the run survived", file=sys.stderr)
        return 1
    return clean_nodes(args.node_dir) if args.clean_nodes else 0


def clean_nodes(node_dir: Path | None) -> int:
    """``federation.deploy.clean --all --force`` on ``node_dir`` (default root when None)."""
    root = Path(node_dir).expanduser() if node_dir is not None else run_retention.default_node_root()
    if node_dir is None and not os.path.lexists(root):
        print(f"no node directories: {root} does not exist")
        return 0
    try:
        report = run_retention.clean(root, active_s=0.0)
    except (run_retention.CleanError, OSError) as err:
        print(f"python -m federation.deploy.stop: error: {err}", file=sys.stderr)
        return 2
    print(f"node directories under {root}:")
    print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
