"""The SuperNode auth key builder: each node's EC P-384 key pair in the OpenSSH format
``flower-supernode --auth-supernode-private-key`` reads, and its public key in the server's
``supernode-auth/`` (what the operator registers with ``flwr supernode register``)."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from crypto.at_rest import write_public_file
from federation.deploy.provisioning.spec import Project, ProvisionContext, write_private_raw

__all__ = ["SuperNodeAuthBuilder", "make_auth_key"]


def make_auth_key() -> tuple[bytes, str]:
    """A SuperNode auth key pair (EC P-384): (OpenSSH private key bytes, OpenSSH public text)."""
    key = ec.generate_private_key(ec.SECP384R1())
    priv = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return priv, pub.decode()


class SuperNodeAuthBuilder:
    """Node: ``supernode-auth.key`` (0600) and ``.pub``; server: ``supernode-auth/<node>.pub``.
    Leaves each public key in ``ctx.auth_public`` for the roster."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        for _, name in project.partitions():
            priv, pub = make_auth_key()
            line = (pub + "\n").encode()
            write_private_raw(ctx.folders[name] / "supernode-auth.key", priv)
            write_public_file(ctx.folders[name] / "supernode-auth.pub", line)
            write_public_file(ctx.server() / "supernode-auth" / f"{name}.pub", line)
            ctx.auth_public[name] = pub
