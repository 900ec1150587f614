"""Secrets at rest: node-local key files, written atomically with mode 0600, optionally sealed.

A node's secrets (identity keys, CKKS secret contexts) live in files of the node's own
directory (a provisioned kit, or the node's state directory), never in Flower's
``context.state``: in simulation every node's ``context.state`` sits in the ServerApp's process.

Sealing with a passphrase uses `cryptography`'s Scrypt (n=2**15, r=8, p=1) and AES-256-GCM;
without a passphrase the file is stored plainly and protected by its mode only (a constant
default passphrase would be no protection, so there is none).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from crypto.errors import KeyUnwrapError

__all__ = ["PASSPHRASE_ENV", "passphrase_from_env", "seal", "unseal", "write_secret_file",
           "read_secret_file", "write_public_file"]

PASSPHRASE_ENV = "FEDKV_NODE_KEY_PASSPHRASE"
"""The environment variable that holds a node's key-file passphrase (every process of the node
reads the same one: its ClientApps and its serving agent)."""


def passphrase_from_env() -> bytes | None:
    value = os.environ.get(PASSPHRASE_ENV)
    return value.encode() if value else None

_PLAIN = b"FKR\x00"
_SEALED = b"FKR\x01"
_SCRYPT_N = 2**15


def _kdf(passphrase: bytes, salt: bytes) -> bytes:
    return Scrypt(salt=salt, length=32, n=_SCRYPT_N, r=8, p=1).derive(passphrase)


def seal(data: bytes, passphrase: bytes | None) -> bytes:
    """``data`` framed for storage: AES-GCM under Scrypt(passphrase), or plain without one."""
    if not passphrase:
        return _PLAIN + bytes(data)
    salt, nonce = os.urandom(16), os.urandom(12)
    return _SEALED + salt + nonce + AESGCM(_kdf(passphrase, salt)).encrypt(nonce, bytes(data), _SEALED)


def unseal(blob: bytes, passphrase: bytes | None) -> bytes:
    """Inverse of ``seal``; KeyUnwrapError for a wrong passphrase, a missing one, or a damaged file."""
    head = bytes(blob[:4])
    if head == _PLAIN:
        return bytes(blob[4:])
    if head != _SEALED:
        raise KeyUnwrapError("not a fedkv secret file (bad magic)")
    if not passphrase:
        raise KeyUnwrapError("secret file is passphrase-sealed and no passphrase was given")
    if len(blob) < 4 + 16 + 12 + 16:
        raise KeyUnwrapError("secret file is truncated")
    salt, nonce, ct = blob[4:20], blob[20:32], blob[32:]
    try:
        return AESGCM(_kdf(passphrase, bytes(salt))).decrypt(bytes(nonce), bytes(ct), _SEALED)
    except InvalidTag as exc:
        raise KeyUnwrapError("cannot open the secret file: wrong passphrase or damaged file") from exc


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_secret_file(path: str | os.PathLike, data: bytes, passphrase: bytes | None = None) -> Path:
    """Write ``seal(data, passphrase)`` to ``path`` atomically with mode 0600."""
    path = Path(path)
    _atomic_write(path, seal(data, passphrase), 0o600)
    return path


def read_secret_file(path: str | os.PathLike, passphrase: bytes | None = None) -> bytes:
    """Read a file written by ``write_secret_file``; refuses one that others can read."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeyUnwrapError(f"secret file {path.name} is readable by others (mode {mode:o}); refusing")
    return unseal(path.read_bytes(), passphrase)


def write_public_file(path: str | os.PathLike, data: bytes) -> Path:
    """Atomic write of non-secret material (certificates, public keys), mode 0644."""
    path = Path(path)
    _atomic_write(path, bytes(data), 0o644)
    return path
