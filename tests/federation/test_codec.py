"""Plaintext codec: the contract the CKKS codec will keep (bytes in, weighted mean out)."""

from __future__ import annotations

import numpy as np
import pytest

from federation.codec import HEADER_BYTES, CodecError, PlainAggregator, PlainClientCodec, make_aggregator, make_client_codec

DIM = 7


def test_weighted_mean_roundtrip() -> None:
    codec, agg = PlainClientCodec(DIM), PlainAggregator(DIM)
    a, b = np.arange(DIM, dtype=np.float32), -np.ones(DIM, dtype=np.float32)
    agg.add(codec.encode(a, 3.0))
    agg.add(codec.encode(b, 1.0))
    assert agg.count == 2
    mean = codec.decode_mean(agg.result())
    np.testing.assert_allclose(mean, (3 * a + b) / 4, rtol=1e-6)


def test_update_size_is_fp32_plus_header() -> None:
    blob = PlainClientCodec(DIM).encode(np.zeros(DIM), 1.0)
    assert len(blob) == 4 * DIM + HEADER_BYTES


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:-4], "length"),
        (lambda b: b[:10], "shorter"),
        (lambda b: b[:4] + b"A" + b[5:], "kind"),
        (lambda b: b[:-4] + np.float32(np.nan).tobytes(), "NaN"),
    ],
)
def test_aggregator_rejects_bad_bytes_and_keeps_state(mutate, match) -> None:
    codec, agg = PlainClientCodec(DIM), PlainAggregator(DIM)
    good = codec.encode(np.ones(DIM), 2.0)
    agg.add(good)
    with pytest.raises(CodecError, match=match):
        agg.add(mutate(good))
    assert agg.count == 1
    np.testing.assert_allclose(codec.decode_mean(agg.result()), np.ones(DIM))


def test_wrong_dimension_and_weight_rejected() -> None:
    with pytest.raises(CodecError, match="dim"):
        PlainAggregator(DIM + 1).add(PlainClientCodec(DIM).encode(np.ones(DIM), 1.0))
    with pytest.raises(CodecError, match="weight"):
        PlainClientCodec(DIM).encode(np.ones(DIM), 0.0)
    with pytest.raises(CodecError, match="shape"):
        PlainClientCodec(DIM).encode(np.ones(DIM + 1), 1.0)
    with pytest.raises(CodecError, match="NaN"):
        PlainClientCodec(DIM).encode(np.full(DIM, np.inf), 1.0)


def test_oversized_blob_rejected() -> None:
    agg = PlainAggregator(DIM, max_bytes=16)
    with pytest.raises(CodecError, match="exceeds"):
        agg.add(PlainClientCodec(DIM).encode(np.ones(DIM), 1.0))


def test_client_cannot_decode_an_update_as_aggregate() -> None:
    codec = PlainClientCodec(DIM)
    with pytest.raises(CodecError, match="kind"):
        codec.decode_mean(codec.encode(np.ones(DIM), 1.0))


def test_empty_aggregate_and_noise() -> None:
    agg = PlainAggregator(DIM)
    with pytest.raises(CodecError, match="no updates"):
        agg.result()
    codec = PlainClientCodec(DIM)
    agg.add(codec.encode(np.zeros(DIM), 1.0))
    agg.add_noise(1.0, rng=np.random.default_rng(0))
    assert np.any(codec.decode_mean(agg.result()) != 0)


def test_noise_shares_add_variance() -> None:
    """add_noise(std, shares=k) adds k shares of std each: N(0, k·std²) (crypto's semantics)."""
    codec = PlainClientCodec(20000)
    agg = PlainAggregator(20000)
    agg.add(codec.encode(np.zeros(20000), 1.0))
    agg.add_noise(0.5, shares=4, rng=np.random.default_rng(1))
    assert agg.noise_shares == 4
    assert np.std(codec.decode_mean(agg.result())) == pytest.approx(1.0, rel=0.03)


def test_he_needs_keys_and_packing() -> None:
    with pytest.raises(CodecError, match="secret CKKS context"):
        make_client_codec(True, DIM)
    with pytest.raises(CodecError, match="public CKKS context"):
        make_aggregator(True, DIM)


# --- packing_for under DP: the derived range meets the saturation budget -----------------------


def _he_cfg(**overrides):
    from federation.config import RunConfig

    base = {"task": "digits", "he": True, "dp-mode": "distributed", "noise-multiplier": 1.33, "clip-norm": 1.0,
            "min-clients": 32, "max-clients": 32, "num-server-rounds": 25, "target-delta": 1e-5}
    return RunConfig.from_run_config({**base, **overrides})


