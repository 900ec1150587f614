"""A node's own directory: its identity keys and CKKS secret contexts, never ``context.state``.

Why a directory: in simulation every node's ``context.state`` lives in the process that runs the
ServerApp (docs/flower-notes.md), so a secret kept there, or a key that unwraps one, is a secret
in the server's process. Node secrets therefore live in files only the node's processes open:

* deployment: the node's provisioned kit (``--node-config "kit-dir='...'"``, see
  ``federation.kit``) holds its identity keys, the epoch-0 CKKS secret context and the pinned
  roster; what a run adds (rotated keys) goes to ``<kit>/state/run-<run id>/``;
* simulation: node config ``node-dir``, else ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``, then
  ``/run-<run id>/node-<node id>/``, made on first contact (identity keys, then the CKKS contexts
  the node receives or makes). ``federation.local.InProcessGrid`` gives its nodes a private
  temporary ``node-dir``, so in-process runs never meet each other's files. The node that makes
  a new ``run-<run id>`` prunes the root to the newest ``$FEDKV_KEEP_RUNS`` runs (default 3,
  0 = keep all; never its own run); ``python -m federation.clean`` lists and removes runs.

Files are written by ``crypto.at_rest`` (atomic, mode 0600), sealed with
``$FEDKV_NODE_KEY_PASSPHRASE`` when it is set. ``context.state`` keeps nothing secret.

The directory also keeps the node's signed replies to the tagged requests (train, noise share),
one per round and kind (``answer_once``): a request repeated for a round gets the byte-identical
reply, never a second MAC tag (``crypto.binding``, issue 20).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from crypto import (
    CkksContext, NodeKeys, load_context, passphrase_from_env, read_secret_file, seal,
    write_public_file, write_secret_file,
)
from crypto.errors import CryptoError
from federation import clean

if TYPE_CHECKING:
    from federation.kit import NodeKit

NODE_DIR_ENV = clean.NODE_DIR_ENV
_log = logging.getLogger("fedkv.node_store")

_CONTEXTS: OrderedDict[tuple[str, int], CkksContext] = OrderedDict()
"""Per-process cache of loaded secret contexts (loading costs ~6 ms); gone with the process."""
_KITS: dict[str, Any] = {}


class ProvisioningError(RuntimeError):
    """A node cannot take part: it refused provisioning or lacks its keys."""


class RepeatedRequest(RuntimeError):
    """A tagged request for a round this node no longer answers (it answered a later one)."""


ANSWER_ROUNDS_KEPT = 2
"""Rounds whose replies a node keeps (the newest answered and the one before); a request for an
older round that has no kept reply is refused, so dropping a reply never re-opens its round."""
_ANSWER = re.compile(r"answer-(\d{1,19})-(\d{1,3})\.bin")


@dataclass
class AnswerSlot:
    """One (round, kind) of ``NodeStore.answer_once``: the reply kept from an earlier request, or
    None until the handler ``keep``s the one it makes."""

    store: NodeStore
    round: int
    kind: int
    stored: bytes | None

    def keep(self, reply: bytes) -> None:
        """Keep ``reply`` (atomically, fsync'ed, mode 0600) before it leaves the node; drop the
        kept replies of rounds older than ``ANSWER_ROUNDS_KEPT``."""
        if self.stored is not None:
            raise RepeatedRequest("this request was answered already")
        write_secret_file(self.store._answer_path(self.round, self.kind), bytes(reply))
        self.stored = bytes(reply)
        for rnd, _, path in self.store._answers():
            if rnd <= self.round - ANSWER_ROUNDS_KEPT:
                path.unlink(missing_ok=True)


def _kit(path: str) -> NodeKit:
    from federation.kit import load_node_kit

    kit = _KITS.get(path)
    if kit is None:
        kit = _KITS[path] = load_node_kit(Path(path))
    return kit


def _new_run(base: Path, run: str) -> None:
    """Make ``base/run``; the one process that makes it (many nodes of a run race here) prunes
    older runs under ``base`` (retention, ``federation.clean.prune``). Pruning never fails the
    node: what it cannot remove stays, with a warning."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        (base / run).mkdir(mode=0o700)
    except FileExistsError:
        return
    try:
        report = clean.prune(base, clean.keep_from_env(), current=run)
    except (OSError, clean.CleanError) as err:
        _log.warning("node-dir retention skipped under %s: %s", base, err)
        return
    if report.removed:
        _log.info("node-dir retention: removed %s (%d bytes) under %s",
                  ", ".join(n for n, _ in report.removed), report.freed, base)


class NodeStore:
    """Identity keys and CKKS contexts (by key epoch) of one node in one run."""

    def __init__(self, root: Path, node_id: str, kit: NodeKit | None = None) -> None:
        self.root = Path(root)
        self.node_id = node_id
        self.kit = kit

    @classmethod
    def for_context(cls, context: Any) -> NodeStore:
        node_id, run = str(context.node_id), f"run-{context.run_id}"
        kit_dir = str(context.node_config.get("kit-dir", "") or "")
        if kit_dir:
            return cls(Path(kit_dir) / "state" / run, node_id, _kit(kit_dir))
        node_dir = str(context.node_config.get("node-dir", "") or "")
        base = Path(node_dir) if node_dir else clean.default_node_root()
        if not (base / run).is_dir():
            _new_run(base, run)
        return cls(base / run / f"node-{node_id}", node_id, None)

    @property
    def name(self) -> str:
        """The kit's name of this node ("" without a kit)."""
        return self.kit.name if self.kit is not None else ""

    # -- identity ---------------------------------------------------------------------------
    def identity(self, *, create: bool = False) -> NodeKeys:
        if self.kit is not None:
            return self.kit.identity(passphrase_from_env()).renamed(self.node_id)
        path = self.root / "identity.key"
        if not path.exists():
            if not create:
                raise ProvisioningError("node has no keys: it was not enrolled in this run")
            keys = NodeKeys.generate(self.node_id)
            write_secret_file(path, keys.private_pem(), passphrase_from_env())
            return keys
        keys = NodeKeys.from_private_pem(read_secret_file(path, passphrase_from_env()))
        if keys.node_id != self.node_id:
            raise ProvisioningError("stored keys belong to another node")
        return keys

    # -- CKKS contexts ----------------------------------------------------------------------
    def held(self) -> tuple[int, bytes] | None:
        """(newest key epoch, key id) this node holds, or None."""
        path = self.root / "held.json"
        if path.exists():
            rec = json.loads(path.read_text())
            return int(rec["epoch"]), bytes.fromhex(rec["key-id"])
        if self.kit is not None:
            return 0, self.kit.roster.key_id
        return None

    def save_context(self, ctx: CkksContext, epoch: int) -> None:
        if not ctx.is_private:
            raise ProvisioningError("a node stores secret contexts only")
        write_secret_file(self.root / f"ckks-{epoch}.ctx", ctx.secret_bytes(), passphrase_from_env())
        current = self.held()
        if current is None or epoch >= current[0]:
            write_public_file(self.root / "held.json", json.dumps({"epoch": epoch, "key-id": ctx.key_id.hex()}).encode())
        _CONTEXTS[(str(self.root), epoch)] = ctx  # replaces a key this node made but nobody took

    def context(self, epoch: int) -> CkksContext:
        """The secret context of ``epoch``; ProvisioningError when the node does not hold it."""
        cached = _CONTEXTS.get((str(self.root), epoch))
        if cached is not None:
            return cached
        path = self.root / f"ckks-{epoch}.ctx"
        try:
            if path.exists():
                data = read_secret_file(path, passphrase_from_env())
            elif self.kit is not None and epoch == 0:
                data = self.kit.ckks_secret_bytes(passphrase_from_env())
            else:
                raise ProvisioningError("node holds no CKKS key of the requested epoch")
            ctx = load_context(data)
        except CryptoError as err:
            raise ProvisioningError(f"cannot load the node's CKKS key: {type(err).__name__}") from err
        _CONTEXTS[(str(self.root), epoch)] = ctx
        while len(_CONTEXTS) > 64:
            _CONTEXTS.popitem(last=False)
        return ctx

    def epochs(self) -> list[int]:
        """Every key epoch this node holds, oldest first."""
        found = {int(p.stem.split("-", 1)[1]) for p in self.root.glob("ckks-*.ctx")}
        if self.kit is not None:
            found.add(0)
        return sorted(found)

    # -- the node's model -------------------------------------------------------------------
    def save_params(self, generation: int, params: np.ndarray) -> None:
        """Parameters of ``generation`` (keeps the previous one: it may still be the committed one)."""
        buf = io.BytesIO()
        np.save(buf, np.asarray(params), allow_pickle=False)
        write_secret_file(self.root / f"params-{generation}.npy", buf.getvalue())
        for old in self.root.glob("params-*.npy"):
            if int(old.stem.split("-")[1]) < generation - 1:
                old.unlink(missing_ok=True)

    def load_params(self, generation: int) -> np.ndarray:
        path = self.root / f"params-{generation}.npy"
        if not path.exists():
            raise ProvisioningError("the node's parameter file for its committed state is missing")
        return np.load(io.BytesIO(read_secret_file(path)), allow_pickle=False)

    def save_residual(self, residual: np.ndarray) -> None:
        """The error-feedback residual of the node's last update (private: a function of it).

        Framed and mode 0600 like the parameter files, replaced atomically but not fsync'ed: a
        residual lost in a crash costs at most a step of accuracy once, while the fsync cost
        ~8 ms of every lm round."""
        buf = io.BytesIO()
        np.save(buf, np.asarray(residual, dtype=np.float32), allow_pickle=False)  # half the bytes; error << a step
        path = self.root / "residual.npy"
        fd, tmp = tempfile.mkstemp(prefix=".residual.", dir=self.root)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(seal(buf.getvalue(), None))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_residual(self, dim: int) -> np.ndarray:
        """The residual saved last, or zeros: none yet, one for another model size, or a file that
        does not read back (torn by a crash: it was not fsync'ed). A lost residual costs at most a
        step of accuracy once; refusing to train would cost the node's round."""
        path = self.root / "residual.npy"
        try:
            arr = np.load(io.BytesIO(read_secret_file(path)), allow_pickle=False)
        except (OSError, ValueError, EOFError, CryptoError):
            return np.zeros(dim, dtype=np.float64)
        if arr.shape == (dim,) and np.issubdtype(arr.dtype, np.floating) and np.isfinite(arr).all():
            return arr.astype(np.float64)
        return np.zeros(dim, dtype=np.float64)

    # -- adaptive clipping ------------------------------------------------------------------
    def save_clip_norms(self, norms: list[float]) -> None:
        """The adaptive clip norm at every global version so far (``norms[v]`` clips the updates
        made at version v). Derived from decrypted aggregates, so kept like them (0600, sealed)
        and never sent to the server; the whole history, so a node restored to an older
        version (a crash before its state was saved) still finds that version's norm."""
        if not norms or not all(np.isfinite(norms)) or min(norms) <= 0:
            raise ValueError("clip norms must be a non-empty list of finite values > 0")
        write_secret_file(self.root / "clip-norms.json", json.dumps([float(c) for c in norms]).encode(),
                          passphrase_from_env())

    def load_clip_norms(self) -> list[float]:
        """The saved history, or [] when none was saved yet."""
        path = self.root / "clip-norms.json"
        if not path.exists():
            return []
        try:
            norms = json.loads(read_secret_file(path, passphrase_from_env()))
        except (ValueError, CryptoError) as err:
            raise ProvisioningError(f"the node's clip-norm history does not read back: {err}") from None
        if not (isinstance(norms, list) and norms and all(isinstance(c, float) and 0 < c < float("inf") for c in norms)):
            raise ProvisioningError("the node's clip-norm history is malformed")
        return norms

    # -- one answer per round and kind (issue 20) -------------------------------------------
    @contextmanager
    def answer_once(self, rnd: int, kind: int) -> Iterator[AnswerSlot]:
        """Answer the tagged request of (this run, ``rnd``, ``kind``) at most once.

        Yields an ``AnswerSlot``: ``stored`` is the reply kept from an earlier request (send it
        again, byte for byte), or None: make the reply and ``keep`` it before it is sent. A
        request for a round older than the newest this node answered (any kind), with no kept
        reply, raises ``RepeatedRequest``: an honest server asks each round once and in order.
        The key epoch is not part of the key: a round is answered once whatever the epoch.

        Holds an exclusive lock on the node's ``answers.lock`` meanwhile, so two processes given
        the same request at once cannot both answer it. A node that crashed before ``keep`` sent
        nothing, so the retry is answered (once) then; one that crashed after it sends the kept
        reply.
        """
        if rnd < 0 or kind < 0:
            raise ValueError("round and kind are non-negative")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.root / "answers.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = self._answer_path(rnd, kind)
            if path.exists():
                try:
                    stored: bytes | None = read_secret_file(path)
                except (OSError, CryptoError) as err:  # refuse rather than answer twice
                    raise RepeatedRequest(f"round {rnd}: the kept reply does not read back ({err})") from None
            else:
                newest = max((r for r, _, _ in self._answers()), default=-1)
                if rnd < newest:
                    raise RepeatedRequest(f"request for round {rnd} refused: this node answered round {newest}, "
                                          "and answers each round once and in order")
                stored = None
            yield AnswerSlot(self, rnd, kind, stored)
        finally:
            os.close(fd)  # releases the lock

    def _answer_path(self, rnd: int, kind: int) -> Path:
        return self.root / f"answer-{rnd}-{kind}.bin"

    def _answers(self) -> list[tuple[int, int, Path]]:
        """(round, kind, path) of every kept reply."""
        out = []
        for path in self.root.glob("answer-*.bin"):
            m = _ANSWER.fullmatch(path.name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), path))
        return out

    # -- the node's KV cache ----------------------------------------------------------------
    def cache_dir(self, override: str = "") -> Path:
        """Where the node's KV cache persists (node-config ``cache-dir``, else beside its
        other node-local files)."""
        return Path(override) if override else self.root / "kv-cache"

    def cache_key(self, cache_dir: Path | None = None) -> bytes:
        """The node's AES-256-GCM key for its cache at rest (made once, from
        ``cryptography``; kept 0600 and sealed like the node's other secrets), in
        ``kv-cache.key`` beside the cache directory: a cache kept across runs keeps its key,
        and the node's serving agent (``python -m node.serve``) finds it there."""
        path = (Path(cache_dir).parent if cache_dir else self.root) / "kv-cache.key"
        if path.exists():
            return read_secret_file(path, passphrase_from_env())
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        key = AESGCM.generate_key(bit_length=256)
        write_secret_file(path, key, passphrase_from_env())
        return key

    # -- trust on first use (simulation only) ----------------------------------------------
    def pinned(self, node_id: str, sign_public: bytes, kx_public: bytes | None = None) -> bool:
        """Pin a peer's keys on first use; False if they differ from what was pinned before."""
        path = self.root / "pins.json"
        pins = json.loads(path.read_text()) if path.exists() else {}
        known = pins.get(node_id)
        kx = kx_public.hex() if kx_public is not None else None
        if known is not None:
            if known["sign"] != sign_public.hex() or (kx and known.get("kx") and known["kx"] != kx):
                return False
            if not kx or known.get("kx"):
                return True
        pins[node_id] = {"sign": sign_public.hex(), "kx": kx or (known or {}).get("kx")}
        write_public_file(path, json.dumps(pins).encode())
        return True
