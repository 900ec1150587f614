"""The node's record of the aggregates it applied: which round and key epoch made each model
version, kept in its node directory (``federation.node_store``) so a restart forgets nothing.

Why not ``context.state``: a SuperNode keeps it in memory only, so after a restart a node took
round 1's aggregate again as a later version (issue 30). ``federation.catch_up`` refuses an
aggregate made in a round at or before the one that made the node's current version, or under an
older key epoch.

Why per version: ``catch_up`` writes the record when it applies an aggregate, the node commits
its parameters (and version) at the end of the message. A message that fails in between leaves
the cache at the old version with the record ahead of it; looking up the entry of the version the
cache holds, not the newest one, keeps the retry of that aggregate possible (and an entry above
the committed version is replaced when the version is reached again).

``applied.json`` beside the kept replies: written atomically and fsync'ed, mode 0600
(``crypto.at_rest``, framed with a key check value: a changed file fails loudly, naming it).
Its numbers are public (the server knows which rounds it sent); one file per run, as the node
directory is (``run-<run id>/``), so a fresh run on the same directory starts with none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crypto import read_secret_file, write_secret_file
from crypto.errors import CryptoError
from federation.node_store import NodeFileError, NodeStore

__all__ = ["APPLIED_FILE", "AppliedLog", "AppliedRound"]

APPLIED_FILE = "applied.json"
_FORMAT = 1


@dataclass(frozen=True)
class AppliedRound:
    """The aggregate that made model ``version``: the round it was made in and its key epoch."""

    version: int
    round: int
    epoch: int


class AppliedLog:
    """``applied.json`` of one node in one run."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / APPLIED_FILE

    @classmethod
    def for_context(cls, context: Any) -> AppliedLog:
        return cls(NodeStore.for_context(context).root)

    def at(self, version: int) -> AppliedRound | None:
        """The aggregate that made ``version`` (the newest entry at or below it); None when no
        aggregate was recorded up to it."""
        found = [e for e in self._entries() if e.version <= version]
        return max(found, key=lambda e: e.version) if found else None

    def note(self, applied: AppliedRound, committed: int) -> None:
        """Record ``applied`` before the node commits its version. Kept: the entry of the
        ``committed`` version (the one the cache holds) and those after it up to ``applied``;
        an entry at or above ``applied.version`` is one a failed message never committed."""
        base = self.at(committed)
        floor = base.version if base is not None else 0
        keep = [e for e in self._entries() if floor <= e.version < applied.version]
        rows = [[e.version, e.round, e.epoch] for e in [*keep, applied]]
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_secret_file(self.path, json.dumps({"format": _FORMAT, "applied": rows}).encode())

    def _entries(self) -> list[AppliedRound]:
        if not self.path.exists():
            return []
        try:
            rec = json.loads(read_secret_file(self.path))
            if not isinstance(rec, dict) or rec.get("format") != _FORMAT or not isinstance(rec.get("applied"), list):
                raise ValueError(f"not a format-{_FORMAT} record")
            out = []
            for row in rec["applied"]:
                if not (isinstance(row, list) and len(row) == 3
                        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row)):
                    raise ValueError("an entry is not [version, round, epoch] of ints >= 0")
                out.append(AppliedRound(*row))
            return out
        except (OSError, CryptoError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise NodeFileError(f"{self.path}: the record of applied aggregates does not read back "
                                f"({type(err).__name__}: {err}); the node refuses every aggregate until it "
                                "is restored or the node rejoins the run from a fresh node directory") from None
