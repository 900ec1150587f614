"""federation.flower_central: Flower samples with the global Mersenne Twister; an observer who
knows its state must not learn the sample (amplification by sampling assumes a secret sample)."""

from __future__ import annotations

import random

from federation.flower_central import SecretOrderGrid


class _Grid:
    run_id = 7

    def get_node_ids(self) -> list[int]:
        return list(range(100))


def _flower_sample(grid, k: int = 10) -> set[int]:  # noqa: ANN001 - what strategy_utils.sample_nodes does
    return set(random.sample(list(grid.get_node_ids()), k))


def test_knowing_the_twisters_state_predicts_flowers_sample_on_a_plain_grid() -> None:
    state = random.getstate()
    predicted = _flower_sample(_Grid())
    random.setstate(state)
    assert _flower_sample(_Grid()) == predicted  # the attack works without the wrapper


def test_the_secret_order_defeats_that_prediction() -> None:
    state = random.getstate()
    predicted = _flower_sample(_Grid())
    misses = 0
    for _ in range(3):
        random.setstate(state)
        misses += _flower_sample(SecretOrderGrid(_Grid())) != predicted  # equal w.p. 1/C(100,10)
    assert misses == 3


def test_a_seeded_order_repeats_and_the_rest_is_the_grids() -> None:
    a, b = SecretOrderGrid(_Grid(), seed=3), SecretOrderGrid(_Grid(), seed=3)
    assert a.get_node_ids() == b.get_node_ids() != list(range(100))
    assert sorted(a.get_node_ids()) == list(range(100)) and a.run_id == 7


def test_the_steady_baseline_grows_a_norm_that_every_update_exceeds() -> None:
    """The norm rule of the flower-adaptive baseline, without a run (tests/federation/test_local.py
    runs it end to end, marked slow): with every update clipped, Flower 1.42's wrapper shrinks
    the norm and SteadyClientSideAdaptiveClipping grows it by e^(η·γ) = e^0.1 (η 0.2, γ 0.5);
    with none clipped it shrinks by e^-0.1."""
    import math

    import pytest
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideAdaptiveClipping, FedAvg

    from federation.flower_central import SteadyClientSideAdaptiveClipping

    flower = DifferentialPrivacyClientSideAdaptiveClipping(FedAvg(), 0.0, 3, initial_clipping_norm=1e-3)
    flower._geometric_update(1.0)  # every update clipped
    assert flower.clipping_norm < 1e-3  # Flower's own direction: away from the target
    for clipped, factor in ((1.0, math.exp(0.1)), (0.0, math.exp(-0.1))):
        steady = SteadyClientSideAdaptiveClipping(FedAvg(), 0.0, 3, initial_clipping_norm=1e-3,
                                                  target_clipped_quantile=0.5, clip_norm_lr=0.2)
        steady._geometric_update(clipped)
        assert steady.clipping_norm == pytest.approx(1e-3 * factor, rel=1e-12)
