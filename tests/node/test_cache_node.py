import warnings

import numpy as np
import pytest
import torch

from crypto import clip_and_noise
from node.cache_node import UPDATE_KEY, CacheNode, DpConfig, NodeSpec, model_layout


@pytest.fixture(scope="module")
def lm_node() -> CacheNode:
    torch.set_num_threads(1)
    return CacheNode(NodeSpec(partition_id=0, num_partitions=3, task="lm"))


def test_round_keeps_params_and_update_in_the_cache(lm_node):
    node = lm_node
    v0 = node.version
    before = node.flat_params()
    out = node.train_round(1, 3e-3)
    assert np.allclose(node.flat_params(), before)  # training alone never moves the node
    stored = node.cache.get_tensor(UPDATE_KEY).numpy()
    assert stored.shape == (node.layout.size,) and node.cache.tensor_version(UPDATE_KEY) == v0
    assert np.allclose(stored, out.delta, atol=1e-7)  # the raw update: the node neither clips nor noises
    assert np.linalg.norm(stored) == pytest.approx(out.delta_norm, rel=1e-4)
    delta, clipped = clip_and_noise(out.delta, "local", 0.5, 0.0, 1, np.random.default_rng(0))
    assert clipped and np.linalg.norm(delta) == pytest.approx(0.5, rel=1e-4)
    node.apply_mean_update(delta, v0 + 1)
    assert node.version == v0 + 1
    for name in node.layout.names:
        assert node.cache.tensor_version(f"param/{name}") == v0 + 1
    assert np.allclose(node.flat_params(), before + delta, atol=1e-6)
    got = node.layout.flatten(node.model.state_dict())
    assert np.allclose(got, node.flat_params())  # the model serves what the cache holds


def test_sessions_keep_kv_until_a_write_back(lm_node):
    node = lm_node
    s = node.create_session()
    node.send(s, b"def f(x):\n", 8)
    sid = node.sessions[s]
    n1 = node.cache.length(sid)
    node.send(s, b"    return", 4)
    assert node.cache.length(sid) > n1  # the second turn appended to the same K/V
    history = node.cache.tokens(sid)
    node.apply_mean_update(np.zeros(node.layout.size, np.float32), node.version + 1)
    assert node.cache.is_stale(sid)
    with pytest.raises(Exception, match="version"):
        node.cache.read(sid, 0)  # K/V of the old weights is not served
    node.send(s, b"!", 2)
    assert not node.cache.is_stale(sid)
    assert node.cache.tokens(sid)[: len(history)] == history  # recomputed from its tokens
    assert node.cache.stats()["model_version"] == node.version


def test_bad_aggregates_are_refused_and_nothing_changes(lm_node):
    node = lm_node
    v, params = node.version, node.flat_params()
    with pytest.raises(ValueError, match="does not follow"):
        node.apply_mean_update(np.zeros(node.layout.size), v + 2)
    with pytest.raises(ValueError, match="shape"):
        node.apply_mean_update(np.zeros(node.layout.size - 1), v + 1)
    bad = np.zeros(node.layout.size)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        node.apply_mean_update(bad, v + 1)
    assert node.version == v and np.array_equal(node.flat_params(), params)


def test_state_round_trip_rebuilds_an_identical_node():
    a = CacheNode(NodeSpec(1, 3, task="digits"))
    out = a.train_round(1, 0.3)
    a.apply_mean_update(out.delta, 1)
    b = CacheNode(NodeSpec(1, 3, task="digits"))
    b.load_state(*a.to_state())
    assert b.version == 1 and np.array_equal(a.flat_params(), b.flat_params())
    ra = a.train_round(1, 0.3)
    rb = b.train_round(1, 0.3)
    assert np.allclose(ra.delta, rb.delta)  # same seeded shuffle: reused == rebuilt


def test_distributed_noise_share_has_the_right_scale():
    """The node's update through the mechanism's first steps (``make_contribution`` runs them:
    ``tests/federation/test_contribution.py``)."""
    node = CacheNode(NodeSpec(0, 3, task="digits"))
    out = node.train_round(1, 0.3)
    delta, _ = clip_and_noise(out.delta, "distributed", 1.0, 2.0, 4, np.random.default_rng(1))
    plain = node.cache.get_tensor(UPDATE_KEY).numpy()
    scale = min(1.0, 1.0 / np.linalg.norm(plain))
    noise = delta - plain * scale
    assert np.std(noise) == pytest.approx(2.0 * 1.0 / np.sqrt(4), rel=0.05)


