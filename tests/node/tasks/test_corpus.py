"""node.tasks.corpus: the stdlib corpus split by top-level module."""

from __future__ import annotations

import pytest
import torch

from node.tasks.corpus import CorpusSplit, load_modules, random_windows, split_corpus

CAP = 600_000  # keep tests fast; still dozens of modules


def test_load_modules_is_deterministic_sorted_and_excludes_tests():
    a = load_modules()
    assert list(a) == sorted(a)
    assert a == load_modules()
    assert len(a) > 50
    assert "site-packages" not in a and "test" not in a
    joined = b"".join(a.values())
    assert b"# ==== idlelib/idle_test/" not in joined
    assert b"# ==== lib2to3/tests/" not in joined
    assert b"# ==== unittest/test/" not in joined
    import re

    paths = re.findall(rb"^# ==== (\S+) ====$", joined, flags=re.M)
    assert len(paths) > 100
    for p in paths:
        parts = p.decode().split("/")
        assert not parts[-1].startswith("test_"), p
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), p
    for name, data in a.items():
        assert data.startswith(b"# ==== ")


def test_max_bytes_caps_total_and_keeps_many_modules():
    mods = load_modules(CAP)
    total = sum(map(len, mods.values()))
    assert 0 < total <= CAP
    assert len(mods) >= 10
    assert set(mods) <= set(load_modules())
    with pytest.raises(ValueError):
        load_modules(0)


@pytest.mark.parametrize("n", [1, 3, 7])
def test_shares_disjoint_nonempty_heldout_disjoint(n):
    s = split_corpus(n, seed=1, max_bytes=CAP)
    assert isinstance(s, CorpusSplit)
    assert len(s.shares) == len(s.share_modules) == n
    seen: set[str] = set()
    for share, mods in zip(s.shares, s.share_modules):
        assert share and mods
        assert not (seen & set(mods)), "a module is in two shares"
        seen |= set(mods)
    assert s.heldout and s.heldout_modules
    assert not (seen & set(s.heldout_modules))
    assert seen | set(s.heldout_modules) == set(load_modules(CAP))
    # bytes add up: shares + held-out are exactly the corpus
    assert sum(map(len, s.shares)) + len(s.heldout) == sum(map(len, load_modules(CAP).values()))


def test_heldout_is_about_ten_percent_and_seed_independent():
    full = split_corpus(4, seed=0)
    total = sum(full.module_bytes.values())
    assert 0.05 <= len(full.heldout) / total <= 0.15
    assert split_corpus(4, seed=5).heldout_modules == full.heldout_modules
    assert split_corpus(2, seed=0).heldout_modules == full.heldout_modules


def test_deterministic_for_a_seed_and_seed_matters():
    a = split_corpus(5, seed=3, max_bytes=CAP)
    b = split_corpus(5, seed=3, max_bytes=CAP)
    assert a.share_modules == b.share_modules and a.shares == b.shares
    others = [split_corpus(5, seed=k, max_bytes=CAP).share_modules for k in range(4, 8)]
    assert any(o != a.share_modules for o in others)


def test_shares_roughly_balanced():
    s = split_corpus(4, seed=0)
    sizes = s.share_bytes
    assert max(sizes) <= 1.5 * min(sizes)


def test_too_many_shares_rejected():
    with pytest.raises(ValueError):
        split_corpus(10_000, max_bytes=CAP)
    with pytest.raises(ValueError):
        split_corpus(0)


def test_random_windows_shape_and_content():
    data = bytes(range(256)) * 4
    g = torch.Generator().manual_seed(0)
    w = random_windows(data, 16, 5, g)
    assert w.shape == (5, 17) and w.dtype == torch.long
    for row in w.tolist():  # consecutive bytes of data
        assert all((b - a) % 256 == 1 for a, b in zip(row, row[1:]))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(random_windows(data, 8, 3, g1), random_windows(data, 8, 3, g2))
    with pytest.raises(ValueError):
        random_windows(b"abc", 8, 1, g)
