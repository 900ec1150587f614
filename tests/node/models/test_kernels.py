"""The fused CPU kernels (node.models.kernels): each gives what the eager bf16 op chain it
replaces gives, a bf16/int8 Llama decodes the same with and without them, bad inputs get a
specific error, and a machine that cannot build them runs the eager ops."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from cache import KVCache
from node.models import kernels, precision
from node.models.interface import MixedBatch
from node.models.llama import RMSNorm, apply_rope
from tests.tiny_models import tiny_llama

EPS = 1e-5


def bf(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def eager_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], EPS).to(torch.bfloat16)
    norm.weight.data = w
    with torch.no_grad():
        return norm(x)


def assert_bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step (a sum taken in another order may round the other way)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("width", [96, 100])  # 100: a tail past the 16-lane vectors
def test_rms_norm_is_the_eager_bf16_norm(k, rows, width):
    x, w = bf(rows, width, seed=1), bf(width, seed=2)
    assert_bf16_close(k.rms_norm(x, w, EPS), eager_norm(x, w))


@pytest.mark.parametrize("width", [64, 72])
def test_add_rms_norm_updates_the_residual_and_norms_it(k, width):
    x, y, w = bf(5, width, seed=1), bf(5, width, seed=2), bf(width, seed=3)
    want_x = x + y
    got = k.add_rms_norm_(x, y, w, EPS)
    assert torch.equal(x, want_x)  # the residual stream, updated in place
    assert_bf16_close(got, eager_norm(want_x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("D", [16, 64])  # 64: SmolLM2's, the vector path (half a multiple of 16)
def test_rope_split_is_rope_of_the_split_projection(k, dtype, rows, D):
    H, Hk = 6, 2
    y, cos, sin = bf(rows, (H + 2 * Hk) * D, seed=1), bf(rows, D, seed=2), bf(rows, D, seed=3)
    heads = y.unflatten(-1, (H + 2 * Hk, D)).transpose(0, 1)
    qk = apply_rope(heads[: H + Hk], cos, sin)
    q, kk, v = k.rope_split(y, cos, sin, H, Hk, D, dtype)
    assert q.shape == (Hk, H // Hk, rows, D) and kk.shape == v.shape == (Hk, rows, D)
    assert {q.dtype, kk.dtype, v.dtype} == {dtype}
    assert torch.equal(q.flatten(0, 1), qk[:H].to(dtype))
    assert torch.equal(kk, qk[H:].to(dtype))
    assert torch.equal(v, heads[H + Hk :].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_heads_is_the_o_proj_input(k, dtype):
    a = torch.randn(2, 3, 5, 8).to(dtype)
    assert torch.equal(k.merge_heads(a), a.flatten(0, 1).transpose(0, 1).flatten(1).to(torch.bfloat16))


@pytest.mark.parametrize("m", [48, 40])  # 40: a tail past the 16-lane vectors
def test_silu_mul_is_swiglu(k, m):
    gu = (3 * bf(9, 2 * m, seed=4).float()).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    assert_bf16_close(k.silu_mul(gu), F.silu(gate) * up)


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 33])
@pytest.mark.parametrize("k_in, n_out", [(64, 96), (40, 7)])  # 40, 7: the tails of the vector loops
def test_int8_linear_is_the_dequantized_product(k, rows, k_in, n_out):
    lin = precision.Int8Linear(torch.randn(n_out, k_in, generator=torch.Generator().manual_seed(5)))
    x = bf(rows, k_in, seed=6)
    want = x.float() @ lin.dequantized(torch.float32).T
    got = k.int8_linear(x, lin.q, lin.scale)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("k_in, n_out", [(576, 96), (1536, 33), (40, 7), (96, 1)])  # 40, 96: tails
def test_bf16_linear_is_the_product_summed_in_fp32(k, threads, rows, k_in, n_out):
    """Every row against an fp64 product, within the output's one bf16 rounding (and the
    fp32 sums' error): the 64-wide loop, a 32-wide step and a masked tail of fewer than 32."""
    w, x = bf(n_out, k_in, seed=7), bf(rows, k_in, seed=8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = k.bf16_linear(x, w)
    finally:
        torch.set_num_threads(before)
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-3 * k_in ** 0.5)


