"""A session's one-token step in one kernel call (``node.models.decode_step``): the same logits
and K/V as the per-kernel path, in a fresh and a churned arena, and the per-kernel path
wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from cache import KVCache
from cache.sparsity import SlidingWindow
from node.models import decode_step, precision
from tests.tiny_models import tiny_llama

BLOCK = 8


FORMATS = ("int8", "bfloat16")
STEP = {"int8": "decode_layers_int8", "bfloat16": "decode_layers_bf16"}
"""The kernel of each weight format's one-call step."""


def _model(fmt: str = "int8", head_dim: int = 64):
    return precision.convert(tiny_llama(std=0.2, head_dim=head_dim), fmt)


def _int8(head_dim: int = 64):
    return _model("int8", head_dim)


def _churned(m, kv_dtype: str = "bf16") -> tuple[KVCache, int]:
    """A session of 3 blocks in an arena whose free slots alternate with other sessions'
    blocks (every other one-block session closed, its block evicted for this one's): one
    arena run per block."""
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20, kv_dtype=kv_dtype))
    others = [kv.open_session() for _ in range(kv.arena.num_blocks)]
    for i, s in enumerate(others):
        m.forward_cached([(7 * i + j) % 100 for j in range(BLOCK)], kv, s)
    for s in others[1::2]:
        kv.close_session(s)
    sid = kv.open_session()
    for i in range(3):
        m.forward_cached(list(range(100 + i, 100 + i + BLOCK)), kv, sid)
    return kv, sid


def _decode(m, kv: KVCache, sid: int, tokens: list[int], one_call: bool,
            monkeypatch) -> list[torch.Tensor]:
    with monkeypatch.context() as p:
        if not one_call:
            p.setattr(decode_step, "run", lambda *a: None)
        return [m.forward_cached([t], kv, sid)[-1] for t in tokens]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim, kv_dtype, churned", [
    (16, "fp32", False), (64, "fp32", False), (16, "bf16", False), (64, "bf16", False),
    (64, "int8", False), (16, "fp32", True), (64, "fp32", True), (64, "bf16", True)])
def test_one_call_gives_the_per_kernel_logits_and_kv(k, one_thread, monkeypatch, fmt, head_dim,
                                                     kv_dtype, churned):
    """The same kernels in the same order: equal logits and K/V over one arena run, fp32 or
    bf16 (the model's default: its K/V are bf16 values, stored exactly). Over a
    churned context (one-block runs, which the per-kernel path gathers into one copy) and an
    int8 cache (whose blocks move) the keys are summed in other groupings, so the logits
    agree to bf16 rounding (and so do the K/V written after the first step). bf16 weights:
    both paths multiply through ``bf16_linear`` on the same row stacks."""
    m = _model(fmt, head_dim)
    made = []
    for one_call in (True, False):
        if churned:
            kv, sid = _churned(m, kv_dtype)
        else:
            kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20, kv_dtype=kv_dtype))
            sid = kv.open_session()
            m.prefill(list(range(3, 22)), kv, sid)
        toks = [5, 9, 2, 7, 11, 4, 8, 6, 1, 3] * 3  # across block boundaries
        made.append((_decode(m, kv, sid, toks, one_call, monkeypatch), kv, sid))
    (a, kv_a, sa), (b, kv_b, sb) = made
    assert kv_a.length(sa) == kv_b.length(sb)
    exact = not churned and kv_dtype in ("fp32", "bf16")
    for x, y in zip(a, b):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=0.02, atol=0.05)
    if exact:
        for layer in range(m.cfg.num_layers):
            for p, q in zip(kv_a.read(sa, layer), kv_b.read(sb, layer)):
                assert torch.equal(p, q)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("context", [40, 300])
@pytest.mark.parametrize("threads", [2, 3])
def test_several_threads_give_the_per_kernel_logits_and_kv(k, monkeypatch, fmt, context, threads):
    """On several threads the step is one parallel region: each product's rows split between
    them, and the attention's tasks -- 3 KV heads; on two threads each head's prefix in two
    chunks past 256 tokens, whole heads below -- the tasks and sums of the per-kernel path's
    at::parallel_for; each thread runs the row ops itself and writes the token's K/V of the
    heads whose last rows it attends, so the logits and K/V are equal."""
    m = precision.convert(tiny_llama(std=0.2, head_dim=64, num_heads=6, num_kv_heads=3), fmt)
    before = torch.get_num_threads()
    made = []
    try:
        torch.set_num_threads(threads)
        for one_call in (True, False):
            kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=4 << 20, kv_dtype="bf16"))
            sid = kv.open_session()
            m.prefill([(7 * i) % 100 + 3 for i in range(context)], kv, sid)
            toks = [5, 9, 2, 7, 11, 4, 8, 6, 1, 3]
            made.append((_decode(m, kv, sid, toks, one_call, monkeypatch), kv, sid))
    finally:
        torch.set_num_threads(before)
    (a, kv_a, sa), (b, kv_b, sb) = made
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for layer in range(m.cfg.num_layers):
        for p, q in zip(kv_a.read(sa, layer), kv_b.read(sb, layer)):
            assert torch.equal(p, q)


