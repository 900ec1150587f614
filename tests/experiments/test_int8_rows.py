"""experiments.int8_rows: every way it times computes the same product, the JSON has its keys."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import int8_rows
from node.models import kernels


def test_each_timed_way_computes_the_dequantized_product():
    """A timing of a wrong product would be no evidence: check what each way returns."""
    if kernels.ops() is None:
        pytest.skip(f"fused kernels not built here: {kernels.status()}")
    (lin,) = int8_rows.model_linears(0, seed=1)[-1:]  # the head alone
    for rows in (1, 5):
        runs = int8_rows.ways([lin], rows)  # every way multiplies the same rows
        assert "bf16_packed" in runs and ("tiles" in runs) == kernels.amx()
        assert runs.pop("read")() == int(lin.q.view(torch.uint8).long().sum())  # all the codes
        outs = {name: run()[0] for name, run in runs.items()}
        want = next(iter(outs.values())).float()
        for name, got in outs.items():
            torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=0.05, msg=name)


def test_quick_run_reports_each_row_count_against_the_baseline(tmp_path, capsys):
    past = int8_rows.TILES_TIMED_ROWS + 1
    result = int8_rows.main(["--quick", "--json", "--rows", f"1,5,33,{past}", "--out", str(tmp_path)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(json.dumps(result))
    assert set(result["ms_per_pass"]) == {"1", "5", "33", str(past)}
    for rows, ratios in result["vs_bf16_packed"].items():
        assert ratios["bf16_packed"] == 1.0
        assert "read" not in ratios and 0 < result["vs_read"][rows]["bf16_packed"]
        assert all(ms > 0 for ms in result["ms_per_pass"][rows].values())
    assert ("tiles" in result["ms_per_pass"]["33"]) == kernels.amx()  # past one 32-row block
    assert "tiles" not in result["ms_per_pass"][str(past)]  # past what it times only the GEMM
    assert result["weight_bytes"]["bf16_packed"] == 2 * result["weight_bytes"]["tiles"]


def test_the_codes_lie_end_to_end_on_huge_pages_in_pass_order():
    linears = int8_rows.model_linears(1, seed=1)
    qs = [lin.q for lin in linears]
    assert len({q.untyped_storage().data_ptr() for q in qs}) == 1
    assert [q.data_ptr() for q in qs[1:]] == [q.data_ptr() + q.numel() for q in qs[:-1]]