def test_bf16_linear_reads_only_its_rows_of_a_row_block(k):
    """A row block of a larger stack (a parameter's view in ``RowStack``) is a contiguous
    matrix of its own: the product reads its rows, not the neighbours'."""
    stack = bf(10, 64, seed=9)
    x = bf(2, 64, seed=10)
    assert torch.equal(k.bf16_linear(x, stack[3:7]), k.bf16_linear(x, stack)[:, 3:7])


@pytest.fixture(scope="module")
def prefill(k):
    if not kernels.prefill_kernel():
        pytest.skip("prefill_attention needs AVX-512 BF16 or AMX tiles")
    return k


@pytest.fixture(scope="module", params=["registers", "tiles"])
def engine(request, prefill):
    """Each engine of ``prefill_attention`` that runs here: on a machine with AMX tiles both,
    where ``auto`` would only ever take the tiles."""
    if request.param not in prefill.prefill_attention_engines():
        pytest.skip(f"the {request.param} engine does not run here")
    return request.param


@pytest.fixture(scope="module")
def amx(k):
    if not kernels.amx():
        pytest.skip("no AMX bf16 tiles on this CPU or kernel")
    return k


def test_the_tile_order_puts_pairs_of_inputs_side_by_side_per_output(amx):
    """Block (n, k) of ``int8_pack_amx`` is the AMX bf16 B tile of outputs 16n.. and inputs
    32k..: row r holds, for each of the 16 outputs, inputs 2r and 2r + 1."""
    q = torch.arange(32 * 64, dtype=torch.int32).remainder(251).sub(125).to(torch.int8).view(32, 64)
    tiled = amx.int8_pack_amx(q)
    assert tiled.shape == (2, 2, 512)
    block = tiled[1, 1].view(16, 16, 2)  # [pair r, output, which of the pair]
    for r, out, e in [(0, 0, 0), (0, 0, 1), (3, 5, 1), (15, 15, 0)]:
        assert block[r, out, e] == q[16 + out, 32 + 2 * r + e]


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("k_in, n_out", [(64, 96), (1536, 576), (96, 48)])
def test_int8_linear_amx_is_the_dequantized_product(amx, rows, k_in, n_out):
    """Codes are exact in bf16 and the tiles sum bf16 products in fp32: the fp32 product,
    rounded once to bf16 (give or take the order of the sums). Past 32 rows the widened codes
    are kept for the next row blocks, the last one partial (33, 100); 48 outputs are an odd
    number of 16-column blocks, so one pass takes a single block."""
    lin = precision.Int8Linear(torch.randn(n_out, k_in, generator=torch.Generator().manual_seed(5)))
    x = bf(rows, k_in, seed=6)
    want = x.float() @ lin.dequantized(torch.float32).T
    got = amx.int8_linear_amx(x, amx.int8_pack_amx(lin.q), lin.scale)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


