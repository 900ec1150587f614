"""Stop the local SuperLink that ``flwr run`` left running, and only that one.

    python -m federation.deploy.stop [--flwr-home PATH] [--clean-nodes [--node-dir PATH]]

``flwr run`` starts a detached ``flower-superlink`` (whose ``--log-file`` lies in
``$FLWR_HOME/local-superlink``) and Flower has no command to stop it. This finds the
SuperLink process(es) of *this* FLWR_HOME (default ``$FLWR_HOME``, else ``~/.flwr``) by
their command line, remembers all their descendants (superexec, flwr-simulation, Ray),
stops the SuperLink by pid and then every descendant still alive, by pid
(``federation.deploy.flwr_sandbox.stop_superlinks``). SuperLinks of other FLWR_HOMEs (a
colleague's, a test sandbox's) are left alone.

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
from federation.deploy.clean import print_report
from federation.deploy.flwr_sandbox import descendants, stop_superlinks, superlink_pids


def default_flwr_home() -> Path:
    """``$FLWR_HOME`` if set, else ``~/.flwr`` (where ``flwr`` keeps its config and SuperLink)."""
    env = os.environ.get("FLWR_HOME")
    return Path(env).expanduser() if env else Path.home() / ".flwr"


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


def stop(flwr_home: Path) -> tuple[dict[int, list[int]], list[int]]:
    """Stop this FLWR_HOME's SuperLink(s) and their descendants.

    Returns ({superlink pid: [descendant pids]}, survivors).
    """
    found: dict[int, list[int]] = {}
    survivors: list[int] = []
    for home in _homes(flwr_home):
        links = [p for p in superlink_pids(home) if p not in found]
        if not links:
            continue
        for link in links:
            found[link] = descendants(link)
        survivors += stop_superlinks(home)
    return found, sorted(set(survivors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m federation.deploy.stop",
        description="Stop the local SuperLink(s) that `flwr run` started for this FLWR_HOME, "
        "and their descendants, by pid.",
    )
    parser.add_argument(
        "--flwr-home", type=Path, default=None,
        help="FLWR_HOME of the `flwr run` to clean up (default: $FLWR_HOME, else ~/.flwr)",
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
        print(f"no local SuperLink running for FLWR_HOME={home}")
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
