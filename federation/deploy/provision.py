"""``python -m federation.deploy.provision --nodes N --out kits/``: write startup kits, say where each goes.

Run it on the provisioner's (offline) machine. It prints which folder belongs on which machine
and the provisioner key fingerprint every party should compare out of band. The passphrase
(optional) seals each node's identity.key and ckks-secret.ctx; it is read from the environment
variable named by ``--passphrase-env``, never from the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from crypto.context import PRESETS
from federation.deploy.provisioning import write_kits
from federation.startup_kit import KitError, fingerprint, load_server_kit


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m federation.deploy.provision", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True, help="number of nodes (partitions)")
    p.add_argument("--out", type=Path, required=True, help="empty folder to write the kits into")
    p.add_argument("--preset", default="fedkv-4096", choices=sorted(PRESETS), help="CKKS parameter preset")
    p.add_argument("--passphrase-env", metavar="VAR", default=None,
                   help="seal node secrets with the passphrase in this environment variable")
    p.add_argument("--host", action="append", default=None, metavar="H",
                   help="SuperLink host name or IP for the TLS certificate (repeat; default: localhost 127.0.0.1 ::1)")
    return p.parse_args(argv)


def _passphrase(var: str | None) -> bytes | None:
    if var is None:
        return None
    value = os.environ.get(var)
    if not value:
        raise SystemExit(f"--passphrase-env {var}: the variable is unset or empty")
    return value.encode()


def describe(kits: dict[str, Path], hosts: Sequence[str]) -> str:
    server = load_server_kit(kits["server"])
    lines = [
        f"provisioner key fingerprint: {fingerprint(server.roster.provisioner_key)} (compare out of band)",
        f"CKKS key id: {server.roster.key_id.hex()}",
        f"{kits['server']}/  -> the SuperLink machine (TLS cert for {', '.join(hosts)}; "
        "CKKS public context only)",
    ]
    for entry in server.roster.entries:
        lines.append(f"{kits[entry.name]}/  -> node machine {entry.name} (partition {entry.partition_id})")
    lines.append("Copy each folder to its machine only (e.g. scp -r), keep modes (0600 secrets), then delete it here.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    hosts = args.host or ["localhost", "127.0.0.1", "::1"]
    try:
        kits = write_kits(args.out, args.nodes, preset=args.preset, passphrase=_passphrase(args.passphrase_env),
                          hosts=hosts)
    except (KitError, ValueError) as exc:
        print(f"provision: {exc}", file=sys.stderr)
        return 2
    print(describe(kits, hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