def test_int8_linear_amx_refuses_what_it_cannot_tile(amx):
    codes = amx.int8_pack_amx(torch.zeros(16, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="out % 16 == 0 and in % 32 == 0"):
        amx.int8_pack_amx(torch.zeros(24, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="needs at least one row, got 0"):
        amx.int8_linear_amx(bf(0, 32), codes, torch.ones(16))
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 32\]"):
        amx.int8_linear_amx(bf(2, 64), codes, torch.ones(16))
    with pytest.raises(RuntimeError, match="scale must be contiguous float32"):
        amx.int8_linear_amx(bf(2, 32), codes, torch.ones(15))
    with pytest.raises(RuntimeError, match="packed must come from int8_pack_amx"):
        amx.int8_linear_amx(bf(2, 32), torch.zeros(16, 32, dtype=torch.int8), torch.ones(16))


def _causal_reference(q, k_runs, v_runs):
    """fp32 SDPA of q [Hk, G, T, D], the last T positions, over the runs laid end to end."""
    k, v = torch.cat(k_runs, 1).float(), torch.cat(v_runs, 1).float()
    Hk, G, T, D = q.shape
    n = k.shape[1]
    mask = torch.ones(T, n, dtype=torch.bool).tril(n - T)
    return F.scaled_dot_product_attention(q.float(), k[:, None].expand(Hk, G, n, D),
                                          v[:, None].expand(Hk, G, n, D), attn_mask=mask)


@pytest.mark.parametrize("G, T, lengths, dtype", [
    (3, 512, [512], torch.float32),          # a fresh prompt: the whole context
    (3, 37, [20, 33, 17], torch.float32),    # a chunk after cached runs, no size a multiple of 16
    (3, 100, [1000, 100], torch.bfloat16),   # a shared prefix's run, then the chunk's own
    (1, 17, [17], torch.float32),            # multi-head (no group), one row past a tile
    (3, 2, [1, 40], torch.bfloat16)])
def test_prefill_attention_is_causal_sdpa_in_bf16(prefill, engine, G, T, lengths, dtype):
    """Within what SDPA's own bf16 kernel gives on the same inputs, against fp32 attention:
    query t (position n - T + t) sees keys up to its position, across run boundaries."""
    g = torch.Generator().manual_seed(7)
    q = (2 * torch.randn(3, G, T, 64, generator=g)).to(torch.bfloat16)
    ks = [(2 * torch.randn(3, n, 64, generator=g)).to(dtype) for n in lengths]
    vs = [torch.randn(3, n, 64, generator=g).to(dtype) for n in lengths]
    got = prefill.prefill_attention(q, ks, vs, engine=engine)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = _causal_reference(q, ks, vs)
    n = sum(lengths)
    kb, vb = (torch.cat(r, 1).to(torch.bfloat16)[:, None].expand(3, G, n, 64) for r in (ks, vs))
    sdpa = F.scaled_dot_product_attention(q, kb, vb, attn_mask=torch.ones(T, n, dtype=torch.bool)
                                          .tril(n - T))
    err, sdpa_err = (got.float() - want).abs(), (sdpa.float() - want).abs()
    assert err.max() <= 1.5 * sdpa_err.max() + 1e-3 and err.mean() <= 1.5 * sdpa_err.mean()


def test_prefill_attention_never_reads_a_later_key(prefill, engine):
    """Changing keys and values after a query's position leaves its output exactly as it was."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 1, 40, 64, generator=g).to(torch.bfloat16)
    k, v = torch.randn(1, 40, 64, generator=g), torch.randn(1, 40, 64, generator=g)
    first = prefill.prefill_attention(q, [k], [v], engine=engine)
    k2, v2 = k.clone(), v.clone()
    k2[:, 20:] += 100
    v2[:, 20:] -= 1000
    again = prefill.prefill_attention(q, [k2], [v2], engine=engine)
    assert torch.equal(first[..., :20, :], again[..., :20, :])
    assert (first[..., 20:, :] != again[..., 20:, :]).any(-1).all()  # the later rows do see them


def test_prefill_attention_over_spans_is_over_the_runs_they_name(prefill):
    """``prefill_attention_spans`` reads (start, length) runs of one layer's K/V in place: the
    very result of ``prefill_attention`` over those runs as views; a span past the layer's
    tokens, or malformed spans, get a specific error before anything is read."""
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(3, 100, 64, generator=g), torch.randn(3, 100, 64, generator=g)
    q = torch.randn(3, 3, 20, 64, generator=g).to(torch.bfloat16)
    spans = torch.tensor([[64, 16], [0, 16], [40, 7]])
    views = [(k[:, a : a + n], v[:, a : a + n]) for a, n in spans.tolist()]
    want = prefill.prefill_attention(q, [a for a, _ in views], [b for _, b in views])
    assert torch.equal(prefill.prefill_attention_spans(q, k, v, spans), want)
    with pytest.raises(RuntimeError, match=r"span 1 \(90, 16\) is not within the 100 tokens"):
        prefill.prefill_attention_spans(q, k, v, torch.tensor([[0, 16], [90, 16]]))
    with pytest.raises(RuntimeError, match="is not within"):
        prefill.prefill_attention_spans(q, k, v, torch.tensor([[-1, 30]]))
    with pytest.raises(RuntimeError, match="spans must be contiguous int64"):
        prefill.prefill_attention_spans(q, k, v, torch.tensor([[0.0, 30.0]]))
    with pytest.raises(RuntimeError, match="k and v must be"):
        prefill.prefill_attention_spans(q, k, v[:, :50], spans)


def test_auto_is_the_engine_it_names_and_an_engine_that_cannot_run_is_refused(prefill):
    """``auto`` gives exactly what the last engine listed gives (tiles where they are granted);
    an unknown name, or an engine this machine cannot run, gets a specific error."""
    g = torch.Generator().manual_seed(10)
    q = torch.randn(3, 3, 30, 64, generator=g).to(torch.bfloat16)
    k, v = torch.randn(3, 50, 64, generator=g), torch.randn(3, 50, 64, generator=g)
    engines = prefill.prefill_attention_engines()
    assert engines and set(engines) <= {"registers", "tiles"}
    assert torch.equal(prefill.prefill_attention(q, [k], [v]),
                       prefill.prefill_attention(q, [k], [v], engine=engines[-1]))
    with pytest.raises(RuntimeError, match="engine must be 'auto', 'registers' or 'tiles', got"):
        prefill.prefill_attention(q, [k], [v], engine="gpu")
    for missing in {"registers", "tiles"} - set(engines):
        with pytest.raises(RuntimeError, match=f"the {missing} engine does not run here"):
            prefill.prefill_attention(q, [k], [v], engine=missing)


def test_prefill_attention_refuses_what_it_cannot_take(prefill):
    q, k = bf(3, 3, 4, 64), torch.zeros(3, 8, 64)
    with pytest.raises(RuntimeError, match=r"q must be bf16 \[kv_heads, group, T, 64\]"):
        prefill.prefill_attention(bf(3, 3, 4, 32), [k], [k])
    with pytest.raises(RuntimeError, match="need 1 <= T <= the runs' 8 keys, got T = 9"):
        prefill.prefill_attention(bf(3, 3, 9, 64), [k], [k])
    with pytest.raises(RuntimeError, match="run 1 must be"):
        prefill.prefill_attention(q, [k, k.to(torch.bfloat16)], [k, k.to(torch.bfloat16)])
    with pytest.raises(RuntimeError, match="as many runs"):
        prefill.prefill_attention(q, [k], [])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        prefill.prefill_attention(q, [k.half()], [k.half()])


def test_bad_inputs_get_a_specific_error(k):
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        k.rms_norm(torch.randn(2, 8), bf(8), EPS)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        k.rms_norm(bf(2, 8), bf(9), EPS)
    with pytest.raises(RuntimeError, match=r"y must be \[rows, 64\]"):
        k.rope_split(bf(1, 60), bf(1, 16), bf(1, 16), 2, 1, 16, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        k.rope_split(bf(1, 64), bf(1, 16), bf(1, 16), 2, 1, 16, torch.float16)
    with pytest.raises(RuntimeError, match="differ"):
        k.add_rms_norm_(bf(2, 8), bf(3, 8), bf(8), EPS)
    with pytest.raises(RuntimeError, match="q must be contiguous int8"):
        k.int8_linear(bf(1, 8), torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 8\]"):
        k.int8_linear(bf(1, 9), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
    with pytest.raises(RuntimeError, match="w must be bfloat16"):
        k.bf16_linear(bf(1, 8), torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        k.bf16_linear(bf(1, 4), bf(4, 8)[:, :4])
    with pytest.raises(RuntimeError, match=r"x must be contiguous \[1 to 4 rows, 8\]"):
        k.bf16_linear(bf(5, 8), bf(4, 8))


def _decode(model, steps: int = 4) -> list[torch.Tensor]:
    """Logits of a prefill, batched decode steps of two sessions, and a mixed step."""
    kv = KVCache(model.cache_config(block_size=8, pool_bytes=1 << 20))
    a, b, c = kv.open_session(), kv.open_session(), kv.open_session()
    out = [model.prefill(list(range(3, 22)), kv, a), model.prefill(list(range(40, 51)), kv, b)]
    for i in range(steps):  # fixed tokens: a near-tie must not send the two runs apart
        out.append(model.forward_batch([7 + i, 30 - i], kv, [a, b]))
    toks = [1, 2]
    step = kv.begin_batch([a, b], toks)
    kv.reserve(c, [5, 6, 7])
    out.append(model.forward_mixed(MixedBatch(step, tuple(toks), ((c, (5, 6, 7)),)), kv))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the kernels' vector paths
def test_a_model_decodes_the_same_with_and_without_them(k, one_thread, monkeypatch, dtype, head_dim):
    model = precision.convert(tiny_llama(std=0.2, head_dim=head_dim), dtype)
    fused = _decode(model)
    monkeypatch.setattr(kernels, "ops", lambda: None)
    eager = _decode(model)
    # bf16: the same roundings. int8: the kernel scales by the fp32 scale, aten's int8 kernel
    # by the scale rounded to bf16 (up to 0.4 % apart), so logits of O(1) move by up to ~0.2.
    tol = dict(rtol=0.02, atol=0.05) if dtype == "bfloat16" else dict(rtol=0.05, atol=0.25)
    for f, e in zip(fused, eager):
        torch.testing.assert_close(f, e, **tol)
        if dtype == "bfloat16":
            assert torch.equal(f.argmax(-1), e.argmax(-1))


def test_they_serve_bf16_inference_only(k):
    m32 = tiny_llama()
    m16 = precision.convert(tiny_llama(), "bfloat16")
    x = torch.zeros(1, m16.cfg.hidden_size, dtype=torch.bfloat16)
    assert m32.kernels(x.float()) is None
    with torch.no_grad():
        assert m16.kernels(x) is k
    assert m16.kernels(x) is None  # autograd on: the eager ops (training, adapters)


@pytest.fixture
def rebuilt(monkeypatch):
    """``kernels.ops`` recomputed under the test's settings, and again after it."""
    kernels.ops.cache_clear()
    kernels.amx.cache_clear()
    kernels.prefill_kernel.cache_clear()
    yield
    monkeypatch.undo()
    kernels.ops.cache_clear()
    kernels.amx.cache_clear()
    kernels.prefill_kernel.cache_clear()


def test_eager_setting_turns_them_off(rebuilt, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "eager")
    assert kernels.ops() is None
    assert kernels.status() == f"eager ({kernels.ENV}=eager)"


def test_the_kernels_loops_run_on_torchs_threads(k):
    """at::parallel_for in the kernels uses torch's thread count (the build has OpenMP: without
    it every kernel ran on one thread whatever torch.set_num_threads said)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert k.parallel_threads() == 2
        torch.set_num_threads(1)
        assert k.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_every_file_the_build_reads_ships_with_the_package():
    """An installed wheel holds only pyproject's package-data of node.models: a source or
    header missing there builds nowhere but a checkout (the build fails, the eager ops serve)."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    shipped = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["node.models"]
    assert sorted(f.name for f in kernels.SOURCES + kernels.HEADERS if f.name not in shipped) == []


def test_a_compiler_without_openmp_builds_the_kernels_without_it(rebuilt, monkeypatch):
    """Apple's clang refuses ``-fopenmp``: the same kernels are built without it (each on the
    calling thread) rather than none."""
    from torch.utils import cpp_extension

    tried, serial_build = [], object()  # stands for the module a build returns

    def no_openmp(*a, **kw):
        tried.append((kw["name"], kw["extra_cflags"], kw["extra_ldflags"]))
        if "-fopenmp" in kw["extra_cflags"]:
            raise RuntimeError("Error building extension\nclang: error: unsupported option '-fopenmp'")
        return serial_build

    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", no_openmp)
    assert kernels.ops() is serial_build
    (name1, flags1, ld1), (name2, flags2, ld2) = tried
    assert (flags1, ld1) == (list(kernels.FLAGS), ["-fopenmp"])
    assert (flags2, ld2) == (list(kernels.SERIAL_FLAGS), []) and name2 != name1


def test_a_failed_build_leaves_the_eager_ops(rebuilt, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*a, **kw):
        raise RuntimeError("Error building extension 'fedkv_kernels'\nc++: not found")

    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert kernels.ops() is None
    assert kernels.status() == "eager (build failed: RuntimeError: c++: not found)"
    assert "fused CPU kernels unavailable" in caplog.text
    model = precision.convert(tiny_llama(std=0.2), "bfloat16")
    kv = KVCache(model.cache_config(block_size=8, pool_bytes=1 << 20))
    assert torch.isfinite(model.prefill([1, 2, 3], kv, kv.open_session())).all()


@pytest.mark.parametrize("prefix_runs", [0, 2])
@pytest.mark.parametrize("slots", [None, [2, 0, 3]])
@pytest.mark.parametrize("D, T", [(16, 10), (64, 37)])  # 64: scores 16 keys at a time
def test_decode_attention_is_attend_shared(k, prefix_runs, slots, D, T):
    from cache.attention import attend_shared

    g = torch.Generator().manual_seed(7)
    Hk, G, S, cap = 2, 3, 4, T + 2
    B = 3
    arena = torch.randn(2, Hk, 64, D, generator=g)  # the cache's [K/V, heads, tokens, dim]
    prefix = [(arena[0, :, a : a + n], arena[1, :, a : a + n]) for a, n in [(3, 19), (40, 5)][:prefix_runs]]
    buf = torch.randn(2, S, Hk, cap, D, generator=g)  # slot-major tails, as cache.batch keeps them
    tails = buf[:, :, :, :T].transpose(1, 2)  # [2, Hk, S, T, D] views
    valid = torch.arange(T) < torch.tensor([[T - 3], [T], [1], [4]])
    q = torch.randn(Hk, G, B, D, generator=g)
    rows = torch.tensor(slots if slots is not None else [0, 1, 2])
    slotted = q.new_zeros(Hk, G, S, D)
    slotted[..., rows, :] = q
    want = attend_shared(slotted, prefix, tails[0], tails[1], valid)[..., rows, :]
    got = k.decode_attention(q, [a for a, _ in prefix], [b for _, b in prefix], tails[0], tails[1],
                             valid, rows if slots is not None else torch.empty(0, dtype=torch.long))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 4])  # 3 KV heads: rows in 1, 2 and 4 parts a head
