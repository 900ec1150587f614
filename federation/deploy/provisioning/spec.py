"""The provisioning spec (NVFlare's ``lighter`` shape, lighter): a ``Project`` says what the
federation is, each ``Builder`` writes one artefact into the parties' folders, and the
``Provisioner`` runs the builders in order over one ``ProvisionContext``.

The context carries what builders hand each other (the provisioner's signing key, the nodes'
public keys, the CKKS key id) and lives only for one ``Provisioner.provision`` call: the
signing key is dropped when it returns, and no builder writes it, so no kit can sign a roster
or a CKKS context after provisioning (adding a node means provisioning a new federation).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from federation.startup_kit import KitError

__all__ = ["SERVER", "Builder", "Project", "ProvisionContext", "ProvisionError", "Provisioner", "write_private_raw"]

SERVER = "server"
"""The server's kit folder name (and party name)."""
_T = TypeVar("_T")


class ProvisionError(RuntimeError):
    """A builder cannot run: the project is invalid or an earlier builder it needs was left out."""


@dataclass(frozen=True)
class Project:
    """The federation to provision: its nodes (partition id = position), TLS hosts, CKKS preset,
    the passphrase that seals node secrets (None: unsealed, each with a key check value) and the
    node policy's entries over ``startup_kit.DEFAULT_POLICY``."""

    nodes: tuple[str, ...]
    preset: str = "fedkv-4096"
    passphrase: bytes | None = None
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
    policy: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("num_nodes must be >= 1")
        if len(set(self.nodes)) != len(self.nodes) or SERVER in self.nodes:
            raise ValueError(f"node names must be distinct and not {SERVER!r}: {list(self.nodes)}")

    @classmethod
    def of(cls, num_nodes: int, **options: Any) -> Project:
        """``num_nodes`` nodes named ``node-<i>``, partition ``i``."""
        if num_nodes < 1:
            raise ValueError("num_nodes must be >= 1")
        return cls(tuple(f"node-{i}" for i in range(num_nodes)), **options)

    @property
    def num_partitions(self) -> int:
        return len(self.nodes)

    @property
    def parties(self) -> tuple[str, ...]:
        """Every kit's name: the server first, then the nodes."""
        return (SERVER, *self.nodes)

    def partitions(self) -> Iterator[tuple[int, str]]:
        """(partition id, node name) of every node."""
        return enumerate(self.nodes)


@dataclass
class ProvisionContext:
    """What builders hand each other during one provisioning (never written as such)."""

    folders: dict[str, Path]
    """Kit folder of every party (``server``, ``node-<i>``), made 0700 before any builder runs."""
    signer: Ed25519PrivateKey | None
    """The provisioner's key: signs the roster and the CKKS public context; None afterwards."""
    verify_key: bytes
    """Its raw public key, the one every kit pins."""
    identity_public: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    """Node name -> (X25519 public, Ed25519 public), from the identity builder."""
    auth_public: dict[str, str] = field(default_factory=dict)
    """Node name -> SuperNode auth public key (OpenSSH text), from the auth key builder."""
    key_id: bytes | None = None
    """The CKKS key id, from the CKKS builder."""

    def server(self) -> Path:
        return self.folders[SERVER]

    def require(self, value: _T | None, what: str, builder: str) -> _T:
        """``value``, or a ProvisionError naming the builder that must run first."""
        if value is None:
            raise ProvisionError(f"{what} is missing: the {builder} must run before this builder")
        return value

    def signing_key(self) -> Ed25519PrivateKey:
        if self.signer is None:
            raise ProvisionError("the provisioner's signing key is gone: provisioning has ended")
        return self.signer


class Builder(Protocol):
    """Writes one artefact into the kits (and may leave what later builders need in ``ctx``)."""

    def build(self, project: Project, ctx: ProvisionContext) -> None: ...


class Provisioner:
    """Runs its builders in order into a fresh folder; returns {kit name: folder}.

    A builder that fails removes the kits written so far (no half-provisioned secrets stay)."""

    def __init__(self, builders: Sequence[Builder]) -> None:
        self.builders = tuple(builders)

    def provision(self, project: Project, out: str | os.PathLike) -> dict[str, Path]:
        out = Path(out)
        if out.exists() and any(out.iterdir()):
            raise KitError(f"{out} is not empty; provision into a fresh folder")
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
        folders = {party: out / party for party in project.parties}
        signer = Ed25519PrivateKey.generate()  # the provisioner's key: lives only in this call
        ctx = ProvisionContext(folders, signer, signer.public_key().public_bytes_raw())
        try:
            for folder in folders.values():
                folder.mkdir(mode=0o700)
            for builder in self.builders:
                builder.build(project, ctx)
        except BaseException:
            for folder in folders.values():
                shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            ctx.signer = None
        return dict(folders)


def write_private_raw(path: Path, data: bytes) -> None:
    """A private key in the plain format another program reads (Flower: PEM, OpenSSH), so not
    sealed: a new file, mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
