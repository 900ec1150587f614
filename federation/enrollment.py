"""A node's enrollment across runs: its identity keys and the member set it pinned (no kits).

Why: run directories (``<root>/run-<run id>/node-<node id>/``, ``federation.node_store``) are
per run, so a node used to make new identity keys and pin its peers afresh in every run: trust
on first use reopened with each ``flwr run``. A node's lasting state lives beside the runs now,
in ``<root>/enrolled/n<N>-p<P>/`` (root: node config ``node-dir``, else ``$FEDKV_NODE_DIR``,
else ``~/.fedkv/nodes``), where P is its ``partition-id`` and N its ``num-partitions``: the
node config, which the operator sets and a server cannot. Flower gives a node a new node id in
every run (simulation makes all of them anew), so node ids name nothing across runs; the
partition does. A federation of another size on the same root is other nodes (other dirs).

* ``identity.key``: made at the node's first contact in its first run; every later run's first
  contact copies it (renamed to that run's node id) into the run directory, so a run keeps the
  keys it enrolled with.
* ``members.json``: partition -> (signing, key-exchange) public keys of every member the node
  took a key with, in any run. A keygen/provision request listing other keys for a pinned
  partition, or a pinned member's keys in another partition, is refused (``PeerKeyError``);
  a partition nobody held yet is still trusted on first use, bounded by ``num-partitions``.

A new enrollment (new identity, pins forgotten) happens only when the operator says so: node
config ``re-enroll=true`` or ``$FEDKV_RE_ENROLL=1`` at a run's first contact (set it for one run:
each run that sees it enrolls anew). The old directory is moved aside to
``n<N>-p<P>.replaced-<UTC time>``, never deleted. Files: 0600 (``identity.key`` sealed with
``$FEDKV_NODE_KEY_PASSPHRASE`` when set) in 0700 directories; ``flock`` on ``lock`` serializes
runs that share the root.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crypto import NodeKeys, passphrase_from_env, read_secret_file, write_public_file, write_secret_file
from crypto.errors import KeyUnwrapError

RE_ENROLL_ENV = "FEDKV_RE_ENROLL"
RE_ENROLL_KEY = "re-enroll"
MEMBERS_VERSION = 1
_TRUE = ("1", "true", "yes")


class EnrollmentError(RuntimeError):
    """A file of the node's enrollment is damaged; the message names it."""


def _is_keys(rec: Any) -> bool:
    return isinstance(rec, dict) and set(rec) == {"sign", "kx"} and all(len(bytes.fromhex(v)) == 32 for v in rec.values())


def _int(value: Any) -> int | None:
    try:
        return int(str(value).strip())
    except ValueError:
        return None


@dataclass(frozen=True)
class Enrollment:
    """One node's lasting directory: ``<root>/enrolled/n<N>-p<P>``."""

    path: Path
    partition: int
    re_enroll: bool = False

    @classmethod
    def of(cls, root: Path, node_config: Mapping[str, Any]) -> Enrollment | None:
        """The enrollment of the node ``node_config`` describes; None without a valid
        partition-id / num-partitions (the node is refused elsewhere, naming them)."""
        p, n = _int(node_config.get("partition-id")), _int(node_config.get("num-partitions"))
        if p is None or n is None or not 0 <= p < n:
            return None
        flag = str(node_config.get(RE_ENROLL_KEY, "") or os.environ.get(RE_ENROLL_ENV, "")).strip().lower()
        return cls(Path(root) / "enrolled" / f"n{n}-p{p}", p, flag in _TRUE)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def identity(self, node_id: str) -> NodeKeys:
        """This run's identity at the node's first contact: the enrolled one, or a new one
        (first run, or ``re-enroll``), renamed to ``node_id``."""
        if self.re_enroll and self.path.exists():  # moved aside, never deleted
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            os.replace(self.path, self.path.with_name(f"{self.path.name}.replaced-{stamp}-{os.getpid()}"))
        with self._locked():
            path = self.path / "identity.key"
            if not path.exists():
                keys = NodeKeys.generate(node_id)
                write_secret_file(path, keys.private_pem(), passphrase_from_env())
                return keys
            try:
                return NodeKeys.from_private_pem(read_secret_file(path, passphrase_from_env())).renamed(node_id)
            except KeyUnwrapError as err:
                raise EnrollmentError(f"cannot load the node's enrolled identity keys: {err}") from None

    def pin(self, peers: Sequence[Any]) -> None:
        """Check ``peers`` (``node_store.Peer``) against the keys pinned per partition in any
        earlier run and pin the new partitions. ``Refused`` (naming the file) when a peer does
        not fit, ``EnrollmentError`` for a damaged record; nothing is pinned then."""
        with self._locked():
            path = self.path / "members.json"
            pinned = self._members(path)
            added: dict[str, dict[str, str]] = {}
            for p in peers:
                keys = {"sign": p.sign_public.hex(), "kx": p.kx_public.hex()}
                known = pinned.get(str(p.partition))
                elsewhere = [q for q, k in {**pinned, **added}.items()
                             if q != str(p.partition) and k["sign"] == keys["sign"]]
                if known is not None and known != keys:
                    raise Refused(f"member {p.node_id!r} offers other keys for partition {p.partition} than the "
                                  f"ones this node pinned for it in an earlier run ({path}); refusing")
                if elsewhere:
                    raise Refused(f"member {p.node_id!r} in partition {p.partition} offers the keys this node "
                                  f"pinned for partition {elsewhere[0]} in an earlier run ({path}); refusing")
                if known is None:
                    added[str(p.partition)] = keys
            if added:
                rec = {"version": MEMBERS_VERSION, "partitions": {**pinned, **added}}
                write_public_file(path, json.dumps(rec, sort_keys=True).encode())

    @staticmethod
    def _members(path: Path) -> dict[str, dict[str, str]]:
        if not path.exists():
            return {}
        try:
            rec = json.loads(path.read_bytes())
            if not isinstance(rec, dict) or rec.get("version") != MEMBERS_VERSION:
                raise ValueError(f"not a version-{MEMBERS_VERSION} member record")
            parts = rec["partitions"]
            if not isinstance(parts, dict) or not all(_is_keys(k) for k in parts.values()):
                raise ValueError("partitions is not an object of {sign, kx} 32-byte hex keys")
        except (OSError, KeyError, TypeError, ValueError) as err:
            raise EnrollmentError(f"{path}: malformed ({type(err).__name__}: {err}); refusing to trust "
                                  "any member") from None
        return parts


class Refused(ValueError):
    """A peer does not fit the member set pinned in an earlier run (``pin``'s caller turns it
    into a ``PeerKeyError``)."""