@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("prefix", [48, 75, 992])  # pairs of 16-key blocks, a single one, a rest
def test_decode_attention_over_a_prefix_many_rows_share(k, D, prefix, threads):
    """Sixteen rows over one shared prefix (every row's queries scored against each block of
    keys turned dims-major once, the values summed six queries at a time) give attend_shared's
    result, however many parts each KV head's rows are split into for the threads."""
    from cache.attention import attend_shared

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(9)
    Hk, G, B, T = 3, 3, 16, 13
    arena = torch.randn(2, Hk, prefix + 7, D, generator=g)
    pk, pv = arena[0, :, 5 : 5 + prefix], arena[1, :, 5 : 5 + prefix]
    tails = torch.randn(2, Hk, B, T, D, generator=g).to(torch.bfloat16)
    valid = torch.arange(T) < torch.randint(0, T + 1, (B, 1), generator=g)
    q = torch.randn(Hk, G, B, D, generator=g)
    try:
        got = k.decode_attention(q, [pk], [pv], tails[0], tails[1], valid,
                                 torch.empty(0, dtype=torch.long))
    finally:
        torch.set_num_threads(before)
    want = attend_shared(q, [(pk, pv)], tails[0].float(), tails[1].float(), valid)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 4])  # 2, 4: each of 3 KV heads' prefix in 2 or 4 chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[513], [200, 16, 300, 37], [250]])  # 250: too short to split
