"""The CKKS builder: the federation's epoch-0 CKKS key. Every node gets the secret context
(``ckks-secret.ctx``, sealed, 0600); the server gets only the public context, signed by the
provisioner's key (``ckks-public.ctx``, ``crypto.Dealer.signed_public_context`` format)."""

from __future__ import annotations

from crypto import Dealer
from crypto.at_rest import write_public_file, write_secret_file
from federation.deploy.provisioning.spec import Project, ProvisionContext, ProvisionError

__all__ = ["CKKSBuilder"]


class CKKSBuilder:
    """Node: ``ckks-secret.ctx``; server: ``ckks-public.ctx``. Leaves the key id in ``ctx.key_id``."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        dealer = Dealer(project.preset, signing_key=ctx.signing_key())
        if dealer.verify_key != ctx.verify_key:
            raise ProvisionError("the CKKS dealer signs with another key than the provisioner's")
        secret = dealer.context.secret_bytes()
        for _, name in project.partitions():
            write_secret_file(ctx.folders[name] / "ckks-secret.ctx", secret, project.passphrase)
        write_public_file(ctx.server() / "ckks-public.ctx", dealer.signed_public_context())
        ctx.key_id = dealer.key_id