def test_a_churned_context_is_attended_over_its_runs(k, one_thread):
    """The churned session's step reads several runs, the new token's row in the last."""
    m = _int8()
    kv, sid = _churned(m)
    kv.reserve(sid, [5])
    step = kv.arena_step(sid)
    assert step is not None and len(step.runs) > 1
    start, n = step.runs[-1]
    assert start <= step.row < start + n
    assert sum(n for _, n in step.runs) == kv.length(sid) + 1


def test_it_commits_the_token_and_the_next_step_reads_it(k, one_thread):
    m = _int8()
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    sid = kv.open_session()
    m.prefill(list(range(3, 22)), kv, sid)
    n = kv.length(sid)
    m.forward_cached([5], kv, sid)
    assert kv.length(sid) == n + 1
    with pytest.raises(Exception, match="no one-token step to commit"):
        kv.commit_arena_step(sid)


@pytest.mark.parametrize("case", ["float32", "sliding window", "two tokens", "a layer written"])
def test_where_it_does_not_apply_the_per_kernel_path_runs(k, one_thread, monkeypatch, case):
    m = tiny_llama(std=0.2, head_dim=64).to(torch.bfloat16) if case == "float32" else _int8()
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    sid = kv.open_session(SlidingWindow(window=8, sinks=1) if case == "sliding window" else None)
    m.prefill(list(range(3, 22)), kv, sid)
    calls = []
    for fmt in FORMATS:  # an fp32 model cast to bf16 by hand is no converted format: none runs
        real = getattr(k, STEP[fmt])
        monkeypatch.setattr(k, STEP[fmt], lambda *a, real=real: calls.append(1) or real(*a))
    if case in ("two tokens", "a layer written"):
        kv.reserve(sid, [5, 6] if case == "two tokens" else [5])
        if case == "a layer written":
            c = m.cfg
            kv.write(sid, 0, *torch.zeros(2, c.num_kv_heads, 1, c.head_dim))
        assert kv.arena_step(sid) is None
        return
    m.forward_cached([5], kv, sid)
    assert calls == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_adapter_on_a_projection_turns_it_off(k, fmt):
    m = _model(fmt)
    m.model.layers[1].self_attn.o_proj = torch.nn.Linear(m.cfg.hidden_size, m.cfg.hidden_size,
                                                         bias=False)
    with torch.inference_mode():
        assert decode_step.layer_weights(m) is None
        assert len(decode_step.layer_weights(_model(fmt))) == \
            decode_step.PER_LAYER[fmt] * m.cfg.num_layers


