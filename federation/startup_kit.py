"""Startup kits, the loading side: open and check a party's kit folder (NVFlare-style kits).

A kit holds only what its party may know; ``python -m federation.deploy.provision``
(``federation.deploy.provisioning``) writes them::

    server/   ca.crt  server.crt  server.key(0600)  ckks-public.ctx  roster.json  roster.sig
              server.json  supernode-auth/node-<i>.pub
    node-<i>/ ca.crt  supernode-auth.key(0600)  supernode-auth.pub  identity.key(0600)
              ckks-secret.ctx(0600)  roster.json  roster.sig  node-policy.json  node.json

``load_node_kit`` / ``load_server_kit`` refuse a kit with a missing file (``KitError`` naming
it), a secret others can read, a roster whose signature does not verify with the provisioner
key pinned in ``node.json`` / ``server.json``, or a CKKS public context that is not the
roster's. Secrets (``identity.key``, ``ckks-secret.ctx``) are read with
``crypto.at_rest.read_secret_file``: a wrong passphrase or a changed byte is a ``KitError``
naming the file ("<path>: key check failed: the file changed since it was written").
``Roster`` and ``DEFAULT_POLICY`` are the formats both sides share.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from crypto import NodeKeys
from crypto.at_rest import read_secret_file
from crypto.errors import CryptoError
from federation.node_policy import KIT_DEFAULTS

__all__ = [
    "KitError",
    "RosterEntry",
    "Roster",
    "NodeKit",
    "ServerKit",
    "DEFAULT_POLICY",
    "load_node_kit",
    "load_server_kit",
    "fingerprint",
]

DEFAULT_POLICY: dict[str, object] = dict(KIT_DEFAULTS)
"""What node-policy.json holds where the project sets nothing (``federation.node_policy``)."""
_SECRET_MODE_MASK = 0o077


class KitError(RuntimeError):
    """A kit is missing a file, has a file others can read, or fails a signature check."""


def fingerprint(raw_key: bytes) -> str:
    """Short SHA-256 fingerprint of a raw public key (to compare out of band)."""
    digest = hashlib.sha256(raw_key).hexdigest()
    return ":".join(digest[i : i + 4] for i in range(0, 32, 4))


# --- roster -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RosterEntry:
    name: str
    partition_id: int
    kx_public: bytes
    sign_public: bytes
    auth_public: str

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "partition-id": self.partition_id,
            "kx-public": self.kx_public.hex(),
            "sign-public": self.sign_public.hex(),
            "auth-public": self.auth_public,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> RosterEntry:
        return cls(
            str(d["name"]), int(d["partition-id"]), bytes.fromhex(str(d["kx-public"])),
            bytes.fromhex(str(d["sign-public"])), str(d["auth-public"]),
        )


@dataclass(frozen=True)
class Roster:
    """The federation's members and the provisioner's verify key (signed by the provisioner)."""

    entries: tuple[RosterEntry, ...]
    provisioner_key: bytes
    key_id: bytes
    num_partitions: int

    def by_name(self, name: str) -> RosterEntry | None:
        return next((e for e in self.entries if e.name == name), None)

    def to_json(self) -> str:
        body = {
            "version": 1,
            "provisioner-key": self.provisioner_key.hex(),
            "key-id": self.key_id.hex(),
            "num-partitions": self.num_partitions,
            "nodes": [e.to_dict() for e in self.entries],
        }
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Roster:
        try:
            d = json.loads(text)
            return cls(
                tuple(RosterEntry.from_dict(e) for e in d["nodes"]),
                bytes.fromhex(d["provisioner-key"]), bytes.fromhex(d["key-id"]), int(d["num-partitions"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise KitError(f"roster.json is malformed: {type(exc).__name__}: {exc}") from exc


def _verify_roster(folder: Path, pinned_key: bytes) -> Roster:
    data, sig = _read(folder / "roster.json"), _read(folder / "roster.sig")
    try:
        Ed25519PublicKey.from_public_bytes(pinned_key).verify(sig, data)
    except (InvalidSignature, ValueError) as exc:
        raise KitError(f"{folder}/roster.json: signature does not verify (tampered roster?)") from exc
    roster = Roster.from_json(data)
    if roster.provisioner_key != pinned_key:
        raise KitError(f"{folder}/roster.json names another provisioner key than the pinned one")
    return roster


# --- kits -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeKit:
    path: Path
    name: str
    partition_id: int
    num_partitions: int
    roster: Roster
    policy: dict[str, object]
    tls_root: Path
    auth_private_key: Path

    def identity(self, passphrase: bytes | None = None) -> NodeKeys:
        """This node's X25519 + Ed25519 keys (checked against its roster entry)."""
        blob = _read_secret(self.path / "identity.key", passphrase)
        try:
            d = json.loads(blob)
            kx = serialization.load_pem_private_key(d["kx"].encode(), None)
            sign = serialization.load_pem_private_key(d["sign"].encode(), None)
        except (ValueError, KeyError, TypeError) as exc:
            raise KitError(f"{self.path}/identity.key is malformed: {type(exc).__name__}") from exc
        if not isinstance(kx, X25519PrivateKey) or not isinstance(sign, Ed25519PrivateKey):
            raise KitError(f"{self.path}/identity.key holds keys of the wrong type")
        keys = NodeKeys(self.name, kx, sign)
        entry = self.roster.by_name(self.name)
        pub = keys.public
        if entry is None or (pub.kx_public, pub.sign_public) != (entry.kx_public, entry.sign_public):
            raise KitError(f"{self.path}/identity.key does not match the roster entry for {self.name}")
        return keys

    def ckks_secret_bytes(self, passphrase: bytes | None = None) -> bytes:
        """The CKKS secret context envelope (``crypto.load_context`` parses it)."""
        return _read_secret(self.path / "ckks-secret.ctx", passphrase)

    def __repr__(self) -> str:
        return f"NodeKit({self.name!r}, partition {self.partition_id}/{self.num_partitions}, {self.path})"


