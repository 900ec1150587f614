"""SEAL objects <-> bytes, through scratch files: the one place ``crypto`` does SEAL file I/O.

tenseal.sealapi only (de)serializes SEAL objects through file paths, and only its
``encrypt_symmetric`` keeps the PRNG seed that halves a fresh ciphertext. So we go through scratch
files in a private (0700) temporary directory per process, on tmpfs (/dev/shm) when available,
each removed as soon as it is read. Not only ciphertexts: the raw-SEAL contexts of fedkv-2048
(``crypto.seal_keys``) pass their parameters, public key and, for a secret context, the SECRET
KEY through here (``SealKeys.serialize`` via ``seal_save``, ``load_seal_keys`` via ``seal_load``'s 0600
files). ``seal_save`` creates its file 0600 before SEAL writes into it (SEAL would create it
with the process umask, 0644 under umask 022), so every scratch file is 0600 in a 0700
directory, and lives only until it is read. The directory
is removed at normal exit (atexit); a killed process leaves it, empty unless killed mid-write.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading
from typing import Any

import tenseal.sealapi as sealapi

from crypto.errors import NotACiphertextError

__all__ = ["scratch_path", "seal_save", "seal_load", "seal_load_ciphertext"]

_io_lock = threading.Lock()
_io_dir: dict[int, str] = {}
_io_counter = itertools.count()


def _scratch_dir() -> str:
    pid = os.getpid()  # a forked worker must not share (or delete) its parent's directory
    with _io_lock:
        d = _io_dir.get(pid)
        if d is None or not os.path.isdir(d):
            base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            d = tempfile.mkdtemp(prefix="fedkv-seal-", dir=base)
            _io_dir[pid] = d
            atexit.register(_cleanup, pid, d)
        return d


def _cleanup(pid: int, d: str) -> None:
    if os.getpid() == pid:
        shutil.rmtree(d, ignore_errors=True)


def scratch_path() -> str:
    """A fresh file name in this process's private scratch directory (the caller removes the file)."""
    return os.path.join(_scratch_dir(), f"{threading.get_ident()}-{next(_io_counter)}")


def seal_save(obj: Any) -> bytes:
    """Bytes of a SEAL object (ciphertext, Serializable ciphertext, parameters, public or secret key)
    in SEAL's own compressed format."""
    path = scratch_path()
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # SEAL truncates, keeps the mode
        obj.save(path)
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def seal_load_ciphertext(seal_ctx: Any, data: bytes) -> sealapi.Ciphertext:
    """Load and validate a ciphertext against `seal_ctx`; NotACiphertextError otherwise.

    SEAL's `load` checks header, sizes, parameter ids and that every coefficient is reduced
    modulo its prime, so truncated, random and foreign-parameter bytes fail here.
    """
    path = scratch_path()
    try:
        with open(path, "wb") as fh:
            fh.write(data)
        ct = sealapi.Ciphertext()
        ct.load(seal_ctx, path)
        return ct
    except Exception as exc:  # pybind maps SEAL's C++ exceptions to several Python types
        raise NotACiphertextError(f"not a ciphertext of this context: {exc}") from exc
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def seal_load(obj: Any, blob: bytes, *ctx: Any) -> None:
    """Load ``blob`` into the SEAL object ``obj`` (``obj.load(*ctx, path)``) through a 0600 scratch
    file, removed after. Raises whatever SEAL raises; the caller maps it to its own error."""
    path = scratch_path()
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
        fh.write(blob)
    try:
        obj.load(*ctx, path)
    finally:
        os.unlink(path)
