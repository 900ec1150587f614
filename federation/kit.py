"""Startup kits: one folder per party, holding only what that party may know (NVFlare-style).

``write_kits(out, n)`` plays the provisioner once, offline, and writes::

    out/server/   ca.crt  server.crt  server.key(0600)  ckks-public.ctx  roster.json  roster.sig
                  server.json  supernode-auth/node-<i>.pub
    out/node-<i>/ ca.crt  supernode-auth.key(0600)  supernode-auth.pub  identity.key(0600)
                  ckks-secret.ctx(0600)  roster.json  roster.sig  node-policy.json  node.json

Trust: the provisioner's Ed25519 key signs ``roster.json`` (``roster.sig``, over the exact file
bytes) and the CKKS public context (``crypto.Dealer.signed_public_context`` format). Its raw
verify key is pinned in ``node.json`` / ``server.json``; compare its fingerprint out of band
(``python -m federation.provision`` prints it). The provisioner's signing key and the TLS CA's
private key are discarded after provisioning: no kit holds them, so adding a node means
provisioning a new federation.

Secrets: ``identity.key`` and ``ckks-secret.ctx`` go through ``crypto.at_rest.write_secret_file``
(mode 0600, sealed with the passphrase when one is given; without one each carries the key check
value the provisioner computed when it made the kit, so a changed byte is a ``KitError`` naming
the file: "<path>: key check failed: the file changed since it was written"). ``server.key`` (TLS) and
``supernode-auth.key`` must stay in the plain formats Flower reads (PEM / OpenSSH), so they are
written raw with mode 0600. The server kit holds the CKKS *public* context only.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.x509.oid import NameOID

from crypto import Dealer, NodeKeys
from crypto.at_rest import read_secret_file, write_public_file, write_secret_file
from crypto.errors import CryptoError

__all__ = [
    "KitError",
    "RosterEntry",
    "Roster",
    "NodeKit",
    "ServerKit",
    "DEFAULT_POLICY",
    "write_kits",
    "load_node_kit",
    "load_server_kit",
    "fingerprint",
]

DEFAULT_POLICY: dict[str, object] = {"require-he": True, "min-noise-multiplier": 0.0}
_SECRET_MODE_MASK = 0o077
_CERT_DAYS = 365


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


# --- writing ----------------------------------------------------------------------------------


def _write_private_raw(path: Path, data: bytes) -> None:
    """A private key in the plain format another program reads (Flower): new file, mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _auth_public_of(private_path: Path) -> str:
    try:
        key = serialization.load_ssh_private_key(_read(private_path), None)
    except (ValueError, TypeError) as exc:
        raise KitError(f"{private_path} is not an OpenSSH private key") from exc
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def make_auth_key() -> tuple[bytes, str]:
    """A SuperNode auth key pair (EC P-384): (OpenSSH private key bytes, OpenSSH public text)."""
    key = ec.generate_private_key(ec.SECP384R1())
    priv = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return priv, pub.decode()


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_tls(hosts: Sequence[str], ca_name: str = "fedkv provisioner CA") -> tuple[bytes, bytes, bytes]:
    """A fresh CA and a server certificate for ``hosts``: (ca.crt, server.crt, server.key) PEM.

    The CA's private key is dropped on return: nobody can issue further certificates."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name(hosts[0] if hosts else "fedkv-superlink"))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_CERT_DAYS))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


@dataclass
class _NodeSecrets:
    name: str
    kx: X25519PrivateKey
    sign: Ed25519PrivateKey
    auth_private: bytes
    entry: RosterEntry

    def identity_blob(self) -> bytes:
        """What identity.key holds (before sealing): both private keys, PKCS#8 PEM."""
        pem, pkcs8, plain = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        return json.dumps({
            "name": self.name,
            "kx": self.kx.private_bytes(pem, pkcs8, plain).decode(),
            "sign": self.sign.private_bytes(pem, pkcs8, plain).decode(),
        }).encode()


