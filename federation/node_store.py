"""A node's own directory: its identity keys and CKKS secret contexts, never ``context.state``.

Why a directory: in simulation every node's ``context.state`` lives in the process that runs the
ServerApp (docs/deployment.md, "What a node keeps"), so a secret kept there, or a key that
unwraps one, is a secret in the server's process. Node secrets therefore live in files only the node's processes open:

* deployment: the node's provisioned kit (``--node-config "kit-dir='...'"``, see
  ``federation.startup_kit``) holds its identity keys, the epoch-0 CKKS secret context and the pinned
  roster; what a run adds (rotated keys) goes to ``<kit>/state/run-<run id>/``;
* simulation: node config ``node-dir``, else ``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``, then
  ``/run-<run id>/node-<node id>/``, made on first contact (identity keys, then the CKKS contexts
  the node receives or makes); the identity and the member set pinned across runs live in
  ``/enrolled/n<N>-p<P>/`` (``federation.enrollment``). ``federation.local.InProcessGrid`` gives
  its nodes a private temporary ``node-dir``, so in-process runs never meet each other's files. The node that makes
  a new ``run-<run id>`` prunes the root to the newest ``$FEDKV_KEEP_RUNS`` completed runs and
  as many others (default 3, 0 = keep all; never its own run, a pinned run or one in use:
  ``federation.run_retention``); ``python -m federation.deploy.clean`` lists, pins and removes runs.
  A node process holds a lease (``node.serving.dir_lease``) on each run directory it works in for as long
  as it lives, so a run in progress is never removed, and marks the run ``COMPLETED`` once it
  has evaluated the last round (``mark_completed``).

Files are written by ``crypto.at_rest`` (atomic, mode 0600), sealed with
``$FEDKV_NODE_KEY_PASSPHRASE`` when it is set. ``context.state`` keeps nothing secret.

The directory also keeps the node's signed replies to the tagged requests (train, noise share),
one per round and kind (``answer_once``): a request repeated for a round gets the byte-identical
reply, never a second MAC tag (``crypto.binding``, issue 20). Beside them, ``applied.json``
(``federation.applied_log``): the round and key epoch of the aggregate that made each model
version, so a replayed aggregate is refused across restarts too (issue 30).

Damaged files fail loudly, naming the file: a secret file carries a key check value
(``crypto.at_rest``: "<path>: key check failed: the file changed since it was written"), a CKKS
context must have the key id that ``held.json`` (or the kit's roster) names, ``kv-cache.key``
must hold 32 bytes, and a ``held.json`` or ``pins.json`` that is not the record this module
wrote is a ``NodeFileError`` ("<path>: ..."), never a bare ``KeyError`` or ``JSONDecodeError``.
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from crypto import (
    CkksContext, NodeKeys, load_context, passphrase_from_env, read_secret_file, seal,
    write_public_file, write_secret_file,
)
from crypto.errors import CryptoError, KeyUnwrapError
from federation import run_retention
from federation.enrollment import Enrollment, EnrollmentError, Refused
from node.serving import dir_lease

if TYPE_CHECKING:
    from federation.startup_kit import NodeKit

NODE_DIR_ENV = run_retention.NODE_DIR_ENV
_log = logging.getLogger("fedkv.node_store")

_RUN_LEASES: dict[str, dir_lease.Lease] = {}
"""This process's lease on each run directory it worked in (kept until the process exits)."""
_RUN_LEASES_LOCK = threading.Lock()
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


class NodeFileError(ProvisioningError):
    """A node-local file (a secret, ``held.json``, ``pins.json``) is damaged: the message names it."""


class PeerKeyError(ProvisioningError):
    """A peer's identity keys are not the pinned ones: nothing is wrapped for them."""


class MemberSetError(ProvisioningError):
    """A keygen/provision request lists a member set the node's pinned one does not allow."""


CACHE_KEY_BYTES = 32
"""``kv-cache.key``: an AES-256-GCM key."""
KEY_ID_BYTES = 16
PINS_VERSION = 2


@dataclass(frozen=True)
class Peer:
    """A member of the key group as a keygen/provision request lists it (simulation)."""

    node_id: str
    partition: int
    sign_public: bytes
    kx_public: bytes


def _read_json(path: Path) -> Any:
    """A JSON record this module wrote; ``NodeFileError`` naming the file for anything else."""
    try:
        return json.loads(path.read_bytes())
    except OSError as err:
        raise NodeFileError(f"{path}: cannot be read ({err.strerror})") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise NodeFileError(f"{path}: not valid JSON (truncated or damaged): {err}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hex_bytes(value: Any, size: int) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected a hex string, got {type(value).__name__}")
    raw = bytes.fromhex(value)
    if len(raw) != size:
        raise ValueError(f"expected {size} bytes in hex, got {len(raw)}")
    return raw


