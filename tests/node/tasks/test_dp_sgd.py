"""node.tasks.dp_sgd: the example-level mechanism (clipping bounds one example's influence, Poisson
batches at the stated rate, noise of the stated scale from the injected generator), its accounting
against dp-accounting, and the language tasks training through it on a node."""

from __future__ import annotations

import math

import pytest
import torch

from node.tasks.dp_sgd import ExampleDp, poisson_batch, private_step


def _linear_problem(n: int = 40, dim: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.randn(n, generator=g)
    w = torch.nn.Parameter(torch.zeros(dim))
    return x, y, w


def _example_loss(x, y, w, scale: dict[int, float] | None = None):
    scale = scale or {}
    return lambda i: scale.get(i, 1.0) * (x[i] @ w - y[i]) ** 2


def test_noise_free_step_is_the_clipped_per_example_mean() -> None:
    x, y, w = _linear_problem()
    dp = ExampleDp(noise_multiplier=0.0, clip_norm=0.5, expected_batch=10)
    _, size = private_step([w], _example_loss(x, y, w), len(x), dp, torch.Generator().manual_seed(7))
    batch = poisson_batch(len(x), dp.sample_rate(len(x)), torch.Generator().manual_seed(7))
    want = torch.zeros(6)
    for i in batch:
        grad = 2 * (x[i] @ torch.zeros(6) - y[i]) * x[i]
        want += grad * min(1.0, 0.5 / float(grad.norm()))
    assert size == len(batch) > 0
    torch.testing.assert_close(w.grad, want / 10)


def test_one_example_moves_the_noise_free_sum_by_at_most_the_clip_norm() -> None:
    """The sensitivity the accountant assumes: a hostile record with a 10^6 gradient, present or
    absent, changes the summed gradient by <= C whatever the rest of the batch."""
    x, y, w = _linear_problem()
    dp = ExampleDp(noise_multiplier=0.0, clip_norm=1.0, expected_batch=40)  # q = 1: all in
    hostile = {3: 1e6}
    private_step([w], _example_loss(x, y, w, hostile), len(x), dp, torch.Generator().manual_seed(1))
    with_it = w.grad.clone() * 40
    without = {3: 0.0}  # the same data with the record's loss removed
    private_step([w], _example_loss(x, y, w, without), len(x), dp, torch.Generator().manual_seed(1))
    moved = float((with_it - w.grad * 40).norm())
    assert 0.99 <= moved <= 1.0 + 1e-5


def test_poisson_batches_have_the_stated_rate_and_vary() -> None:
    g = torch.Generator().manual_seed(3)
    sizes = [len(poisson_batch(1000, 0.05, g)) for _ in range(200)]
    mean = sum(sizes) / len(sizes)
    assert abs(mean - 50) < 3 and len(set(sizes)) > 10  # binomial(1000, .05): sd 6.9, of the mean 0.49


def test_noise_has_scale_sigma_c_over_the_expected_batch() -> None:
    w = torch.nn.Parameter(torch.zeros(20_000))
    dp = ExampleDp(noise_multiplier=2.0, clip_norm=0.5, expected_batch=8)
    private_step([w], lambda i: (w * 0).sum(), 100, dp, torch.Generator().manual_seed(5))
    assert float(w.grad.std()) == pytest.approx(2.0 * 0.5 / 8, rel=0.03)
    first = w.grad.clone()
    private_step([w], lambda i: (w * 0).sum(), 100, dp, torch.Generator().manual_seed(6))
    assert not torch.equal(first, w.grad)  # the generator decides: fresh entropy, fresh noise


def test_sigma_for_a_target_meets_it_and_agrees_with_dp_accounting() -> None:
    """Opacus' RDP (what the node reports) against dp-accounting's RDP of the same Poisson-sampled
    Gaussian, composed over the planned steps: they agree, and the target holds."""
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    n, steps = 31_438, 80  # the main job's lm node: its windows, 5 rounds x 16 steps
    dp = ExampleDp.for_target(8.0, 1e-5, n, steps, expected_batch=64)
    eps = dp.epsilon(n, steps, 1e-5)
    assert 7.5 < eps <= 8.0
    acct = RdpAccountant()
    acct.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(64 / n, dp_event.GaussianDpEvent(dp.noise_multiplier)), steps))
    assert acct.get_epsilon(1e-5) == pytest.approx(eps, rel=0.05)
    assert ExampleDp.for_target(8.0, 1e-5, n, 2 * steps).noise_multiplier > dp.noise_multiplier


def test_bad_mechanism_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="clip_norm"):
        ExampleDp(1.0, clip_norm=0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        ExampleDp(math.nan)
    with pytest.raises(ValueError, match="expected_batch"):
        ExampleDp(1.0, expected_batch=0)
    with pytest.raises(ValueError, match="at least one"):
        ExampleDp(1.0).sample_rate(0)


@pytest.mark.parametrize("task", ["lm", "chat:tiny"])
def test_a_language_node_trains_with_dp_sgd_and_reports_its_example_epsilon(task) -> None:
    from node.cache_node import CacheNode, DpConfig, NodeSpec

    node = CacheNode(NodeSpec(0, 5, task=task))
    if task == "lm":
        node.task.steps_per_epoch = 2  # a short round; the accounting is per step
    dp = DpConfig(dp_sgd=True, target_epsilon=8.0, planned_rounds=3, expected_batch=8, target_delta=1e-5)
    eps = []
    for _ in range(3):
        out = node.train_round(1, 0.0, dp)
        assert out.delta_norm > 0 and math.isfinite(out.loss)
        node.apply_mean_update(out.delta, node.version + 1)
        eps.append(out.epsilon)
    assert eps[0] < eps[1] < eps[2] <= 8.0
    steps = 3 * node.task.private_steps(1)
    assert eps[2] == pytest.approx(ExampleDp(node.dp_sigma, 1.0, 8).epsilon(node.task.num_examples, steps, 1e-5))
    assert eps[2] > 7.0  # the whole planned budget is used: sigma is no larger than it needs


def test_the_main_jobs_example_epsilon_is_at_most_8_against_dp_accounting() -> None:
    """The README's main job (pyproject defaults: lm, 5 nodes, dp-sgd on): every node's σ, sized
    from its own example count, keeps the whole run within ε 8 at δ 1e-5 per training example,
    recomputed with dp-accounting's RDP for the sampled Gaussian that runs (Poisson at q)."""
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    from federation.config import RunConfig
    from node.tasks.tasks import LmTask

    cfg = RunConfig()
    assert cfg.task == "lm" and cfg.dp_sgd and cfg.dp_sgd_epsilon == 8.0 and cfg.target_delta == 1e-5
    for partition in range(5):
        task = LmTask(partition, 5)
        steps = task.private_steps(cfg.local_epochs) * cfg.num_server_rounds
        dp = ExampleDp.for_target(cfg.dp_sgd_epsilon, cfg.target_delta, task.num_examples, steps,
                                  cfg.dp_sgd_clip, cfg.dp_sgd_batch or task.dp_batch)
        acct = RdpAccountant()
        acct.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(
            dp.sample_rate(task.num_examples), dp_event.GaussianDpEvent(dp.noise_multiplier)), steps))
        reported = dp.epsilon(task.num_examples, steps, cfg.target_delta)
        assert reported <= 8.0 and acct.get_epsilon(cfg.target_delta) <= 8.0 * 1.05, partition