def test_a_lora_adapter_on_a_bf16_model_turns_it_off(k, one_thread, monkeypatch):
    from node.models.lora import adapt
    m = adapt(_model("bfloat16"))
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    sid = kv.open_session()
    m.prefill(list(range(3, 22)), kv, sid)
    calls = []
    real = k.decode_layers_bf16
    monkeypatch.setattr(k, "decode_layers_bf16", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        assert decode_step.layer_weights(m) is None
        assert torch.isfinite(m.forward_cached([5], kv, sid)).all()
    assert calls == []


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("own_head", [False, True])
def test_the_head_runs_in_the_call_where_it_is_in_the_format(k, one_thread, monkeypatch, fmt,
                                                            own_head):
    """The head in the model's format is the call's last product (its logits equal the
    per-kernel path's); a head that is not (here a bf16 linear with a bias, as an adapter
    would leave it) is applied after the call, with the same logits as the per-kernel path."""
    m = _model(fmt)
    if own_head:
        m.lm_head = torch.nn.Linear(m.cfg.hidden_size, m.cfg.vocab_size, dtype=torch.bfloat16)
    heads = []
    real = getattr(k, STEP[fmt])
    monkeypatch.setattr(k, STEP[fmt], lambda *a: heads.append(len(a[-1])) or real(*a))
    logits = []
    for one_call in (True, False):
        kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
        sid = kv.open_session()
        m.prefill(list(range(3, 22)), kv, sid)
        logits.append(_decode(m, kv, sid, [5, 9, 2], one_call, monkeypatch))
    assert heads == [0 if own_head else (2 if fmt == "int8" else 1)] * 3
    assert all(x.dtype == torch.float32 for x in logits[0])
    assert all(map(torch.equal, *logits))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_embedding_with_a_hook_is_run_as_a_module(k, one_thread, monkeypatch, fmt):
    """The call embeds the token itself (a row of the table); an embedding whose forward does
    more -- here a hook that sees every input -- takes the per-kernel path, and so does one with
    ``max_norm``; a plain table gives the same logits in one call."""
    m = _model(fmt)
    calls = []
    real = getattr(k, STEP[fmt])
    monkeypatch.setattr(k, STEP[fmt], lambda *a: calls.append(1) or real(*a))

    def decode() -> list[torch.Tensor]:
        kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
        sid = kv.open_session()
        m.prefill(list(range(3, 22)), kv, sid)
        return [m.forward_cached([t], kv, sid)[-1] for t in [5, 9, 2]]

    plain = decode()
    assert len(calls) == 3
    seen = []
    hook = m.model.embed_tokens.register_forward_hook(lambda mod, i, o: seen.append(i[0].tolist()))
    hooked = decode()
    hook.remove()
    assert len(calls) == 3 and [t for s in seen[1:] for t in s] == [5, 9, 2]
    m.model.embed_tokens.max_norm = 1e9  # renormalizes rows past it in forward: none here
    assert all(map(torch.equal, plain, hooked)) and all(map(torch.equal, plain, decode()))
    assert len(calls) == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_inputs_get_a_specific_error_and_write_nothing(k, fmt):
    m = _model(fmt)
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    sid = kv.open_session()
    m.prefill(list(range(3, 22)), kv, sid)
    kv.reserve(sid, [5])
    step = kv.arena_step(sid)
    c = m.cfg
    with torch.inference_mode():
        w = decode_step.layer_weights(m)
    embed = m.model.embed_tokens.weight
    position = kv.length(sid)
    cos, sin = m.model.rotary_emb.table(position + 1, embed.dtype)
    before = kv.arena.kv.clone()

    def call(w=w, row=step.row, runs=step.runs, arena=step.kv, embed=embed, token=5, cos=cos,
             sin=sin, position=position, head=()):
        return getattr(k, STEP[fmt])(embed, token, w, m.model.norm.weight, cos, sin, position,
                                     arena, row, runs, c.num_heads, c.num_kv_heads, c.head_dim,
                                     c.rms_norm_eps, list(head))

    # the layers run on raw rows: what the per-layer ops checked is checked before the first
    with pytest.raises(RuntimeError, match="embed must be bfloat16"):
        call(embed=embed.float())
    with pytest.raises(RuntimeError, match="embed must be a contiguous"):
        call(embed=embed.t())
    for token in (-1, c.vocab_size):
        with pytest.raises(RuntimeError, match=f"token {token} outside the vocabulary"):
            call(token=token)
    with pytest.raises(RuntimeError, match=rf"cos and sin must be contiguous \[> {position}, "):
        call(cos=cos[:, : c.head_dim // 2])
    with pytest.raises(RuntimeError, match=rf"cos and sin must be contiguous \[> {len(cos)}, "):
        call(position=len(cos))
    with pytest.raises(RuntimeError, match="position must be >= 0"):
        call(position=-1)
    with pytest.raises(RuntimeError, match="sin must be bfloat16"):
        call(sin=sin.float())

    with pytest.raises(RuntimeError, match=f"{decode_step.PER_LAYER[fmt]} tensors per layer"):
        call(w=w[:-1])
    with pytest.raises(RuntimeError, match="outside the arena"):
        call(row=step.kv.shape[3])
    with pytest.raises(RuntimeError, match=r"span 0 \(-1, "):
        call(runs=[(-1, 4)])
    with pytest.raises(RuntimeError, match="outside the arena"):
        call(runs=[(0, step.kv.shape[3] + 1)])
    with pytest.raises(TypeError, match="incompatible function arguments"):
        call(runs=[(0.5, 4)])
    # the token's row ends the context: the thread that attends the last rows is the one that
    # writes it, so a span holding it anywhere else is refused
    with pytest.raises(RuntimeError, match=rf"holds the token's row {step.row} other than"):
        call(runs=[(step.row, 1)] + list(step.runs))
    with pytest.raises(RuntimeError, match="kv must be float32 or bfloat16"):
        call(arena=step.kv.half())
    last = len(w) - decode_step.PER_LAYER[fmt]  # the last layer's: checked before the first runs
    bad = list(w)
    bad[last + 1] = bad[last + 1].float()  # q/k/v in another format
    with pytest.raises(RuntimeError, match="q must be contiguous int8" if fmt == "int8"
                       else "w must be bfloat16"):
        call(w=bad)
    bad = list(w)
    bad[last + 1] = bad[last + 1][:-1]  # q/k/v one output short (int8: its scales too)
    if fmt == "int8":
        bad[last + 2] = bad[last + 2][:-1]
    with pytest.raises(RuntimeError, match=f"layer {c.num_layers - 1}'s weights do not chain"):
        call(w=bad)
    head = decode_step.step_weights(m).head
    with pytest.raises(RuntimeError, match="head must be empty or hold"):
        call(head=head + head)
    with pytest.raises(RuntimeError, match=f"head must take {c.hidden_size} inputs"):
        call(head=[t[:, :-1].contiguous() if t.dim() == 2 else t for t in head])
    assert torch.equal(kv.arena.kv, before)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_a_bf16_arena_gives_the_fp32_arenas_logits(k, one_thread, dtype):
    """The model's K/V are bf16 values: a bf16 arena (its default cache) stores them exactly,
    so prefill and every decode step give the logits an fp32 arena gives."""
    m = precision.convert(tiny_llama(std=0.2, head_dim=64), dtype)
    assert m.cache_config(pool_bytes=1 << 20).kv_dtype == "bf16"
    logits = []
    for kv_dtype in ("fp32", "bf16"):
        kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20, kv_dtype=kv_dtype))
        sid = kv.open_session()
        out = [m.prefill(list(range(3, 22)), kv, sid)]
        out += [m.forward_cached([t], kv, sid)[-1] for t in [5, 9, 2, 7, 11, 4, 8, 6] * 2]
        logits.append(out)
    for a, b in zip(*logits):
        assert torch.equal(a, b)


def test_the_weight_list_is_kept_until_something_it_was_read_from_is_replaced():
    m = _int8()
    first = decode_step.layer_weights(m)
    assert decode_step.layer_weights(m) is first
    o = m.model.layers[1].self_attn.o_proj
    m.model.layers[1].self_attn.o_proj = precision.Int8Linear.from_codes(o.q.clone(), o.scale)
    second = decode_step.layer_weights(m)
    assert second is not first
    assert second[decode_step.PER_LAYER["int8"] + 3] is m.model.layers[1].self_attn.o_proj.q
    norm = m.model.layers[0].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    third = decode_step.layer_weights(m)
    assert third is not second and third[5] is norm.weight
    m.model.layers[-1].mlp.down_proj = torch.nn.Linear(m.cfg.intermediate_size, m.cfg.hidden_size,
                                                      bias=False)
    assert decode_step.layer_weights(m) is None


@pytest.mark.parametrize("replace", ["buffer", "parameter", "layer", "state_dict", "move"])
def test_each_way_of_assigning_a_weight_is_seen(replace):
    """Every assignment torch runs a registration hook for makes the next step read the list
    afresh, and the new list holds what was assigned."""
    m = _int8()
    first = decode_step.layer_weights(m)
    down = m.model.layers[0].mlp.down_proj
    if replace == "buffer":  # an Int8Linear's codes (a buffer) assigned
        down.q = down.q.clone()
        expect, at = down.q, 8
    elif replace == "parameter":
        norm = m.model.layers[1].post_attention_layernorm
        norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
        expect, at = norm.weight, decode_step.PER_LAYER["int8"] + 5
    elif replace == "layer":  # a ModuleList item
        fresh = _int8()
        m.model.layers[1] = fresh.model.layers[1]
        expect, at = fresh.model.layers[1].input_layernorm.weight, decode_step.PER_LAYER["int8"]
    elif replace == "state_dict":
        w = m.model.layers[0].input_layernorm.weight
        m.load_state_dict({"model.layers.0.input_layernorm.weight": w.detach().clone()},
                          strict=False, assign=True)
        expect, at = m.model.layers[0].input_layernorm.weight, 0
    else:  # Int8Projection.move: the stack's codes moved into another buffer
        qkv = m.model.layers[0].self_attn.qkv.int8
        qkv.move(qkv.matrix().clone())
        expect, at = qkv.matrix(), 1
    second = decode_step.layer_weights(m)
    assert second is not first and second[at] is expect
    assert decode_step.layer_weights(m) is second


def test_registrations_outside_the_model_keep_the_weight_list():
    """Modules made and filled elsewhere -- a slice of another model's layer list (HF's
    ``LlamaModel.forward`` makes one every call), another model's parameters -- leave the list
    kept; the next assignment into the model still replaces it."""
    m, other = _int8(), _int8()
    first = decode_step.layer_weights(m)
    torch.nn.ModuleList(list(other.model.layers))[:1]
    other.model.norm.weight = torch.nn.Parameter(other.model.norm.weight.detach().clone())
    assert decode_step.layer_weights(m) is first
    norm = m.model.layers[0].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    second = decode_step.layer_weights(m)
    assert second is not first and second[0] is norm.weight


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoding_keeps_the_weight_list(k, fmt):
    """A decode step assigns no module, parameter or buffer: the list is read once, not per
    step (each re-read walks every layer's modules)."""
    m = _model(fmt)
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    sid = kv.open_session()
    m.prefill(list(range(3, 22)), kv, sid)
    with torch.inference_mode():
        m.forward_cached([5], kv, sid)
        kept = decode_step.layer_weights(m)
        for t in [9, 2, 7, 11]:
            m.forward_cached([t], kv, sid)
        assert decode_step.layer_weights(m) is kept


def test_bf16_weights_written_in_place_are_read_through(k, one_thread, monkeypatch):
    """A write-back loads parameters in place (``load_state_dict``): the kept list, which holds
    the parameters themselves, stays, and the one call gives the per-kernel path's logits."""
    m = _model("bfloat16")
    mlp = m.model.layers[1].mlp

    def logits(one_call: bool) -> list[torch.Tensor]:
        kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
        sid = kv.open_session()
        m.prefill(list(range(3, 22)), kv, sid)
        return _decode(m, kv, sid, [5, 9, 2], one_call, monkeypatch)

    with torch.inference_mode():
        first = decode_step.layer_weights(m)
    assert first[decode_step.PER_LAYER["bfloat16"] + 7] is mlp.up_proj.weight
    before = logits(True)
    m.load_state_dict({n: t * 1.5 for n, t in m.state_dict().items() if ".mlp." in n}, strict=False)
    with torch.inference_mode():
        assert decode_step.layer_weights(m) is first
    after = logits(True)
    assert not torch.equal(after[0], before[0]) and all(map(torch.equal, after, logits(False)))


def test_a_bf16_parameter_given_new_storage_is_read_there(k, one_thread, monkeypatch):
    """``.data =`` (what ``Module.to`` does) moves a parameter out of its row stack; the kept
    list holds the parameter, so the one call reads it where it now is, apart from its
    neighbours, and gives the per-kernel path's logits (which stacks it again)."""
    def step(one_call: bool) -> tuple[torch.Tensor, bool]:
        m = _model("bfloat16")
        mlp = m.model.layers[1].mlp
        kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
        sid = kv.open_session()
        m.prefill(list(range(3, 22)), kv, sid)
        with torch.inference_mode():
            kept = decode_step.layer_weights(m)
        mlp.up_proj.weight.data = mlp.up_proj.weight.detach().clone() * 0.5
        with torch.inference_mode():
            assert decode_step.layer_weights(m) is kept
        out = _decode(m, kv, sid, [5, 9], one_call, monkeypatch)
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        return torch.stack(out), up.data_ptr() != gate.data_ptr() + 2 * gate.numel()

    (one, apart), (per_kernel, _) = step(True), step(False)
    assert apart and torch.equal(one, per_kernel)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_kept_list_serves_only_what_the_kernels_serve(k, monkeypatch, fmt):
    """With the list kept, the one call is refused under autograd, and after the embedding and
    final norm were cast to fp32 in place (``.to`` keeps the parameters, so nothing registers)
    -- as before the list was kept."""
    m = _model(fmt)
    calls = []
    real = getattr(k, STEP[fmt])
    monkeypatch.setattr(k, STEP[fmt], lambda *a: calls.append(1) or real(*a))
    kv = KVCache(m.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    sid = kv.open_session()
    m.prefill(list(range(3, 22)), kv, sid)
    with torch.no_grad():
        m.forward_cached([5], kv, sid)
    assert len(calls) == 1 and decode_step.step_weights(m) is not None
    kv.reserve(sid, [9])
    with torch.enable_grad():
        assert decode_step.run(m, 9, kv.length(sid), kv, sid) is None
    assert len(calls) == 1
    with torch.no_grad():
        m._forward_reserved([9], kv, sid, kv.length(sid))
    assert len(calls) == 2
    m.model.embed_tokens.float()
    m.model.norm.float()
    with torch.no_grad():
        assert decode_step.run(m, 2, kv.length(sid), kv, sid) is None
    assert len(calls) == 2
