"""The parameters a node's trainer publishes for the node's other agents (a serving process),
and the coherence entry that orders the trainer's write-back against their reads.

The cache directory's store takes one process at a time (``cache/segments.py`` flocks it), and
a ClientApp holds it for a whole message; a serving process that opened it would make the
trainer's next message fail. So every write-back also writes the parameters, with their model
version, into one file beside the store, sealed with the node's cache key (AES-256-GCM from
``cryptography``; the version is bound as associated data, so a file cannot be passed off as
another version). Written atomically (temporary file, fsync, rename), mode 0600: a reader sees
the old parameters or the new ones, never a mix. Who may read when is the coherence
protocol's business (``cache.coherence``: the ``param`` entry).

No rollback: a reader that serves version v passes ``at_least=v`` and an older file (a sealed
file of an earlier version put back: it is intact and opens with the key) is refused with
``ParamRollbackError``; the reader keeps what it serves. A key that is not 32 bytes is a
``PublishedParamsError`` before any file is touched.

Who may read when (``exclusive_params``; the reader's side is ``node.serving.param_follower``): the
node's parameters are one coherence entry, ``param``, in a directory kept inside the node's
cache directory (``cache.coherence_file``). A serving agent (``node.serving.serve``) creates the
directory and holds ``param`` shared; the trainer -- a ClientApp process per message in
deployment -- takes ``param`` in M for each write-back, so in strong mode the write-back starts
only after every server has dropped its K/V and ACKed, and servers read again only after it
released. Without a serving agent there is no directory and a write-back costs nothing extra.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from safetensors.torch import load as st_load, save as st_save

from cache.coherence import Mode

FILE_NAME = "published-params.bin"
_MAGIC = b"FKVP1"
_HEAD = struct.Struct("<5sQ12s")  # magic, model version, nonce


class PublishedParamsError(ValueError):
    """The published parameters are missing, cut short, forged or sealed with another key."""


class ParamRollbackError(PublishedParamsError):
    """The published file holds an older model version than the one the reader serves."""


KEY_BYTES = 32


def _check_key(key: bytes | None) -> None:
    if key and len(key) != KEY_BYTES:
        raise PublishedParamsError(f"the cache key is {len(key)} bytes; AES-256-GCM needs {KEY_BYTES} "
                                   "(kv-cache.key truncated or foreign?)")


def path_in(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / FILE_NAME


def publish(cache_dir: str | os.PathLike, key: bytes | None, state: dict[str, torch.Tensor],
            version: int) -> Path:
    """Seal ``state`` at model ``version`` into the cache directory (replacing the last one).
    Without a key (tests, an unencrypted cache) the payload is stored unsealed but checked."""
    _check_key(key)
    blob = st_save({n: t.detach().contiguous() for n, t in state.items()})
    nonce = os.urandom(12)
    head = _HEAD.pack(_MAGIC, int(version), nonce)
    body = AESGCM(key).encrypt(nonce, blob, head) if key else blob
    path = path_in(cache_dir)
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(head + body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load(cache_dir: str | os.PathLike, key: bytes | None, *,
         at_least: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """(parameters, model version) last published in ``cache_dir``; ``ParamRollbackError`` when
    that version is below ``at_least`` (the version the reader serves)."""
    _check_key(key)
    path = path_in(cache_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PublishedParamsError(f"{path} does not exist: no write-back published yet") from None
    if len(raw) < _HEAD.size:
        raise PublishedParamsError(f"{path} is cut short ({len(raw)} bytes)")
    magic, version, nonce = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise PublishedParamsError(f"{path} is not a published-parameters file")
    body = raw[_HEAD.size :]
    if key:
        try:
            body = AESGCM(key).decrypt(nonce, body, raw[: _HEAD.size])
        except InvalidTag:
            raise PublishedParamsError(
                f"{path} does not open with this node's cache key (another key, or altered)"
            ) from None
    if at_least is not None and version < at_least:  # authentic (it opened), but older
        raise ParamRollbackError(f"{path} holds model version {version}, older than version {at_least} "
                                 "already served; refusing it (rollback)")
    try:
        return dict(st_load(body)), int(version)
    except Exception as e:  # safetensors raises its own error types for garbage
        raise PublishedParamsError(f"{path} holds no readable tensors ({type(e).__name__})") from None


# -- who may read when: the coherence entry ``param`` --------------------------------------------

COHERENCE_DIR = "coherence"
PARAM_ENTRY = "param"


def _open(where: Path, mode: Mode, timeout_s: float):
    """The directory in the mode its serving agent created it with (``mode`` first)."""
    from cache.coherence import CoherenceConfigError
    from cache.coherence_file import FileDirectory

    try:
        return FileDirectory(where, mode=mode, timeout_s=timeout_s)
    except CoherenceConfigError:
        other = Mode.RELAXED if mode == Mode.STRONG else Mode.STRONG
        return FileDirectory(where, mode=other, timeout_s=timeout_s)


def directory_of(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / COHERENCE_DIR


@contextmanager
def exclusive_params(cache_dir: str | os.PathLike | None, mode: Mode = Mode.STRONG,
                     timeout_s: float = 30.0) -> Iterator[int]:
    """Hold ``param`` in M while the body writes the parameters back (yields the number of
    other agents it had to invalidate; 0 and no directory when nobody serves)."""
    where = directory_of(cache_dir) if cache_dir else None
    if where is None or not where.exists():
        yield 0
        return
    directory = _open(where, mode, timeout_s)
    agent = directory.join("trainer")
    try:
        before = directory.stats().get("invalidations_sent", 0)
        agent.acquire_write(PARAM_ENTRY)
        try:
            yield directory.stats().get("invalidations_sent", 0) - before
        finally:
            agent.release(PARAM_ENTRY)
    finally:
        agent.leave()
