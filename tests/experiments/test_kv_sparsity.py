import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cache.sparsity import POLICY_NAMES, SlidingWindow, policy_for
from experiments import kv_sparsity
from node.models.byte_model import ModelConfig, TinyTransformer

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    """Random weights, larger than the init's (std 0.02) so attention is peaked and every
    detail of the explicit loop (scale, masks, positions) shows in the logits."""
    torch.manual_seed(0)
    m = TinyTransformer(ModelConfig(n_layers=2, n_heads=2, d_model=32, context_len=128)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m


def random_seq(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_no_drop_decode_loop_reproduces_the_full_forward(model):
    seq = random_seq(49)
    run = kv_sparsity.decode_sequence(model, seq, None)
    with torch.no_grad():
        full = model(torch.tensor([seq[:-1]]))[0]
    assert run.logits.shape == full.shape
    assert float((run.logits - full).abs().max()) <= TOL
    assert run.kept_final == 1.0 and not run.sparse.any()


def test_a_policy_that_keeps_everything_changes_nothing(model):
    seq = random_seq(33, seed=1)
    base = kv_sparsity.decode_sequence(model, seq, None)
    kept_all = kv_sparsity.decode_sequence(model, seq, policy_for("topk", 1.0, len(seq) - 1))
    assert torch.equal(base.logits, kept_all.logits)


def test_multi_token_step_matches_the_full_forward(model):
    # the T > 1 path of attend(): a causal mask inside the new tokens
    tokens = torch.tensor(random_seq(12, seed=2))
    kv = kv_sparsity.ExplicitKV(model.cfg, 12)
    first = kv_sparsity.model_step(model, tokens[:7], 0, kv, None)
    rest = kv_sparsity.model_step(model, tokens[7:], 7, kv, None)
    with torch.no_grad():
        full = model(tokens[None])[0]
    assert float((torch.cat([first, rest]) - full).abs().max()) <= TOL


def test_attend_gives_dropped_positions_zero_weight():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 1, 8, generator=g), torch.randn(2, 6, 8, generator=g),
               torch.randn(2, 6, 8, generator=g))
    live = torch.tensor([True, False, True, True, False, True])
    out, attn = kv_sparsity.attend(q, k, v, live)
    assert torch.all(attn[..., ~live] == 0)
    assert torch.allclose(attn.sum(-1), torch.ones(2, 1))
    ref = F.scaled_dot_product_attention(q, k[:, live], v[:, live])
    assert float((out - ref).abs().max()) <= TOL


def test_dropping_positions_changes_the_logits(model):
    seq = random_seq(49, seed=4)
    base = kv_sparsity.decode_sequence(model, seq, None)
    run = kv_sparsity.decode_sequence(model, seq, SlidingWindow(window=8, sinks=1))
    assert run.sparse.any() and run.kept_final < 0.5
    assert float((run.logits - base.logits).abs().max()) > TOL


def test_a_policy_reviving_a_position_is_caught(model):
    kv = kv_sparsity.ExplicitKV(model.cfg, 4)
    for _ in range(3):
        kv.append(0, torch.zeros(2, 1, 16), torch.zeros(2, 1, 16))
    kv.drop(0, torch.tensor([True, False, True]))
    with pytest.raises(RuntimeError, match="revived"):
        kv.drop(0, torch.tensor([True, True, True]))
    with pytest.raises(ValueError, match="keep mask"):
        kv.drop(0, torch.tensor([True, True]))


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_measured_kept_fraction_is_near_the_target(model, name, fraction):
    context = 50
    seqs = [random_seq(context + 1, seed=s) for s in range(2)]
    runs = kv_sparsity.decode_loop(model, seqs, lambda: policy_for(name, fraction, context))
    kept = statistics.fmean(r.kept_final for r in runs)
    assert abs(kept - fraction) <= 0.02, (name, fraction, kept)
    # the decode-averaged memory is between the target and keeping everything
    assert fraction <= statistics.fmean(r.kept_mean for r in runs) < 1.0


def test_mean_ci95_is_a_t_interval():
    mean, half = kv_sparsity.mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.302652729911275 * 1.0 / math.sqrt(3))  # t(0.975, 2)
    assert math.isnan(kv_sparsity.mean_ci95([5.0])[1])


def test_tiny_run_writes_every_point(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKV_CACHE_DIR", str(tmp_path / "ckpt"))
    out = Path(kv_sparsity.main(["--tiny", "--out", str(tmp_path)]))
    rows = list(csv.DictReader((out / "points.csv").open()))
    assert list(rows[0]) == kv_sparsity.COLUMNS
    assert {r["policy"] for r in rows} == {kv_sparsity.FULL, *POLICY_NAMES}
    assert {float(r["kept_fraction"]) for r in rows} == {0.5, 0.8, 1.0}
    for r in rows:
        for col in ("kept_measured", "top1_agreement", "ppl", "ppl_delta", "ppl_delta_ci95"):
            assert math.isfinite(float(r[col])), (col, r)
        assert abs(float(r["kept_measured"]) - float(r["kept_fraction"])) <= 0.03, r
    full = next(r for r in rows if r["policy"] == kv_sparsity.FULL)
    assert float(full["top1_agreement"]) == 1.0 and float(full["ppl_delta"]) == 0.0
    points = json.loads((out / "points.json").read_text())
    assert len(points) == len(rows) and all(set(p) == set(kv_sparsity.COLUMNS) for p in points)
    assert json.loads((out / "config.json").read_text())["context"] == 64
    assert (out / "summary.md").read_text().count("|") > 20
    assert (out / "ppl_delta_vs_kept.png").stat().st_size > 1000