@pytest.mark.parametrize("mode", ["distributed", "local"])
def test_derived_range_under_dp_meets_the_saturation_budget(mode) -> None:
    from crypto import saturation_budget, saturation_delta
    from crypto.dp.encoding_policy import contribution_std
    from federation.codec import encoding_params, packing_for

    cfg = _he_cfg(**{"dp-mode": mode})
    s = contribution_std(encoding_params(cfg))
    r = packing_for(cfg, 4810).clip_range
    assert r >= cfg.clip_norm + 6 * s
    assert saturation_delta(r, cfg.clip_norm, s, 4810, 32, 25) <= saturation_budget(1e-5)
    assert float(f"{r:.6g}") == r  # 6 significant digits (rounded up: the bound still holds)


def test_explicit_range_under_dp_is_kept_and_its_saturation_delta_reported() -> None:
    from crypto import saturation_delta
    from crypto.dp.encoding_policy import contribution_std
    from federation.codec import encoding_params, packing_for, run_saturation_delta

    cfg = _he_cfg(**{"packing-range": 0.5})
    assert packing_for(cfg, 4810).clip_range == 0.5
    s = contribution_std(encoding_params(cfg))
    assert run_saturation_delta(cfg, 4810) == saturation_delta(0.5, 1.0, s, 4810, 32, 25) == 1.0
    assert run_saturation_delta(_he_cfg(**{"dp-mode": "local"}), 4810) == 0.0  # post-processing there
    assert run_saturation_delta(_he_cfg(he=False), 4810) == 0.0  # nothing is saturated


def _encoding_doc() -> str:
    """docs/encryption.md, whitespace-normalized: it quotes the encoding policy's computed figures."""
    from pathlib import Path

    return " ".join((Path(__file__).resolve().parents[2] / "docs" / "encryption.md").read_text().split())


def test_the_digits_figures_in_the_encoding_doc_are_the_computed_ones() -> None:
    """docs/encryption.md quotes the range and the rounding cost for the digits experiment
    (``crypto.dp.encoding_policy``); recompute them so the text cannot drift from the code."""
    import math

    import federation.codec as codec

    cfg = _he_cfg()
    pk = codec.packing_for(cfg, 4810)
    rounding_std = pk.step * math.sqrt(32 / 12)  # the dithered sum of 32 contributions
    doc = _encoding_doc()
    assert f"R = {pk.clip_range:.6g}" in doc and f"δ_sat = {codec.run_saturation_delta(cfg, 4810):.3g}" in doc
    assert f"step {pk.step:.4g}" in doc and f"{rounding_std:.3g} = {100 * rounding_std / 1.33:.2g} %" in doc


def test_the_main_job_figures_in_the_encoding_doc_are_the_computed_ones() -> None:
    """The same for the main job's defaults (pyproject.toml's run config, lm, 5 nodes): the
    DP range, the heuristic it replaced, and the rounding cost of the 5-node sum."""
    import math
    import tomllib
    from pathlib import Path

    import crypto.dp.encoding_policy as policy
    import federation.codec as codec
    from federation.config import RunConfig
    from node.cache_node import model_layout

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    defaults = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    cfg = RunConfig.from_run_config(defaults)
    dim = model_layout(cfg.task, cfg.seed).size
    pk = codec.packing_for(cfg, dim)
    s, c = policy.contribution_std(codec.encoding_params(cfg)), cfg.clip_norm  # the heuristic the DP range replaced
    heuristic = min(math.hypot(policy.RANGE_NOISE_TAIL * s, policy.RANGE_SIGNAL_TAIL * c / math.sqrt(dim)),
                    c + policy.RANGE_NOISE_TAIL * s)
    rounding_std = pk.step * math.sqrt(5 / 12)
    sigma_c = cfg.noise_multiplier * cfg.clip_norm
    doc = _encoding_doc()
    assert f"dim {dim:,}" in doc and f"R = {pk.clip_range:.6g} instead of {heuristic:.6g}" in doc
    assert f"step {pk.step:.3g}, rounding std of the 5-node sum {rounding_std:.2g} = " \
           f"{100 * rounding_std / sigma_c:.0f} % of σC = {sigma_c:g}" in doc


def test_the_threat_models_mean_bounds_are_what_the_code_derives() -> None:
    """docs/threat-model.md: B = 2.27 for 3 digits nodes at σ = 0.05, 2.59 for the main job."""
    from federation.codec import mean_bound_for, wire_dim
    from federation.config import RunConfig
    from node.cache_node import model_layout

    for task, extra, n, want in (("digits", {"noise-multiplier": 0.05}, 3, 2.27), ("lm", {}, 5, 2.59)):
        cfg = RunConfig.from_run_config({"task": task, **extra})
        bound = mean_bound_for(cfg, wire_dim(cfg, model_layout(task, cfg.seed).size))
        assert round(bound.radius(n, n, float(n)), 2) == want, task
