"""A byte-level text corpus that needs no download: the Python standard library's own sources.

Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is read once (about 14 MB on
CPython 3.11) and grouped by **top-level module** (``asyncio/…`` → ``asyncio``,
``json/…`` → ``json``, ``argparse.py`` → ``argparse``). Modules are the unit of every split, so
federated nodes get non-IID shares (one node reads ``email`` and ``http``, another ``tkinter``
and ``ctypes``) and the held-out split shares no module with any node.

Excluded: ``site-packages`` (third-party code), test suites (any directory named ``test``,
``tests`` or ``idle_test`` and any ``test_*.py`` file — this also drops ``lib2to3/tests/data``),
generated data that is not code (``pydoc_data``, ``_sysconfigdata*``, ``config-*``) and
``__pycache__``/``lib-dynload``.

Each module's bytes are its files in sorted path order, each preceded by a one-line header
``# ==== <relative path> ====``.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

_SKIP_TOP = {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "pydoc_data"}
_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _skip_top(name: str) -> bool:
    return (
        name in _SKIP_TOP
        or name.startswith("config-")
        or name.startswith("_sysconfigdata")
        or name in _SKIP_DIRS
    )


@lru_cache(maxsize=4)
def _read_all(root: str) -> tuple[tuple[str, bytes], ...]:
    """(module, bytes) for every top-level module under ``root``, sorted by name; read once."""
    files: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if entry.endswith(".py") and os.path.isfile(path):
            mod = entry[:-3]
            if _skip_top(mod) or mod.startswith("test_"):
                continue
            files.setdefault(mod, []).append(entry)
        elif os.path.isdir(path) and not _skip_top(entry) and "." not in entry:
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
                for f in sorted(filenames):
                    if f.endswith(".py") and not f.startswith("test_"):
                        rel = os.path.relpath(os.path.join(dirpath, f), root)
                        files.setdefault(entry, []).append(rel)
    out: list[tuple[str, bytes]] = []
    for mod in sorted(files):
        parts = []
        for rel in sorted(files[mod]):
            with open(os.path.join(root, rel), "rb") as fh:
                body = fh.read()
            header = f"# ==== {rel.replace(os.sep, '/')} ====\n".encode()
            parts.append(header + body + (b"" if body.endswith(b"\n") else b"\n"))
        data = b"".join(parts)
        if data:
            out.append((mod, data))
    return tuple(out)


def _rank(name: str, salt: str) -> bytes:
    """A platform-independent pseudo-random order of module names (not Python's hash())."""
    return hashlib.sha256(f"{salt}:{name}".encode()).digest()


def load_modules(max_bytes: int | None = None, *, root: str | None = None) -> dict[str, bytes]:
    """Top-level module name -> its source bytes, ordered by name.

    With ``max_bytes``, whole modules are taken in a fixed pseudo-random order (a hash of the
    name) and a module that would overflow the budget is skipped in favour of smaller ones, so
    a small cap still yields many different modules. Deterministic for a given Python install.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    mods = _read_all(root or stdlib_root())
    if not mods:
        raise FileNotFoundError(f"no Python sources found under {root or stdlib_root()!r}")
    if max_bytes is None:
        return dict(mods)
    chosen: set[str] = set()
    total = 0
    for name, data in sorted(mods, key=lambda m: _rank(m[0], "cap")):
        if total + len(data) <= max_bytes:
            chosen.add(name)
            total += len(data)
    if not chosen:  # every module is larger than the cap: truncate the smallest one
        name, data = min(mods, key=lambda m: (len(m[1]), m[0]))
        return {name: data[:max_bytes]}
    return {name: data for name, data in mods if name in chosen}


@dataclass
class CorpusSplit:
    """Disjoint module sets: one per node (``shares``) and a held-out evaluation split."""

    shares: list[bytes]
    heldout: bytes
    share_modules: list[list[str]]
    heldout_modules: list[str]
    seed: int = 0
    module_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def share_bytes(self) -> list[int]:
        return [len(s) for s in self.shares]


def _pick_heldout(mods: dict[str, bytes], fraction: float, keep: int) -> list[str]:
    """A fixed (seed-independent) set of modules holding about ``fraction`` of the bytes,
    leaving at least ``keep`` modules for the shares."""
    if fraction <= 0:
        return []
    total = sum(len(d) for d in mods.values())
    target = fraction * total
    held: list[str] = []
    size = 0
    for name in sorted(mods, key=lambda n: _rank(n, "heldout")):
        if size >= target or len(mods) - len(held) <= keep:
            break
        n = len(mods[name])
        if size + n > 1.2 * target:  # would overshoot the target by more than 20 %
            continue
        held.append(name)
        size += n
    if not held:  # everything was too large: take the smallest module
        held = [min(mods, key=lambda n: (len(mods[n]), n))]
    return sorted(held)


def split_corpus(
    num_shares: int,
    seed: int = 0,
    heldout_fraction: float = 0.1,
    max_bytes: int | None = None,
) -> CorpusSplit:
    """Split the stdlib corpus by top-level module into ``num_shares`` node shares and a
    held-out split.

    The held-out modules are fixed (independent of ``seed`` and ``num_shares``) so evaluation
    numbers stay comparable across runs. The remaining modules are shuffled with ``seed`` and
    dealt, largest size class first, to the share with the fewest bytes so far: shares are
    disjoint, non-empty and roughly balanced by bytes, while each stays non-IID (whole modules).
    """
    if not isinstance(num_shares, int) or num_shares < 1:
        raise ValueError(f"num_shares must be a positive int, got {num_shares!r}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    mods = load_modules(max_bytes)
    need = num_shares + (1 if heldout_fraction > 0 else 0)
    if len(mods) < need:
        raise ValueError(
            f"only {len(mods)} modules within max_bytes={max_bytes}; need at least {need} "
            f"({num_shares} shares + held-out); raise max_bytes or lower num_shares"
        )
    held = _pick_heldout(mods, heldout_fraction, keep=num_shares)
    held_set = set(held)
    rest = [n for n in mods if n not in held_set]
    rng = random.Random(seed)
    rng.shuffle(rest)
    # stable sort by power-of-two size class, largest first: balanced, yet seed-dependent
    rest.sort(key=lambda n: -int(np.log2(max(len(mods[n]), 1))))
    loads = [0] * num_shares
    groups: list[list[str]] = [[] for _ in range(num_shares)]
    for i, name in enumerate(rest):
        if i < num_shares:  # the first round guarantees every share one module
            j = i
        else:
            j = min(range(num_shares), key=lambda s: (loads[s], s))
        groups[j].append(name)
        loads[j] += len(mods[name])
    groups = [sorted(g) for g in groups]
    return CorpusSplit(
        shares=[b"".join(mods[n] for n in g) for g in groups],
        heldout=b"".join(mods[n] for n in held),
        share_modules=groups,
        heldout_modules=held,
        seed=seed,
        module_bytes={n: len(d) for n, d in mods.items()},
    )


def random_windows(
    data: bytes, seq_len: int, batch_size: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` consecutive bytes (inputs and shifted
    targets) as a LongTensor ``[batch_size, seq_len + 1]``; starts drawn from ``generator``."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    if len(data) < seq_len + 1:
        raise ValueError(f"data has {len(data)} bytes; a window needs seq_len + 1 = {seq_len + 1}")
    buf = np.frombuffer(data, dtype=np.uint8)
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator).numpy()
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(buf[idx].astype(np.int64))
