"""Stop the local SuperLink that ``flwr run`` left running, and only that one.

    python -m federation.stop [--flwr-home PATH]

``flwr run`` starts a detached ``flower-superlink`` (whose ``--log-file`` lies in
``$FLWR_HOME/local-superlink``) and Flower has no command to stop it. This finds the
SuperLink process(es) of *this* FLWR_HOME (default ``$FLWR_HOME``, else ``~/.flwr``) by
their command line, remembers all their descendants (superexec, flwr-simulation, Ray),
stops the SuperLink by pid and then every descendant still alive, by pid
(``federation.flwr_sandbox.stop_superlinks``). SuperLinks of other FLWR_HOMEs (a
colleague's, a test sandbox's) are left alone.

Prints the pids it stopped. Exit status 0 when everything it found is gone (also when
nothing was running), 1 if a process survived SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from federation.flwr_sandbox import descendants, stop_superlinks, superlink_pids


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
        prog="python -m federation.stop",
        description="Stop the local SuperLink(s) that `flwr run` started for this FLWR_HOME, "
        "and their descendants, by pid.",
    )
    parser.add_argument(
        "--flwr-home", type=Path, default=None,
        help="FLWR_HOME of the `flwr run` to clean up (default: $FLWR_HOME, else ~/.flwr)",
    )
    args = parser.parse_args(argv)
    home = args.flwr_home if args.flwr_home is not None else default_flwr_home()
    found, survivors = stop(home)
    if not found:
        print(f"no local SuperLink running for FLWR_HOME={home}")
        return 0
    for link, family in found.items():
        kids = ", ".join(map(str, family)) if family else "none"
        print(f"stopped SuperLink pid {link} (FLWR_HOME={home}); descendants stopped: {kids}")
    if survivors:
        print(f"still alive after SIGKILL: {', '.join(map(str, survivors))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