@pytest.mark.parametrize("peak", [1.0, 30.0])  # 30: one chunk's scores dwarf the others'
def test_a_lone_rows_attention_split_along_its_prefix_is_the_attention(k, threads, dtype, lengths,
                                                                       peak):
    """One row with no tail (a fused decode step's attention) has its heads' prefixes split into
    chunks when the threads do not divide the heads: the chunks' sums, merged by their maxima,
    give the attention's result, runs crossing the chunks' edges included."""
    g = torch.Generator().manual_seed(11)
    Hk, G, D = 3, 3, 64
    keys = [torch.randn(Hk, n, D, generator=g) for n in lengths]
    keys[0][:, :40] *= peak
    prefix = [(a.to(dtype), torch.randn(Hk, n, D, generator=g).to(dtype)) for a, n in zip(keys, lengths)]
    q = torch.randn(Hk, G, 1, D, generator=g)
    no_tail, valid = torch.zeros(Hk, 1, 0, D), torch.zeros(1, 0, dtype=torch.bool)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = k.decode_attention(q, [a for a, _ in prefix], [b for _, b in prefix], no_tail, no_tail,
                                 valid, torch.empty(0, dtype=torch.long))
    finally:
        torch.set_num_threads(before)
    keys, values = (torch.cat([run[i].double() for run in prefix], 1) for i in (0, 1))
    weights = torch.softmax(torch.einsum("hgd,hnd->hgn", q[:, :, 0].double(), keys) / D**0.5, -1)
    want = torch.einsum("hgn,hnd->hgd", weights, values).unsqueeze(2)  # in fp64: peaked fp32 rounds
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_decode_attention_reads_bf16_tails_as_the_same_values_in_fp32(k):
    """A bf16 tail copy (``CacheConfig.batch_tail_dtype``) is read exactly as its fp32 upcast:
    the same result bit for bit, and attend_shared (the eager path) agrees."""
    from cache.attention import attend_shared

    g = torch.Generator().manual_seed(8)
    Hk, G, B, D, T = 2, 3, 4, 64, 21
    prefix = [(torch.randn(Hk, 9, D, generator=g), torch.randn(Hk, 9, D, generator=g))]
    tails = torch.randn(2, Hk, B, T, D, generator=g).to(torch.bfloat16)
    valid = torch.arange(T) < torch.tensor([[21], [3], [0], [12]])
    q = torch.randn(Hk, G, B, D, generator=g)
    none = torch.empty(0, dtype=torch.long)
    pk, pv = [a for a, _ in prefix], [b for _, b in prefix]
    got = k.decode_attention(q, pk, pv, tails[0], tails[1], valid, none)
    want = k.decode_attention(q, pk, pv, tails[0].float(), tails[1].float(), valid, none)
    assert torch.equal(got, want)
    eager = attend_shared(q.to(torch.bfloat16), prefix, tails[0], tails[1], valid)
    torch.testing.assert_close(eager.float(), got, rtol=0.02, atol=0.02)
    with pytest.raises(RuntimeError, match="K/V runs must be BFloat16"):
        k.decode_attention(q, pk, pv, tails[0], tails[1].float(), valid, none)


