import csv
import math
from pathlib import Path

from experiments import kv_quant


def test_tiny_run_writes_every_point(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKV_CACHE_DIR", str(tmp_path / "ckpt"))
    out = Path(kv_quant.main(["--tiny", "--out", str(tmp_path)]))
    rows = list(csv.DictReader((out / "points.csv").open()))
    assert list(rows[0]) == kv_quant.COLUMNS
    assert {r["kv_dtype"] for r in rows} == {"fp32", "fp16", "int8", "int4"}
    for r in rows:
        for col in ("bytes_per_token", "top1_agreement", "ppl", "ppl_delta"):
            assert math.isfinite(float(r[col])), (col, r)
    fp32 = next(r for r in rows if r["kv_dtype"] == "fp32")
    int4 = next(r for r in rows if r["kv_dtype"] == "int4" and r["fp_window"] == "0")
    assert float(fp32["top1_agreement"]) == 1.0 and float(fp32["ppl_delta"]) == 0.0
    assert float(int4["bytes_per_token"]) < float(fp32["bytes_per_token"]) / 3
    assert int(int4["quantized_blocks"]) > 0
    assert (out / "summary.md").read_text().count("|") > 20
    assert (out / "memory_vs_quality.png").stat().st_size > 1000
