"""``--netns``: one network namespace per SuperNode, joined by veths to a bridge we create."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

__all__ = ["Netns"]


@dataclass
class Netns:
    """One namespace per SuperNode, all joined to a host bridge we create (10.250.<k>.0/24).

    The bridge holds 10.250.<k>.1 (the SuperLink binds exactly that address, not 0.0.0.0);
    node i's namespace holds 10.250.<k>.<10+i> on its end of a veth pair whose host end is a
    bridge port. <k> is the first 10.250.x subnet no interface of this host uses yet."""

    tag: str
    subnet: int = 0
    created: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"fk{self.tag}br"

    @property
    def link_ip(self) -> str:
        return f"10.250.{self.subnet}.1"

    def name(self, i: int) -> str:
        return f"fedkv-{self.tag}-{i}"

    def setup(self, nodes: int) -> None:
        used = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
        self.subnet = next(k for k in range(1, 255) if f"10.250.{k}." not in used)
        _ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        _ip("addr", "add", f"{self.link_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(nodes):
            self._add(i)

    def _add(self, i: int) -> None:
        ns, host_if, ns_if = self.name(i), f"fk{self.tag}h{i}", f"fk{self.tag}n{i}"
        _ip("netns", "add", ns)
        self.created.append(ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        self.links.append(host_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"10.250.{self.subnet}.{10 + i}/24", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name(i), *cmd]

    def remove(self) -> None:
        """Delete what we created (veths go with their namespace or host end)."""
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.links.clear()
        self.created.clear()

    def leftovers(self) -> list[str]:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        return [n for n in names.split() if n.startswith(f"fedkv-{self.tag}-")] + \
            [w for w in links.split() if w.startswith(f"fk{self.tag}")]


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")
