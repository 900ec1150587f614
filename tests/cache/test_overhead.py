"""``python -m cache overhead``: both variants are measured in one run (figures not asserted)."""

from cache.overhead import OverheadConfig, measure_overhead


def test_overhead_reports_both_loops_with_their_baseline():
    out = measure_overhead(OverheadConfig(num_layers=2, num_heads=2, head_dim=8, steps=8,
                                          rounds=2))
    assert set(out) == {"cache_only", "with_attention"}
    for r in out.values():
        assert r["instrumented_us_per_step"] > 0 and r["bare_us_per_step"] > 0
        assert r["overhead"] > -1 and r["steps"] == 16
