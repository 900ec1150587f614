"""Secrets at rest: node-local key files, written atomically with mode 0600, optionally sealed.

A node's secrets (identity keys, CKKS secret contexts) live in files of the node's own
directory (a provisioned kit, or the node's state directory), never in Flower's
``context.state``: in simulation every node's ``context.state`` sits in the ServerApp's process.

Sealing with a passphrase uses `cryptography`'s Scrypt (n=2**15, r=8, p=1) and AES-256-GCM;
without a passphrase the file is stored plainly and protected by its mode only (a constant
default passphrase would be no protection, so there is none).

Key check value: a plain file carries HMAC-SHA256 of its secret bytes ahead of them, verified on
every read; a file that changed since it was written (a flipped bit, a truncated copy) raises
``KeyCheckError`` naming the file instead of loading as another key (a CKKS context with a
flipped bit loads with the same key id and another MAC key: every aggregate would be rejected
without a word about the file). The HMAC key is a fixed public label, so this is an integrity
check, not an authenticity one, on purpose: the value sits in the same 0600 file as the secret
(nothing about the secret is written anywhere else), and whoever can rewrite the file (the
node's OS user) could rewrite any check value kept beside it, or read any local key it was
keyed with. A sealed file needs no extra value: AES-GCM already refuses a changed byte. Plain
files of the earlier format (``FKR\x00``, no check value) still read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from crypto.errors import KeyCheckError, KeyUnwrapError

__all__ = ["PASSPHRASE_ENV", "passphrase_from_env", "seal", "unseal", "write_secret_file",
           "read_secret_file", "write_public_file", "key_check", "KEY_CHECK_FAILED"]

PASSPHRASE_ENV = "FEDKV_NODE_KEY_PASSPHRASE"
"""The environment variable that holds a node's key-file passphrase (every process of the node
reads the same one: its ClientApps and its serving agent)."""


def passphrase_from_env() -> bytes | None:
    value = os.environ.get(PASSPHRASE_ENV)
    return value.encode() if value else None

_PLAIN = b"FKR\x00"
"""Earlier plain format (no key check value): read, never written."""
_SEALED = b"FKR\x01"
_CHECKED = b"FKR\x03"
"""Plain, with the key check value: magic, HMAC-SHA256(secret) (32 bytes), secret."""
_CHECK_LABEL = b"fedkv at-rest key check v1"
_SCRYPT_N = 2**15
KEY_CHECK_FAILED = "key check failed: the file changed since it was written"


def key_check(data: bytes) -> bytes:
    """The key check value of secret bytes: HMAC-SHA256 under a fixed public label (an
    integrity check of the bytes, see the module docstring)."""
    return hmac.new(_CHECK_LABEL, bytes(data), hashlib.sha256).digest()


def _kdf(passphrase: bytes, salt: bytes) -> bytes:
    return Scrypt(salt=salt, length=32, n=_SCRYPT_N, r=8, p=1).derive(passphrase)


def seal(data: bytes, passphrase: bytes | None) -> bytes:
    """``data`` framed for storage: AES-GCM under Scrypt(passphrase), or plain without one."""
    if not passphrase:
        return _CHECKED + key_check(data) + bytes(data)
    salt, nonce = os.urandom(16), os.urandom(12)
    return _SEALED + salt + nonce + AESGCM(_kdf(passphrase, salt)).encrypt(nonce, bytes(data), _SEALED)


def unseal(blob: bytes, passphrase: bytes | None) -> bytes:
    """Inverse of ``seal``; KeyUnwrapError for a wrong passphrase, a missing one, or a damaged file."""
    head = bytes(blob[:4])
    if head == _CHECKED:
        check, data = bytes(blob[4:36]), bytes(blob[36:])
        if len(check) < 32 or not hmac.compare_digest(check, key_check(data)):
            raise KeyCheckError(KEY_CHECK_FAILED)
        return data
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
    """Read a file written by ``write_secret_file``; refuses one that others can read. Errors
    about the file's contents name it: ``KeyCheckError`` ("<path>: key check failed: ...") for
    a file that changed since it was written, ``KeyUnwrapError`` for the rest."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeyUnwrapError(f"secret file {path.name} is readable by others (mode {mode:o}); refusing")
    try:
        return unseal(path.read_bytes(), passphrase)
    except KeyUnwrapError as exc:
        raise type(exc)(f"{path}: {exc}") from None


def write_public_file(path: str | os.PathLike, data: bytes) -> Path:
    """Atomic write of non-secret material (certificates, public keys), mode 0644."""
    path = Path(path)
    _atomic_write(path, bytes(data), 0o644)
    return path
