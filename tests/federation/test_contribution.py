"""``make_contribution`` applies the whole node-side mechanism (issue 22): the node hands over its
raw update, and clip -> noise share -> ... -> encode happen here, with the rng injected."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import NodeKeys, gaussian_noise
from federation.codec import PlainClientCodec
from federation.config import RunConfig
from federation.contribution import Sender, make_contribution

DIM = 4000


class SpyCodec(PlainClientCodec):
    """The plaintext codec, keeping what reached its encoder."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.seen: list[np.ndarray] = []

    def encode(self, vec: np.ndarray, weight: float) -> bytes:
        self.seen.append(np.array(vec, copy=True))
        return super().encode(vec, weight)


def _contribute(cfg: RunConfig, update: np.ndarray, seed: int, num_sampled: int = 4):
    codec = SpyCodec(update.shape[0])
    sender = Sender(1, "n1", NodeKeys.generate("n1"), 0, None)
    made = make_contribution(cfg, update, num_examples=100, clip_norm=cfg.clip_norm, num_sampled=num_sampled,
                             rnd=1, codec=codec, sender=sender, residual=None, rng=np.random.default_rng(seed))
    (seen,) = codec.seen
    return made, seen


def _raw_update(scale: float) -> np.ndarray:
    u = np.random.default_rng(3).normal(size=DIM)  # float64, like CacheNode.train_round's
    return u * (scale / np.linalg.norm(u))


def test_the_noisy_update_reaches_the_encoder_unrounded():
    """Issue 21 (the property moved here with the noise, issue 22): the clipped update plus the
    noise share exactly as drawn from the injected rng, float64, no float32 rounding after the noise."""
    cfg = RunConfig(task="digits", he=False, dp_mode="distributed", clip_norm=1.0, noise_multiplier=2.0)
    raw = _raw_update(3.0)
    made, seen = _contribute(cfg, raw, seed=7)
    clipped = (raw / 3.0).astype(np.float32).astype(np.float64)
    drawn = gaussian_noise((DIM,), 2.0, 1.0, "distributed", 4, np.random.default_rng(7))
    assert seen.dtype == np.float64
    assert np.abs(seen - (clipped + drawn)).max() < 1e-12
    assert made.clipped and made.num_values == DIM


@pytest.mark.parametrize("mode, std", [("distributed", 2.0 * 1.0 / np.sqrt(4)), ("local", 2.0 * 1.0)])
def test_clip_then_noise_share_of_the_placement(mode, std):
    cfg = RunConfig(task="digits", he=False, dp_mode=mode, clip_norm=1.0, noise_multiplier=2.0)
    raw = _raw_update(0.5)  # inside the bound: not clipped
    made, seen = _contribute(cfg, raw, seed=1)
    assert not made.clipped
    assert np.std(seen - raw) == pytest.approx(std, rel=0.05)


def test_without_dp_the_update_is_only_clipped():
    """dp-mode none, he=false: no noise, but clipped to clip-norm (issue 30.5: every node bounds
    the plaintext mean by it); an update inside the ball goes out untouched."""
    cfg = RunConfig(task="digits", he=False, dp_mode="none", clip_norm=1.0)
    raw = _raw_update(3.0)
    made, seen = _contribute(cfg, raw, seed=0)
    assert made.clipped and seen.dtype == np.float32
    np.testing.assert_allclose(seen, (raw / 3.0).astype(np.float32), rtol=1e-6, atol=1e-7)
    inside = _raw_update(0.5)
    made, seen = _contribute(cfg, inside, seed=0)
    assert not made.clipped and np.array_equal(seen, inside.astype(np.float32))
