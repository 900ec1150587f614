"""Provisioning: startup kits, one folder per party, holding only what that party may know.

One builder per artefact (NVFlare's ``lighter`` shape: ``spec`` and one module per builder),
run in order by a ``Provisioner``; ``write_kits(out, n)`` is the one call. It writes::

    out/server/   ca.crt  server.crt  server.key(0600)  ckks-public.ctx  roster.json  roster.sig
                  server.json  supernode-auth/node-<i>.pub
    out/node-<i>/ ca.crt  supernode-auth.key(0600)  supernode-auth.pub  identity.key(0600)
                  ckks-secret.ctx(0600)  roster.json  roster.sig  node-policy.json  node.json

Trust: the provisioner's Ed25519 key signs ``roster.json`` (``roster.sig``, over the exact file
bytes) and the CKKS public context. Its raw verify key is pinned in ``node.json`` /
``server.json``; compare its fingerprint out of band (``python -m federation.deploy.provision``
prints it). The provisioner's signing key and the TLS CA's private key are discarded after
provisioning: no kit holds them, so adding a node means provisioning a new federation.

Secrets: ``identity.key`` and ``ckks-secret.ctx`` go through ``crypto.at_rest.write_secret_file``
(mode 0600, sealed with the passphrase when one is given; without one each carries the key
check value the provisioner computed, so a changed byte is a ``KitError`` naming the file).
``server.key`` (TLS) and ``supernode-auth.key`` must stay in the plain formats Flower reads
(PEM / OpenSSH), so they are written raw with mode 0600. The server kit holds the CKKS
*public* context only. The app reads kits with ``federation.startup_kit`` (the loader).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from federation.deploy.provisioning.ckks import CKKSBuilder
from federation.deploy.provisioning.identity import IdentityBuilder
from federation.deploy.provisioning.pinned_key import PinnedKeyBuilder
from federation.deploy.provisioning.policy_file import NodePolicyBuilder
from federation.deploy.provisioning.roster import RosterBuilder
from federation.deploy.provisioning.spec import Builder, Project, ProvisionContext, ProvisionError, Provisioner
from federation.deploy.provisioning.supernode_auth import SuperNodeAuthBuilder, make_auth_key
from federation.deploy.provisioning.tls import TLSBuilder, make_tls

__all__ = [
    "Builder", "CKKSBuilder", "IdentityBuilder", "NodePolicyBuilder", "PinnedKeyBuilder", "Project",
    "ProvisionContext", "ProvisionError", "Provisioner", "RosterBuilder", "SuperNodeAuthBuilder", "TLSBuilder",
    "default_builders", "make_auth_key", "make_tls", "write_kits",
]


def default_builders() -> list[Builder]:
    """Every artefact of a kit, in an order that hands each builder what it needs (the roster
    lists the identity and auth keys and the CKKS key id)."""
    return [TLSBuilder(), SuperNodeAuthBuilder(), IdentityBuilder(), CKKSBuilder(), RosterBuilder(),
            NodePolicyBuilder(), PinnedKeyBuilder()]


def write_kits(out: Path, num_nodes: int, *, preset: str = "fedkv-4096", passphrase: bytes | None = None,
               hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1"),
               policy: Mapping | None = None) -> dict[str, Path]:
    """Provision a federation of ``num_nodes`` nodes into ``out``; returns {kit name: folder}.

    ``out`` must not hold kits already (a second provisioning would mix two trust roots)."""
    project = Project.of(num_nodes, preset=preset, passphrase=passphrase, hosts=tuple(hosts),
                         policy=dict(policy or {}))
    return Provisioner(default_builders()).provision(project, out)