def test_decode_attention_refuses_a_slot_out_of_range(k):
    q, tails = torch.zeros(1, 1, 2, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"slot 5 out of range \[0, 2\)"):
        k.decode_attention(q, [], [], tails, tails, torch.ones(2, 4, dtype=torch.bool),
                           torch.tensor([0, 5]))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_sessions_leaving_and_joining_a_batch_decode_the_same(k, one_thread, monkeypatch, dtype):
    """Rows that move to other tail slots (a session left, another joined) read their own."""
    model = precision.convert(tiny_llama(std=0.2), dtype)

    def run() -> list[torch.Tensor]:
        kv = KVCache(model.cache_config(block_size=8, pool_bytes=1 << 20))
        s = [kv.open_session() for _ in range(4)]
        for i, sid in enumerate(s):
            model.prefill(list(range(5 + i, 17 + 3 * i)), kv, sid)
        out = []
        for members in ([0, 1, 2], [0, 1, 2], [2, 0], [3, 2, 0], [1, 3, 2, 0]):
            out.append(model.forward_batch([9 + m for m in members], kv, [s[m] for m in members]))
        return out

    fused = run()
    monkeypatch.setattr(kernels, "ops", lambda: None)
    tol = dict(rtol=0.02, atol=0.05) if dtype == "bfloat16" else dict(rtol=0.05, atol=0.25)
    for f, e in zip(fused, run()):
        torch.testing.assert_close(f, e, **tol)


