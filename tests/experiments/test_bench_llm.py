"""experiments.bench_llm on a tiny random Llama (2 layers, hidden 64, GQA 4/2): every section
runs, the JSON keeps its interface shape, figures are finite and positive. The real
SmolLM2 ``--quick --json`` run is ``-m slow`` (skipped when the model was never fetched)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from experiments import bench_llm, llm_contenders, llm_dtypes  # noqa: E402
from tests.hang_guard import HANG_GUARD_S  # noqa: E402
from tests.tiny_models import ours_from_hf, tiny_hf_llama  # noqa: E402

TINY = bench_llm.Plan(contexts=(32, 64), decode_steps=2, repeats=2, batch_sessions=3,
                      batch_prefix=32, batch_question=8, batch_steps=4, ttft_prefix=32,
                      ttft_question=8, capacity_pool_bytes=256 << 10, capacity_session_tokens=64,
                      quality_len=48, quality_windows=1, block_size=8)


WEIGHTS = ("bfloat16", "int8")
VARIANTS = ("fedkv_bf16", "fedkv_int8_weights")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    hf = tiny_hf_llama(initializer_range=0.02, attn_implementation=None, pad_token_id=0)
    ours = ours_from_hf(hf)
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, 128, (400,), generator=g).tolist()
    heldout = torch.randint(1, 128, (100,), generator=g).tolist()
    threads = torch.get_num_threads()
    try:
        r = bench_llm.run_all(ours, hf, text, heldout, TINY, threads=1, weight_dtypes=WEIGHTS)
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("bench_llm")
    return r, bench_llm.write_outputs(r, str(out)), (hf, ours)


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_json_shape(result):
    r = result[0]
    assert set(r["decode_tokens_per_s"]) == {"32", "64"}
    for row in r["decode_tokens_per_s"].values():
        assert set(bench_llm.DECODE) <= set(row)
        assert all(_finite_positive(row[k]) for k in bench_llm.DECODE)
        assert set(row["ratio_vs_hf"]) == {"fedkv_fp32", "fedkv_int8", "fedkv_int4"}
        assert all(_finite_positive(v) for v in row["ratio_vs_hf"].values())
    b = r["batched"]
    assert set(b) == set(bench_llm.BATCHED) | {"kv_bytes"}
    assert set(b["kv_bytes"]) == set(bench_llm.BATCHED)
    assert all(_finite_positive(b[k]) and _finite_positive(b["kv_bytes"][k])
               for k in bench_llm.BATCHED)
    assert set(r["ttft_s"]) == set(bench_llm.TTFT)
    assert all(_finite_positive(v) for v in r["ttft_s"].values())
    assert set(r["active_capacity_tokens"]) == set(bench_llm.CAPACITY)
    assert all(isinstance(v, int) and v > 0 for v in r["active_capacity_tokens"].values())
    assert set(r["quality"]) == set(bench_llm.QUALITY) | {"bf16", "int8_weights"}
    for q in r["quality"].values():
        assert set(q) == {"ppl_delta", "top1_agreement"}
        assert math.isfinite(q["ppl_delta"]) and 0 <= q["top1_agreement"] <= 1
    json.dumps(r)  # serialisable as printed


def test_sections_measure_what_they_say(result):
    r = result[0]
    d = r["details"]
    # later batched sessions reused the shared prefix from the prefix cache
    assert d["batched"]["prefix_reused_tokens"] >= (TINY.batch_sessions - 1) * TINY.batch_prefix
    hits = d["ttft_s"]["prefix_hit_blocks_by_tier"]
    assert hits["hot"]["hot"] >= TINY.ttft_prefix // TINY.block_size
    assert hits["warm"]["warm"] >= TINY.ttft_prefix // TINY.block_size
    assert hits["cold"]["cold"] >= TINY.ttft_prefix // TINY.block_size
    assert hits["recompute"].get("hot", 0) == 0
    assert d["ttft_s"]["same_first_tokens"]
    # fp32 cached decode follows HF's greedy tokens (same weights, same numerics)
    for c in r["decode_tokens_per_s"]:
        assert d["decode_tokens_per_s"][c]["greedy_tokens_agree_fp32_vs_hf"] == 1.0
    assert r["quality"]["fp16"]["top1_agreement"] > 0.9
    assert len(r["targets"]) == 13
    assert all(isinstance(t["pass"], bool) for t in r["targets"].values())


def test_weight_formats_are_measured_beside_fp32_at_each_context(result):
    """--weight-dtypes: fedkv_bf16 / fedkv_int8_weights decode beside fedkv_fp32 (same
    interleaved segments), their ratio to fp32, prefill ms and fraction of the bandwidth
    ceiling in details, Δppl and top-1 vs fp32 in quality."""
    r = result[0]
    d = r["details"]["decode_tokens_per_s"]
    for c, row in r["decode_tokens_per_s"].items():
        assert all(_finite_positive(row[k]) for k in VARIANTS)
        assert set(row["ratio_vs_fp32"]) == set(VARIANTS)
        assert all(len(d[c]["samples"][k]) == TINY.repeats for k in VARIANTS)
        assert set(d[c]["bandwidth_ceiling_fraction"]) == {"fedkv_fp32", *VARIANTS}
        for k, f in d[c]["step_bytes_fraction"].items():  # the context's K/V counted too
            assert f > d[c]["bandwidth_ceiling_fraction"][k] > 0
        assert set(d[c]["prefill_ms"]) == {"fedkv_fp32", *VARIANTS}
    gbs, by_reader = d["read_bandwidth_gbs"], d["read_bandwidth_by_reader_gbs"]
    assert set(gbs) == set(by_reader) == {"fedkv_fp32", *VARIANTS}
    for k, readers in by_reader.items():  # the fastest reader is the one probed
        assert "torch_sum" in readers and all(_finite_positive(v) for v in readers.values())
        assert gbs[k] == max(readers.values())
    for c, row in r["decode_tokens_per_s"].items():  # probed beside the decode segments
        probed = d[c]["read_bandwidth_gbs"]
        assert set(probed) == {"fedkv_fp32", *VARIANTS}
        assert all(_finite_positive(v) for v in probed.values())
        assert not any(k.startswith("read_probe") for k in [*row, *d[c]["samples"]])
        per_rotation = d[c]["read_bandwidth_samples_gbs"]
        for key, q in llm_dtypes.KEYS.values():  # the fraction divides by the probed bandwidth
            nbytes = r["details"]["quality"][q]["weight_bytes_per_token"]
            assert d[c]["bandwidth_ceiling_fraction"][key] == pytest.approx(
                row[key] * nbytes / (probed[key] * 1e9))
            assert probed[key] == pytest.approx(statistics.median(per_rotation[key]))
            paired = [s * nbytes / (g * 1e9)
                      for s, g in zip(d[c]["samples"][key], per_rotation[key])]
            assert len(paired) == TINY.repeats
            assert d[c]["bandwidth_ceiling_fraction_paired"][key] == pytest.approx(
                statistics.median(paired))
    for q in ("bf16", "int8_weights"):
        assert r["quality"][q]["top1_agreement"] > 0.8
    assert r["details"]["quality"]["bf16"]["weight_bytes_per_token"] * 2 == (
        r["details"]["quality"]["fp32_weight_bytes_per_token"])


def test_outputs_written(result):
    run_dir = result[1]
    assert (run_dir / "result.json").is_file() and (run_dir / "decode.png").stat().st_size > 0
    lines = (run_dir / "figures.csv").read_text().splitlines()
    assert lines[0] == "section,key,value" and len(lines) > 20


def test_missing_model_exits_2(tmp_path, capsys):
    assert bench_llm.main(["--model-dir", str(tmp_path / "absent"), "--out", str(tmp_path)]) == 2
    assert "python -m node.models.smollm2 fetch" in capsys.readouterr().err


def test_bad_threads_is_refused():
    with pytest.raises(SystemExit, match="--threads"):
        bench_llm.main(["--threads", "0"])


@pytest.mark.slow
def test_quick_json_on_the_real_model(tmp_path):
    from node.models import smollm2 as models

    if not (models.default_dir() / "config.json").is_file():
        pytest.skip("run `python -m node.models.smollm2 fetch` first")
    p = subprocess.run([sys.executable, "-m", "experiments.bench_llm", "--quick", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(r["decode_tokens_per_s"]) == {"512", "2048"}
    assert all(_finite_positive(r["decode_tokens_per_s"][c]["fedkv_fp32"]) for c in ("512", "2048"))
    assert set(r["quality"]) == {"fp16", "int8", "int4", "bf16", "int8_weights"}
    assert all(_finite_positive(r["decode_tokens_per_s"][c]["fedkv_bf16"]) for c in ("512", "2048"))


def test_hf_cache_from_fedkv_equals_hf_prefill(result):
    """--quick fills HF's DynamicCache from fedkv's fp32 K/V instead of HF's own prefill: the
    next step's logits must be HF's own, left padding included."""
    hf, ours = result[2]
    prompts = [list(range(3, 40)), list(range(50, 71))]
    caches, logits = llm_contenders.prefilled(ours, prompts, 4, 8)
    own = llm_contenders.HFSessions(hf, *llm_contenders.hf_prefill(hf, prompts))
    ported = llm_contenders.hf_sessions(hf, prompts, False, *caches[0], logits)
    assert torch.allclose(own.logits, logits, atol=1e-4)
    for _ in range(2):
        own.step(), ported.step()
        assert torch.allclose(own.logits, ported.logits, atol=1e-4)
    assert own.kv_bytes() == ported.kv_bytes()


def test_copy_session_stores_what_prefill_stores(result):
    hf, ours = result[2]
    prompt = list(range(5, 45))
    [(src, [sid])], _ = llm_contenders.prefilled(ours, [prompt], 4, 8)
    direct = llm_contenders.fedkv_cache(ours, 64, "int8", 8)
    d = direct.open_session()
    ours.prefill(prompt, direct, d)
    copy = llm_contenders.fedkv_cache(ours, 64, "int8", 8)
    c = llm_contenders.copy_session(src, sid, copy)
    assert copy.tokens(c) == direct.tokens(d) == prompt
    for layer in range(2):
        for a, b in zip(copy.read(c, layer), direct.read(d, layer)):
            assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="not fp32"):
        llm_contenders.copy_session(direct, d, copy)
    with pytest.raises(ValueError, match="fp32"):
        llm_contenders.prefilled(ours, [prompt], 4, 8, ("int8",))


def test_unknown_weight_format_is_refused_before_loading(tmp_path):
    with pytest.raises(SystemExit, match="--weight-dtypes 'fp8'"):
        bench_llm.main(["--weight-dtypes", "fp8", "--model-dir", str(tmp_path / "absent")])
