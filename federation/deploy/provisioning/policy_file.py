"""The node policy builder: ``node-policy.json`` in every node kit, the floors a run config
cannot lower (``federation.node_policy`` enforces them): ``startup_kit.DEFAULT_POLICY`` with the
project's entries over it."""

from __future__ import annotations

import json

from crypto.at_rest import write_public_file
from federation.deploy.provisioning.spec import Project, ProvisionContext
from federation.startup_kit import DEFAULT_POLICY

__all__ = ["NodePolicyBuilder"]


class NodePolicyBuilder:
    """Node: ``node-policy.json``."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        data = json.dumps({**DEFAULT_POLICY, **project.policy}, indent=2, sort_keys=True).encode()
        for _, name in project.partitions():
            write_public_file(ctx.folders[name] / "node-policy.json", data)
