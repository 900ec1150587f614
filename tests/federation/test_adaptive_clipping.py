"""fedkv's adaptive clipping under HE (dp-mode distributed): the clipped count rides in the
update's ciphertext, the nodes move the norm, the server never holds it."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from federation.client_accounting import ClientAccountant
from federation.codec import adaptive_clipping_for, packing_for, wire_dim, wire_noise
from federation.config import RunConfig, ConfigError
from federation.local import InProcessGrid, run_local
from federation.node_store import NodeStore, ProvisioningError
from node.cache_node import model_layout

BASE = {"task": "digits", "he": True, "dp-mode": "distributed", "adaptive-clipping": True,
        "num-server-rounds": 3, "min-clients": 3, "max-clients": 3, "fraction-train": 0.5,
        "seed": 7, "serve-sessions": 0}


def _run(**overrides):  # noqa: ANN202
    cfg = {**BASE, **overrides}
    grid = InProcessGrid(6, cfg, run_id=6161)
    return grid, run_local(cfg, 6, grid=grid)


@functools.cache
def _tiny_norm_run():  # noqa: ANN202 - read only: two tests check the same σ = 0 run at norm 1e-3
    return _run(**{"clip-norm": 1e-3, "noise-multiplier": 0.0})


def _histories(grid: InProcessGrid) -> list[list[float]]:
    return [NodeStore.for_context(grid.contexts[n]).load_clip_norms() for n in grid.node_ids]


@pytest.mark.parametrize(("start", "factor"), [  # the shrinking run is end-to-end too (64 s loaded): slow
    (1e-3, math.exp(0.1)), pytest.param(1e3, math.exp(-0.1), marks=pytest.mark.slow)])
def test_every_node_moves_the_norm_the_same_way(start: float, factor: float) -> None:
    """σ = 0, so the count is exact: a tiny norm clips every update (unclipped share 0: the norm
    grows by exp(η·γ) = e^0.1 a round), a huge one none (it shrinks by e^-0.1). The tolerance is
    the dithered rounding of the count coordinate (< a step of 2R/255 per client, η = 0.2)."""
    grid, results = _tiny_norm_run() if start == 1e-3 else _run(**{"clip-norm": start, "noise-multiplier": 0.0})
    assert results.status == "completed", results.status
    expected = [start * factor**t for t in range(4)]
    for history in _histories(grid):
        assert history == pytest.approx(expected, rel=2e-3)


def test_the_server_never_sees_an_adapted_norm() -> None:
    grid, results = _tiny_norm_run()
    adapted = _histories(grid)[0][1:]
    sent = [v for msg in grid.sent for rec in msg.content.config_records.values() for v in rec.values()]
    got = [v for msg in grid.received if msg.has_content()
           for rec in msg.content.metric_records.values() for v in rec.values()]
    for value in sent + got:
        if isinstance(value, float):
            assert all(value != pytest.approx(c, rel=1e-6) for c in adapted), value
    assert results.encoding["dim"] == model_layout("digits", 7).size + 1  # the count's coordinate


@pytest.mark.slow  # end-to-end (47 s loaded): .ci/run's slow step; the σ = 0 run above checks the norm path
def test_with_noise_the_run_learns_and_is_charged_sigma() -> None:
    grid, results = _run(**{"noise-multiplier": 0.8, "num-server-rounds": 4, "clip-norm": 0.5})
    assert results.status == "completed", results.status
    histories = _histories(grid)
    assert all(h == histories[0] for h in histories) and len(histories[0]) == 5
    assert all(math.isfinite(c) and c > 0 for c in histories[0]) and len(set(histories[0])) == 5
    acc = ClientAccountant("fixed", 6, 1e-5)
    acc.step(0.8, 3, 4)  # the count is paid inside σ: the same ε as fixed clipping at σ
    assert results.rounds[-1].epsilon_client == pytest.approx(acc.epsilon())
    finals = [grid.node(n).flat_params() for n in grid.node_ids]
    for other in finals[1:]:
        np.testing.assert_allclose(other, finals[0], rtol=0, atol=1e-6)


def test_the_encoding_is_normalized_and_needs_no_norm() -> None:
    """Updates travel as Δ/C: the public packing is the same whatever the initial norm."""
    a = RunConfig.from_run_config({**BASE, "clip-norm": 0.01, "noise-multiplier": 1.0})
    b = RunConfig.from_run_config({**BASE, "clip-norm": 50.0, "noise-multiplier": 1.0})
    assert packing_for(a, 10) == packing_for(b, 10)
    ac = adaptive_clipping_for(a)
    assert ac is not None and wire_noise(a) == (1.0, ac.update_noise_multiplier)
    assert wire_dim(a, 10) == 11
    fixed = RunConfig.from_run_config({**BASE, "adaptive-clipping": False})
    assert adaptive_clipping_for(fixed) is None and wire_dim(fixed, 10) == 10


@pytest.mark.parametrize("overrides", [{"he": False}, {"dp-mode": "local"}, {"clip-norm-lr": -0.1}])
def test_config_refuses_what_it_cannot_run(overrides: dict) -> None:
    with pytest.raises(ConfigError):
        RunConfig.from_run_config({**BASE, **overrides})


def test_clip_history_round_trips_and_bad_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    store = NodeStore(tmp_path, "n1")
    assert store.load_clip_norms() == []
    store.save_clip_norms([1.0, 1.1, 0.9])
    assert store.load_clip_norms() == [1.0, 1.1, 0.9]
    with pytest.raises(ValueError):
        store.save_clip_norms([1.0, math.nan])
    path = tmp_path / "clip-norms.json"
    path.write_bytes(path.read_bytes()[:-3])  # torn
    with pytest.raises(ProvisioningError):
        store.load_clip_norms()


def test_a_node_without_its_history_fails_its_round_not_the_run() -> None:
    """A node restored past v0 without its norm history cannot rebuild the norm: its reply is an
    error (specific), the others go on."""
    cfg = {**BASE, "clip-norm": 1e-3, "noise-multiplier": 0.0, "num-server-rounds": 1, "fraction-train": 1.0,
           "min-clients": 3, "max-clients": 6}
    grid = InProcessGrid(6, cfg, run_id=6162)
    assert run_local(cfg, 6, grid=grid).status == "completed"
    victim = grid.node_ids[0]
    (NodeStore.for_context(grid.contexts[victim]).root / "clip-norms.json").unlink()
    from federation import catch_up

    with pytest.raises(RuntimeError, match="clip-norm history"):
        catch_up.clip_norms(RunConfig.from_run_config(cfg), grid.contexts[victim], 1)