def _kit(path: str) -> NodeKit:
    from federation.startup_kit import load_node_kit

    kit = _KITS.get(path)
    if kit is None:
        kit = _KITS[path] = load_node_kit(Path(path))
    return kit


def _new_run(base: Path, run: str) -> None:
    """Make ``base/run``; the one process that makes it (many nodes of a run race here) prunes
    older runs under ``base`` (retention, ``federation.run_retention.prune``). Pruning never fails the
    node: what it cannot remove stays, with a warning."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        (base / run).mkdir(mode=0o700)
    except FileExistsError:
        return
    _hold_run(base / run)  # before pruning: another node's retention must not take it meanwhile
    try:
        report = run_retention.prune(base, run_retention.keep_from_env(), current=run)
    except (OSError, run_retention.CleanError) as err:
        _log.warning("node-dir retention skipped under %s: %s", base, err)
        return
    for name, size in report.removed:
        _log.info("node-dir retention: removed %s (%s, %d bytes)", base / name, run_retention.human(size), size)
    for line in run_retention.kept_lines(report):
        _log.info("node-dir retention under %s: %s", base, line)


def _hold_run(run_dir: Path) -> None:
    """Hold this process's lease on ``run_dir`` (once per process and run; a run directory
    that exists no more has its lease dropped, so a long-lived process does not pile up fds)."""
    key = str(run_dir)
    with _RUN_LEASES_LOCK:
        held = _RUN_LEASES.get(key)
        if held is not None and held.path.exists():
            return
        for other, lease in list(_RUN_LEASES.items()):
            if not lease.path.exists():
                lease.release()
                del _RUN_LEASES[other]
        try:
            _RUN_LEASES[key] = dir_lease.take(run_dir, "flower.node")
        except OSError as err:  # the node works on; retention falls back on its last write
            _log.warning("no lease on %s: %s", run_dir, err)


class NodeStore:
    """Identity keys and CKKS contexts (by key epoch) of one node in one run."""

    def __init__(self, root: Path, node_id: str, kit: NodeKit | None = None,
                 enrollment: Enrollment | None = None) -> None:
        self.root = Path(root)
        self.node_id = node_id
        self.kit = kit
        self.enrollment = enrollment
        """Without a kit: the node's identity and pins across runs (``federation.enrollment``)."""

    @classmethod
    def for_context(cls, context: Any) -> NodeStore:
        node_id, run = str(context.node_id), f"run-{context.run_id}"
        kit_dir = str(context.node_config.get("kit-dir", "") or "")
        if kit_dir:
            state = Path(kit_dir) / "state" / run
            if state.is_dir():
                _hold_run(state)
            return cls(state, node_id, _kit(kit_dir))
        node_dir = str(context.node_config.get("node-dir", "") or "")
        base = Path(node_dir) if node_dir else run_retention.default_node_root()
        if not (base / run).is_dir():
            _new_run(base, run)
        _hold_run(base / run)
        return cls(base / run / f"node-{node_id}", node_id, None, Enrollment.of(base, context.node_config))

    @property
    def run_dir(self) -> Path:
        """The run's directory: ``<kit>/state/run-<id>``, or ``<root>/run-<id>`` above the node's."""
        return self.root if self.kit is not None else self.root.parent

    def mark_completed(self) -> None:
        """Mark the run completed (``federation.run_retention.COMPLETED``): retention counts it
        among the completed runs, which failed attempts never push out. Idempotent."""
        marker = self.run_dir / run_retention.COMPLETED
        if not marker.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_public_file(marker, f"completed: node {self.node_id} evaluated the last round\n".encode())

    @property
    def adapters_dir(self) -> Path:
        """Where the node keeps its run's final adapters (``node.serving.adapters``): ``adapters/run-<id>/
        node-<id>`` beside the run directories, which retention never touches (it removes
        ``run-<digits>`` entries only), so the fine-tuned model outlives its run's state."""
        return self.run_dir.parent / "adapters" / self.run_dir.name / f"node-{self.node_id}"

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
            try:
                keys = self.enrollment.identity(self.node_id) if self.enrollment else NodeKeys.generate(self.node_id)
            except EnrollmentError as err:
                raise NodeFileError(str(err)) from None
            write_secret_file(path, keys.private_pem(), passphrase_from_env())
            return keys
        try:
            data = read_secret_file(path, passphrase_from_env())
        except KeyUnwrapError as err:  # names the file
            raise NodeFileError(f"cannot load the node's identity keys: {err}") from None
        try:
            keys = NodeKeys.from_private_pem(data)
        except KeyUnwrapError as err:
            raise NodeFileError(f"{path}: {err}") from None
        if keys.node_id != self.node_id:
            raise ProvisioningError("stored keys belong to another node")
        return keys

    # -- CKKS contexts ----------------------------------------------------------------------
    def held(self) -> tuple[int, bytes] | None:
        """(newest key epoch, key id) this node holds, or None."""
        path = self.root / "held.json"
        if path.exists():
            rec = _read_json(path)
            try:
                epoch, key_id = rec["epoch"], _hex_bytes(rec["key-id"], KEY_ID_BYTES)
                if not _is_int(epoch) or epoch < 0:
                    raise ValueError(f"epoch {str(epoch)[:20]!r} is not an int >= 0")
            except (KeyError, TypeError, ValueError) as err:
                raise NodeFileError(f"{path}: malformed ({type(err).__name__}: {err}); expected "
                                    '{"epoch": int >= 0, "key-id": 16 bytes in hex}') from None
            return epoch, key_id
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
        from federation.startup_kit import KitError

        path = self.root / f"ckks-{epoch}.ctx"
        try:
            if path.exists():
                data = read_secret_file(path, passphrase_from_env())
            elif self.kit is not None and epoch == 0:
                path = self.kit.path / "ckks-secret.ctx"
                data = self.kit.ckks_secret_bytes(passphrase_from_env())
            else:
                raise ProvisioningError("node holds no CKKS key of the requested epoch")
        except (KeyUnwrapError, KitError) as err:  # these name the file
            raise NodeFileError(f"cannot load the node's CKKS key: {err}") from err
        try:
            ctx = load_context(data)
        except CryptoError as err:
            raise NodeFileError(f"cannot load the node's CKKS key from {path}: {type(err).__name__}") from err
        self._check_key_id(path, epoch, ctx.key_id)
        _CONTEXTS[(str(self.root), epoch)] = ctx
        while len(_CONTEXTS) > 64:
            _CONTEXTS.popitem(last=False)
        return ctx

    def _check_key_id(self, path: Path, epoch: int, key_id: bytes) -> None:
        """The context of the newest epoch must have the key id its record names (``held.json``,
        or the signed roster for a kit's epoch 0): an intact file of another key is no better
        than a damaged one."""
        if self.kit is not None and path == self.kit.path / "ckks-secret.ctx":
            expected, record = self.kit.roster.key_id, self.kit.path / "roster.json"
        else:
            held = self.held()
            if held is None or held[0] != epoch:
                return
            expected, record = held[1], self.root / "held.json"
        if key_id != expected:
            raise NodeFileError(f"{path}: holds the key id {key_id.hex()}, but {record} names "
                                f"{expected.hex()} for key epoch {epoch}; refusing it")

    def epochs(self) -> list[int]:
        """Every key epoch this node holds, oldest first."""
        found = {int(p.stem.split("-", 1)[1]) for p in self.root.glob("ckks-*.ctx")}
        if self.kit is not None:
            found.add(0)
        return sorted(found)

    # -- the node's update residual ----------------------------------------------------------
    def save_residual(self, residual: np.ndarray) -> None:
        """The error-feedback residual of the node's last update (private: a function of it).

        Framed and mode 0600 like the node's other secrets, replaced atomically but not fsync'ed: a
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
        and the node's serving agent (``python -m node.serving.serve``) finds it there."""
        path = (Path(cache_dir).parent if cache_dir else self.root) / "kv-cache.key"
        if path.exists():
            try:
                key = read_secret_file(path, passphrase_from_env())
            except KeyUnwrapError as err:  # names the file
                raise NodeFileError(f"cannot load the node's cache key: {err}") from None
            if len(key) != CACHE_KEY_BYTES:
                raise NodeFileError(f"{path}: the cache key is {len(key)} bytes; AES-256-GCM needs "
                                    f"{CACHE_KEY_BYTES} (a truncated or foreign file)")
            return key
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        key = AESGCM.generate_key(bit_length=256)
        write_secret_file(path, key, passphrase_from_env())
        return key

    # -- trust on first use, bounded (simulation only) -------------------------------------
    def pin_members(self, peers: Sequence[Peer], num_partitions: int) -> None:
        """Check ``peers`` against the member set this node pinned (``pins.json``) and pin the new
        ones; raises (pinning nothing) when the request is not allowed.

        The first keygen/provision request a node takes pins its members: node id, partition id,
        identity keys, and the node's own ``num-partitions``. Every later one may list pinned
        members (with their pinned partition and keys; a subset, as after a node left) and new
        members only in a partition no pinned member holds: so at most ``num-partitions``
        members, ever, and once every partition is pinned (every node took part in the first
        key) no member can be added. ``PeerKeyError``: a pinned member with other keys;
        ``MemberSetError``: anything else."""
        path = self.root / "pins.json"
        pinned_n, pins = self._pins(path)
        if pinned_n is not None and pinned_n != num_partitions:
            raise MemberSetError(f"num-partitions is {num_partitions} now, {pinned_n} when this node pinned "
                                 f"its members ({path}); refusing")
        if len(peers) > num_partitions:
            raise MemberSetError(f"the request lists {len(peers)} members, more than num-partitions="
                                 f"{num_partitions}; refusing")
        by_partition: dict[int, str] = {}
        for p in peers:
            if not 0 <= p.partition < num_partitions:
                raise MemberSetError(f"member {p.node_id!r} claims partition {p.partition}, outside "
                                     f"[0, num-partitions={num_partitions}); refusing")
            if p.partition in by_partition:
                raise MemberSetError(f"members {by_partition[p.partition]!r} and {p.node_id!r} both claim "
                                     f"partition {p.partition}; refusing")
            by_partition[p.partition] = p.node_id
        if len({p.node_id for p in peers}) != len(peers):
            raise MemberSetError("the request lists a member twice; refusing")
        owners = {m["partition"]: nid for nid, m in pins.items()}
        added = {}
        for p in peers:
            known = pins.get(p.node_id)
            if known is not None:
                if (known["sign"], known["kx"]) != (p.sign_public.hex(), p.kx_public.hex()):
                    raise PeerKeyError(f"member {p.node_id!r} offers other keys than on first use; refusing")
                if known["partition"] != p.partition:
                    raise MemberSetError(f"member {p.node_id!r} was pinned in partition {known['partition']}, "
                                         f"the request puts it in {p.partition}; refusing")
            elif p.partition in owners:
                raise MemberSetError(f"member {p.node_id!r} is not in the member set this node pinned at first "
                                     f"use, and its partition {p.partition} is pinned to member "
                                     f"{owners[p.partition]!r}; refusing")
            else:
                added[p.node_id] = {"partition": p.partition, "sign": p.sign_public.hex(), "kx": p.kx_public.hex()}
        if self.enrollment is not None:  # the partitions' keys pinned in earlier runs
            try:
                self.enrollment.pin(peers)
            except EnrollmentError as err:
                raise NodeFileError(str(err)) from None
            except Refused as err:
                raise PeerKeyError(str(err)) from None
        if added or pinned_n is None:
            record = {"version": PINS_VERSION, "num-partitions": num_partitions, "members": {**pins, **added}}
            write_public_file(path, json.dumps(record, sort_keys=True).encode())

    @staticmethod
    def _pins(path: Path) -> tuple[int | None, dict[str, dict[str, Any]]]:
        """(num-partitions, {node id: {partition, sign, kx}}) of ``pins.json``; (None, {}) if none."""
        if not path.exists():
            return None, {}
        rec = _read_json(path)
        try:
            if not isinstance(rec, dict) or rec.get("version") != PINS_VERSION:
                raise ValueError(f"not a version-{PINS_VERSION} pin record")
            n, members = rec["num-partitions"], rec["members"]
            if not _is_int(n) or n < 1:
                raise ValueError(f"num-partitions {str(n)[:20]!r} is not an int >= 1")
            if not isinstance(members, dict) or len(members) > n:
                raise ValueError("members is not an object of at most num-partitions entries")
            for nid, m in members.items():
                if not isinstance(m, dict) or not _is_int(m.get("partition")) or not 0 <= m["partition"] < n:
                    raise ValueError(f"member {nid[:20]!r}: partition is not an int in [0, {n})")
                _hex_bytes(m.get("sign"), 32)
                _hex_bytes(m.get("kx"), 32)
            if len({m["partition"] for m in members.values()}) != len(members):
                raise ValueError("two members pinned in one partition")
        except (KeyError, TypeError, ValueError) as err:
            raise NodeFileError(f"{path}: malformed ({type(err).__name__}: {err}); refusing to trust "
                                "any member") from None
        return n, members