def _make_node(i: int) -> _NodeSecrets:
    name = f"node-{i}"
    kx, sign = X25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pub = NodeKeys(name, kx, sign).public
    auth_priv, auth_pub = make_auth_key()
    return _NodeSecrets(name, kx, sign, auth_priv, RosterEntry(name, i, pub.kx_public, pub.sign_public, auth_pub))


def _write_roster(folder: Path, roster_json: bytes, sig: bytes) -> None:
    write_public_file(folder / "roster.json", roster_json)
    write_public_file(folder / "roster.sig", sig)


def _write_server(folder: Path, tls: tuple[bytes, bytes, bytes], signed_pub: bytes,
                  roster_json: bytes, sig: bytes, nodes: Sequence[_NodeSecrets], pinned: bytes) -> None:
    ca, cert, key = tls
    write_public_file(folder / "ca.crt", ca)
    write_public_file(folder / "server.crt", cert)
    _write_private_raw(folder / "server.key", key)
    write_public_file(folder / "ckks-public.ctx", signed_pub)
    _write_roster(folder, roster_json, sig)
    write_public_file(folder / "server.json", json.dumps({"provisioner-key": pinned.hex()}, indent=2).encode())
    for n in nodes:
        write_public_file(folder / "supernode-auth" / f"{n.name}.pub", (n.entry.auth_public + "\n").encode())


def _write_node(folder: Path, node: _NodeSecrets, num_nodes: int, ca: bytes, secret_ctx: bytes,
                roster_json: bytes, sig: bytes, policy: Mapping, pinned: bytes, passphrase: bytes | None) -> None:
    write_public_file(folder / "ca.crt", ca)
    _write_private_raw(folder / "supernode-auth.key", node.auth_private)
    write_public_file(folder / "supernode-auth.pub", (node.entry.auth_public + "\n").encode())
    write_secret_file(folder / "identity.key", node.identity_blob(), passphrase)
    write_secret_file(folder / "ckks-secret.ctx", secret_ctx, passphrase)
    _write_roster(folder, roster_json, sig)
    write_public_file(folder / "node-policy.json", json.dumps(dict(policy), indent=2, sort_keys=True).encode())
    meta = {"name": node.name, "partition-id": node.entry.partition_id, "num-partitions": num_nodes,
            "provisioner-key": pinned.hex()}
    write_public_file(folder / "node.json", json.dumps(meta, indent=2).encode())


def write_kits(out: Path, num_nodes: int, *, preset: str = "fedkv-4096", passphrase: bytes | None = None,
               hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1"),
               policy: Mapping | None = None) -> dict[str, Path]:
    """Provision a federation of ``num_nodes`` nodes into ``out``; returns {kit name: folder}.

    ``out`` must not hold kits already (a second provisioning would mix two trust roots)."""
    if num_nodes < 1:
        raise ValueError("num_nodes must be >= 1")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise KitError(f"{out} is not empty; provision into a fresh folder")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    signer = Ed25519PrivateKey.generate()  # the provisioner's key: lives only in this call
    dealer = Dealer(preset, signing_key=signer)
    pinned = dealer.verify_key
    nodes = [_make_node(i) for i in range(num_nodes)]
    roster = Roster(tuple(n.entry for n in nodes), pinned, dealer.key_id, num_nodes)
    roster_json = roster.to_json().encode()
    sig = signer.sign(roster_json)
    tls = make_tls(hosts)
    secret_ctx = dealer.context.secret_bytes()
    node_policy = {**DEFAULT_POLICY, **(policy or {})}
    kits = {"server": out / "server"}
    _write_server(kits["server"], tls, dealer.signed_public_context(), roster_json, sig, nodes, pinned)
    for n in nodes:
        kits[n.name] = out / n.name
        _write_node(kits[n.name], n, num_nodes, tls[0], secret_ctx, roster_json, sig, node_policy, pinned, passphrase)
    return kits
