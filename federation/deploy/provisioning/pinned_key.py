"""The pinned key builder: the provisioner's verify key in ``node.json`` (with the node's name
and partition) and ``server.json``. The loaders check ``roster.sig`` and the CKKS public
context against this key; its fingerprint is compared out of band."""

from __future__ import annotations

import json

from crypto.at_rest import write_public_file
from federation.deploy.provisioning.spec import Project, ProvisionContext

__all__ = ["PinnedKeyBuilder"]


class PinnedKeyBuilder:
    """Node: ``node.json``; server: ``server.json``."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        pinned = ctx.verify_key.hex()
        for i, name in project.partitions():
            meta = {"name": name, "partition-id": i, "num-partitions": project.num_partitions,
                    "provisioner-key": pinned}
            write_public_file(ctx.folders[name] / "node.json", json.dumps(meta, indent=2).encode())
        write_public_file(ctx.server() / "server.json", json.dumps({"provisioner-key": pinned}, indent=2).encode())
