"""The node identity builder: each node's X25519 (key agreement) and Ed25519 (signatures) keys
in ``identity.key``, sealed with the project's passphrase (``crypto.at_rest``, mode 0600)."""

from __future__ import annotations

import json

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto import NodeKeys
from crypto.at_rest import write_secret_file
from federation.deploy.provisioning.spec import Project, ProvisionContext

__all__ = ["IdentityBuilder", "identity_blob"]


def identity_blob(name: str, kx: X25519PrivateKey, sign: Ed25519PrivateKey) -> bytes:
    """What identity.key holds (before sealing): both private keys, PKCS#8 PEM
    (``startup_kit.NodeKit.identity`` reads it)."""
    pem, pkcs8, plain = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    return json.dumps({
        "name": name,
        "kx": kx.private_bytes(pem, pkcs8, plain).decode(),
        "sign": sign.private_bytes(pem, pkcs8, plain).decode(),
    }).encode()


class IdentityBuilder:
    """Node: ``identity.key``. Leaves each node's public keys in ``ctx.identity_public`` for the
    roster; the private keys leave this builder only inside the sealed file."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        for _, name in project.partitions():
            kx, sign = X25519PrivateKey.generate(), Ed25519PrivateKey.generate()
            pub = NodeKeys(name, kx, sign).public
            write_secret_file(ctx.folders[name] / "identity.key", identity_blob(name, kx, sign), project.passphrase)
            ctx.identity_public[name] = (pub.kx_public, pub.sign_public)
