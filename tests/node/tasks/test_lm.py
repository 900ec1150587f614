"""node.tasks.lm: training lowers the loss; eval is in nats/byte; the checkpoint cache works."""

from __future__ import annotations

import math

import pytest
import torch

from node.tasks.corpus import split_corpus
from node.tasks.lm import checkpoint_key, default_cache_dir, eval_loss, pretrained_tiny, train_lm
from node.models.byte_model import ModelConfig, TinyTransformer

TINY = ModelConfig(n_layers=1, n_heads=2, d_model=32, context_len=64)


@pytest.fixture(scope="module")
def data() -> bytes:
    return split_corpus(1, seed=0, max_bytes=300_000).shares[0]


def test_training_lowers_loss(data):
    torch.manual_seed(0)
    model = TinyTransformer(TINY)
    before = eval_loss(model, data, 32, 16, torch.Generator().manual_seed(1))
    assert math.isclose(before, math.log(256), rel_tol=0.05)  # random init ~ uniform over bytes
    losses = train_lm(model, data, 40, 8, 32, 3e-3, torch.Generator().manual_seed(0))
    after = eval_loss(model, data, 32, 16, torch.Generator().manual_seed(1))
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert after < before - 1.0, (before, after)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert not model.training


def test_eval_loss_is_deterministic_and_validates(data):
    model = TinyTransformer(TINY)
    a = eval_loss(model, data, 16, 5, torch.Generator().manual_seed(3))
    b = eval_loss(model, data, 16, 5, torch.Generator().manual_seed(3))
    assert a == b
    with pytest.raises(ValueError):
        eval_loss(model, data, 16, 0)
    with pytest.raises(ValueError):
        train_lm(model, data, 1, 2, 1000, 1e-3)  # longer than context_len


def test_pretrained_tiny_trains_once_then_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKV_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    kw = dict(steps=2, batch_size=2, seq_len=16, max_bytes=300_000)
    m1, info1 = pretrained_tiny(TINY, tmp_path, return_info=True, **kw)
    assert info1["cached"] is False
    m2, info2 = pretrained_tiny(TINY, tmp_path, return_info=True, **kw)
    assert info2["cached"] is True and info2["path"] == info1["path"]
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    # a different step count is a different checkpoint
    assert checkpoint_key(TINY, steps=2) != checkpoint_key(TINY, steps=3)
    _, info3 = pretrained_tiny(TINY, tmp_path, return_info=True, **{**kw, "steps": 3})
    assert info3["cached"] is False and info3["path"] != info1["path"]
    # default directory comes from the environment variable
    _, info4 = pretrained_tiny(TINY, None, return_info=True, **kw)
    assert info4["path"].startswith(str(tmp_path / "env"))


def test_corrupt_checkpoint_is_retrained(tmp_path):
    kw = dict(steps=1, batch_size=2, seq_len=16, max_bytes=300_000)
    _, info = pretrained_tiny(TINY, tmp_path, return_info=True, **kw)
    with open(info["path"], "wb") as fh:
        fh.write(b"not a checkpoint")
    msgs = []
    model, info2 = pretrained_tiny(TINY, tmp_path, return_info=True, log=msgs.append, **kw)
    assert info2["cached"] is False and any("unreadable" in m for m in msgs)
    assert isinstance(model, TinyTransformer)
    _, info3 = pretrained_tiny(TINY, tmp_path, return_info=True, **kw)
    assert info3["cached"] is True