@pytest.mark.parametrize("arena_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tail_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("appended", [0, 3, 5])
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_store_step_kv_stores_what_the_indexed_stores_do(k, arena_dtype, tail_dtype, appended,
                                                         rows_dtype):
    """``cache.batch.StepStore``'s contract: row b at ``pos[b]`` of the arena, row ``rows[i]``
    at ``at[i]`` of tail slot ``slots[i]``, rounded to bf16 once where the store is bf16 --
    bit for bit what the eager path's indexed stores leave (``tests/cache/test_batch.py``),
    from fp32 rows (a decode step's) or bf16 ones (a session's prefill)."""
    from tests.cache.test_batch import eager_store

    g = torch.Generator().manual_seed(9)
    Hk, B, D, N, S, cap = 3, 5, 64, 40, 7, 12
    kk, vv = (torch.randn(Hk, B, D, generator=g).to(rows_dtype) for _ in range(2))
    pos = torch.randperm(N, generator=g)[:B]
    slots = torch.randperm(S, generator=g)[:appended]
    at = torch.randint(0, cap, (appended,), generator=g)
    rows = torch.randperm(B, generator=g)[:appended]
    arena = torch.randn(2, Hk, N, D, generator=g).to(arena_dtype)
    tails = torch.randn(2, S, Hk, cap, D, generator=g).to(tail_dtype)
    want_arena, want_tails = arena.clone(), tails.clone()
    eager_store(want_arena, pos, kk, vv, want_tails, slots, at, rows)
    k.store_step_kv(arena, pos, kk, vv, tails, slots, at, rows)
    assert torch.equal(arena, want_arena) and torch.equal(tails, want_tails)


def test_store_step_kv_refuses_what_it_cannot_store(k):
    kk = torch.zeros(3, 2, 64)
    arena, tails = torch.zeros(2, 3, 10, 64), torch.zeros(2, 4, 3, 8, 64)
    one, none = torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"pos 10 out of range \[0, 10\)"):
        k.store_step_kv(arena, torch.tensor([0, 10]), kk, kk, tails, none, none, none)
    with pytest.raises(RuntimeError, match=r"slots 4 out of range \[0, 4\)"):
        k.store_step_kv(arena, torch.tensor([0, 1]), kk, kk, tails, one + 4, one, one)
    with pytest.raises(RuntimeError, match=r"at 8 out of range \[0, 8\)"):
        k.store_step_kv(arena, torch.tensor([0, 1]), kk, kk, tails, one, one + 8, one)
    with pytest.raises(RuntimeError, match=r"rows 2 out of range \[0, 2\)"):
        k.store_step_kv(arena, torch.tensor([0, 1]), kk, kk, tails, one, one, one + 2)
    with pytest.raises(RuntimeError, match="k, v must be contiguous float32 or bfloat16"):
        k.store_step_kv(arena, torch.tensor([0, 1]), kk.bfloat16(), kk, tails, none, none, none)
    with pytest.raises(RuntimeError, match="of one dtype"):
        k.store_step_kv(arena, torch.tensor([0, 1]), kk.half(), kk.half(), tails, none, none, none)
    with pytest.raises(RuntimeError, match="arena has the wrong shape"):
        k.store_step_kv(torch.zeros(2, 2, 10, 64), torch.tensor([0, 1]), kk, kk, tails, none,
                        none, none)


