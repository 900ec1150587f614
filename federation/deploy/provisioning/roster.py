"""The roster builder: ``roster.json`` (every node's name, partition and public keys, the CKKS
key id, the provisioner's verify key) and ``roster.sig`` (the provisioner's Ed25519 signature
over the exact file bytes) in every kit. Needs the identity, auth key and CKKS builders first."""

from __future__ import annotations

from crypto.at_rest import write_public_file
from federation.deploy.provisioning.spec import Project, ProvisionContext
from federation.startup_kit import Roster, RosterEntry

__all__ = ["RosterBuilder"]


class RosterBuilder:
    """Every party: ``roster.json`` and ``roster.sig``."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        entries = []
        for i, name in project.partitions():
            kx, sign = ctx.require(ctx.identity_public.get(name), f"{name}'s identity", "IdentityBuilder")
            auth = ctx.require(ctx.auth_public.get(name), f"{name}'s SuperNode auth key", "SuperNodeAuthBuilder")
            entries.append(RosterEntry(name, i, kx, sign, auth))
        key_id = ctx.require(ctx.key_id, "the CKKS key id", "CKKSBuilder")
        data = Roster(tuple(entries), ctx.verify_key, key_id, project.num_partitions).to_json().encode()
        sig = ctx.signing_key().sign(data)
        for folder in ctx.folders.values():
            write_public_file(folder / "roster.json", data)
            write_public_file(folder / "roster.sig", sig)