@dataclass(frozen=True)
class ServerKit:
    path: Path
    roster: Roster
    signed_public_context: bytes
    tls_cert: Path
    tls_key: Path
    tls_root: Path
    auth_public_keys: dict[str, Path]


NODE_FILES = ("ca.crt", "supernode-auth.key", "supernode-auth.pub", "identity.key", "ckks-secret.ctx",
              "roster.json", "roster.sig", "node-policy.json", "node.json")
NODE_SECRETS = ("supernode-auth.key", "identity.key", "ckks-secret.ctx")
SERVER_FILES = ("ca.crt", "server.crt", "server.key", "ckks-public.ctx", "roster.json", "roster.sig", "server.json")
SERVER_SECRETS = ("server.key",)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KitError(f"kit file missing or unreadable: {path} ({exc.strerror})") from exc


def _read_secret(path: Path, passphrase: bytes | None) -> bytes:
    _check_files(path.parent, (path.name,), (path.name,))
    try:
        return read_secret_file(path, passphrase)
    except CryptoError as exc:  # names the file already: "<path>: key check failed: ..."
        raise KitError(str(exc)) from exc


def _check_files(folder: Path, names: Sequence[str], secrets: Sequence[str]) -> None:
    if not folder.is_dir():
        raise KitError(f"kit folder not found: {folder}")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise KitError(f"kit {folder} is missing {', '.join(missing)}")
    for n in secrets:
        mode = (folder / n).stat().st_mode & 0o777
        if mode & _SECRET_MODE_MASK:
            raise KitError(f"{folder / n} is readable by others (mode {mode:o}); chmod 600 it")


def _json(path: Path) -> dict:
    try:
        return json.loads(_read(path))
    except ValueError as exc:
        raise KitError(f"{path} is not valid JSON: {exc}") from exc


def load_node_kit(path: str | os.PathLike) -> NodeKit:
    """Check and open a node kit (files, modes, roster signature, own roster entry)."""
    folder = Path(path).resolve()
    _check_files(folder, NODE_FILES, NODE_SECRETS)
    meta = _json(folder / "node.json")
    try:
        name, pid, n = str(meta["name"]), int(meta["partition-id"]), int(meta["num-partitions"])
        pinned = bytes.fromhex(str(meta["provisioner-key"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise KitError(f"{folder}/node.json is malformed: {exc}") from exc
    roster = _verify_roster(folder, pinned)
    entry = roster.by_name(name)
    if entry is None or entry.partition_id != pid or roster.num_partitions != n:
        raise KitError(f"{folder}: node.json ({name}, partition {pid}/{n}) disagrees with the roster")
    if _auth_public_of(folder / "supernode-auth.key") != entry.auth_public:
        raise KitError(f"{folder}/supernode-auth.key is not the key the roster lists for {name}")
    policy = {**DEFAULT_POLICY, **_json(folder / "node-policy.json")}
    return NodeKit(folder, name, pid, n, roster, policy, folder / "ca.crt", folder / "supernode-auth.key")


def load_server_kit(path: str | os.PathLike) -> ServerKit:
    """Check and open the server kit (files, modes, roster and public-context signatures)."""
    from crypto import load_context, verify_public_context

    folder = Path(path).resolve()
    _check_files(folder, SERVER_FILES, SERVER_SECRETS)
    try:
        pinned = bytes.fromhex(str(_json(folder / "server.json")["provisioner-key"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise KitError(f"{folder}/server.json is malformed: {exc}") from exc
    roster = _verify_roster(folder, pinned)
    signed = _read(folder / "ckks-public.ctx")
    try:
        pub, _, _ = verify_public_context(signed, roster.provisioner_key)
        ctx = load_context(pub)
    except CryptoError as exc:
        raise KitError(f"{folder}/ckks-public.ctx: {exc}") from exc
    if ctx.is_private or ctx.key_id != roster.key_id:
        raise KitError(f"{folder}/ckks-public.ctx is not the public context the roster names")
    auth = {e.name: folder / "supernode-auth" / f"{e.name}.pub" for e in roster.entries}
    for name, pub_path in auth.items():
        if _read(pub_path).decode().strip() != roster.by_name(name).auth_public:
            raise KitError(f"{pub_path} differs from the roster's auth key for {name}")
    return ServerKit(folder, roster, signed, folder / "server.crt", folder / "server.key", folder / "ca.crt", auth)


def _auth_public_of(private_path: Path) -> str:
    try:
        key = serialization.load_ssh_private_key(_read(private_path), None)
    except (ValueError, TypeError) as exc:
        raise KitError(f"{private_path} is not an OpenSSH private key") from exc
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