def test_a_prefills_rows_are_read_in_place_and_a_lone_tokens_gathered(k):
    """``attend_session`` with the kernels: a prefill's rows read the arena in place -- as
    ``Spans`` where the prefill kernel runs (``prefill_attention_spans``), as the runs where part
    of the context must be decoded first or it does not -- a lone token's come gathered
    (``decode_attention`` over many one-block runs was the slower); every store goes through
    ``store_step_kv``."""
    from cache.attention import Spans
    from node.models.byte_model import attend_session

    asked = []
    arena = torch.randn(2, 64, 64)
    both = (Spans(arena, arena, torch.tensor([[30, 8], [0, 16]])), None)

    class Cache:
        def append_and_read_spans(self, sid, layer, kk, vv, *, store=None):
            asked.append(("spans", store))
            return both[len(asked) > 1]

        def append_and_read(self, sid, layer, kk, vv, *, store=None, gather=True):
            asked.append((gather, store))
            return [(torch.randn(2, 24, 64), torch.randn(2, 24, 64))]

        def read_runs(self, sid, layer, gather=True):
            asked.append(("runs", gather))
            return [(arena[:, 30:38], arena[:, 30:38]), (arena[:, :16], arena[:, :16])]

        def sparsity(self, sid):
            return None

    prefill = torch.randn(2, 2, 8, 64).to(torch.bfloat16), torch.randn(2, 8, 64).to(torch.bfloat16)
    lone = torch.randn(2, 2, 1, 64), torch.randn(2, 1, 64)
    out = [attend_session(q, kv, kv, Cache(), 0, 0, kernels=k) for q, kv in (prefill, prefill, lone)]
    assert [o.shape for o in out] == [prefill[0].shape] * 2 + [lone[0].shape]
    if k.prefill_attention_available():
        assert asked == [("spans", k.store_step_kv), ("spans", k.store_step_kv),
                         ("runs", False), (True, k.store_step_kv)]
        assert torch.equal(out[0], out[1])  # the spans and the runs they name: the same rows
    else:
        assert asked == [(False, k.store_step_kv)] * 2 + [(True, k.store_step_kv)]


@pytest.mark.parametrize("n", [1, 63, 64, 4096 + 17, 1 << 20])
def test_read_stream_reads_every_byte(k, n):
    """The bandwidth probe reads all of a buffer (its sum of unsigned bytes is the buffer's),
    whole 64-byte lines and the tail alike, over the threads."""
    t = torch.randint(-128, 128, (n,), dtype=torch.int8)
    assert k.read_stream(t) == int(t.view(torch.uint8).long().sum())
    assert k.read_stream(t.float()) == int(t.float().view(torch.uint8).long().sum())
