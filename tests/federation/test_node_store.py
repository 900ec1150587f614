"""The node's error-feedback residual: saved privately, read back, zeros when absent or foreign."""

from __future__ import annotations

import numpy as np

from federation.node_store import NodeStore


def test_residual_round_trips_privately(tmp_path) -> None:
    store = NodeStore(tmp_path, "n1")
    assert not np.any(store.load_residual(10))  # none yet: zeros
    r = np.linspace(-1e-3, 1e-3, 10)
    store.save_residual(r)
    assert (tmp_path / "residual.npy").stat().st_mode & 0o077 == 0
    np.testing.assert_allclose(store.load_residual(10), r, rtol=1e-6)  # float32 on disk
    assert not np.any(store.load_residual(11))  # another model size: not carried
    store.save_residual(np.full(10, np.nan))
    assert not np.any(store.load_residual(10))  # a non-finite residual is not carried either


def test_a_torn_or_foreign_residual_file_is_not_carried(tmp_path) -> None:
    store = NodeStore(tmp_path, "n1")
    store.save_residual(np.ones(10))
    path = tmp_path / "residual.npy"
    path.write_bytes(path.read_bytes()[:40])  # torn
    assert not np.any(store.load_residual(10))
    path.write_bytes(b"not a residual")
    assert not np.any(store.load_residual(10))