def test_the_noisy_update_reaches_the_encoder_unrounded():
    """Issue 21: the noisy update was cast to float32 before the dither, a data-dependent rounding
    the dither argument does not cover. The noise must arrive exactly as drawn: the node's raw
    update through ``clip_and_noise`` (what ``make_contribution`` hands its encoder, checked at
    the encoder in ``tests/federation/test_contribution.py``)."""
    from crypto import gaussian_noise

    node = CacheNode(NodeSpec(0, 3, task="digits"))
    out = node.train_round(1, 0.3)
    delta, _ = clip_and_noise(out.delta, "distributed", 1.0, 2.0, 4, np.random.default_rng(7))
    plain = node.cache.get_tensor(UPDATE_KEY).numpy()
    clipped = (plain * min(1.0, 1.0 / np.linalg.norm(plain))).astype(np.float32)
    drawn = gaussian_noise(plain.shape, 2.0, 1.0, "distributed", 4, np.random.default_rng(7))
    assert delta.dtype == np.float64
    assert np.abs(delta - (clipped.astype(np.float64) + drawn)).max() < 1e-7


def test_layout_matches_the_model():
    assert model_layout("digits").size == 4810
    assert model_layout("lm").size == CacheNode(NodeSpec(0, 2, task="lm")).layout.size


def test_restoring_a_node_moves_the_one_version_counter_and_stales_kv(lm_node):
    node = lm_node
    s = node.create_session(b"hello ")
    node.send(s, b"hi", max_new_tokens=2)
    params, scalars = node.to_state()
    scalars = {**scalars, "version": node.version + 3}
    node.load_state(params, scalars)
    assert node.version == node.cache.version == scalars["version"]
    assert all(node.cache.tensor_version(f"param/{n}") == node.version for n in node.layout.names)
    assert node.cache.stats()["blocks_referenced"] == 0  # nothing computed under v0 is served


def test_dp_sgd_noise_and_sampling_do_not_follow_the_public_seed():
    """Two DP-SGD rounds from the same state, with torch's global generator and the loader's
    generator reset to the same public values: different updates (fresh OS entropy inside),
    and no "Secure RNG turned off" warning from Opacus (it is about torch's global RNG)."""
    node = CacheNode(NodeSpec(0, 3, task="digits"))
    dp = DpConfig(clip_norm=1.0, noise_multiplier=1.0, dp_sgd=True)
    deltas = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.manual_seed(42)
            node.task.train_loader.generator.manual_seed(42)
            deltas.append(node.train_round(1, 0.3, dp).delta)
    assert not np.allclose(deltas[0], deltas[1])
    assert not [w for w in caught if "Secure RNG" in str(w.message)], [str(w.message) for w in caught]


def test_dp_sgd_noise_and_batches_come_from_the_secrets_seeded_generator(monkeypatch):
    """What Opacus really uses: the optimizer's noise generator and the Poisson sampler's are
    both the generator seeded from ``secrets.randbits`` (not torch's global one)."""
    from opacus import PrivacyEngine

    from node import cache_node

    drawn: list[int] = []

    def randbits(k: int) -> int:
        drawn.append(k)
        return 0x5EC12E75

    made: list[tuple] = []
    make_private = PrivacyEngine.make_private

    def spy(self, **kw):
        out = make_private(self, **kw)
        made.append(out)
        return out

    monkeypatch.setattr(cache_node.secrets, "randbits", randbits)
    monkeypatch.setattr(PrivacyEngine, "make_private", spy)
    node = CacheNode(NodeSpec(0, 3, task="digits"))
    node.train_round(1, 0.3, DpConfig(clip_norm=1.0, noise_multiplier=1.0, dp_sgd=True))
    (_, opt, loader), = made
    assert drawn == [63]
    assert opt.generator is not None and opt.generator.initial_seed() == 0x5EC12E75
    assert loader.batch_sampler.generator is opt.generator  # Poisson batches: the same one
