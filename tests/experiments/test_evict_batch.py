"""experiments.evict_batch: a tiny sweep has the documented shape and really evicts."""

import json

from experiments import evict_batch


def test_a_tiny_sweep_writes_its_files_and_measures_every_batch(tmp_path, capsys):
    res = evict_batch.main(["--quick", "--batches", "16", "24", "--repeats", "1", "--passes", "2",
                            "--out", str(tmp_path), "--json"])
    assert set(res["evict_batch"]) == {"16", "24"}
    for row in res["evict_batch"].values():
        assert row["tokens_per_s"] > 0 and row["p50_ms"] <= row["p99_ms"] and row["repeats"] == 1
        assert row["demotions"] > 0  # the hot pool was under pressure: the batch size mattered
    assert {"throughput_24_vs_16", "p99_ms_24_minus_16"} <= set(res["ratios"])
    run = tmp_path / "evict_batch"
    (d,) = run.iterdir()
    assert {"points.csv", "results.json", "summary.md", "evict_batch.png"} <= {p.name for p in d.iterdir()}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["repeats"] == 1
