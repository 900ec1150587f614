"""node.models.llama decodes through the paged KV cache with HF LlamaForCausalLM's logits.

A tiny random Llama (2 layers, hidden 64, 4 query heads over 2 KV heads, head_dim 16, RoPE θ
100,000, tied embeddings) in fp32: a prompt's prefill and 8 greedy decode steps through the
cache match HF's cache-free forward within 1e-4; a second session sharing the prompt's prefix
reuses its blocks (cache stats) and still matches. The real SmolLM2-135M-Instruct is compared
once (``-m slow``; skipped when ``python -m node.models.smollm2 fetch`` has not been run).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cache import KVCache  # noqa: E402
from node.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from tests.tiny_models import ours_from_hf, tiny_hf_llama  # noqa: E402

TOL = 1e-4
BLOCK = 8


@pytest.fixture(scope="module")
def tiny(one_thread):
    hf = tiny_hf_llama()
    with torch.no_grad():  # non-trivial norms, so a wrong weight would show
        for name, p in hf.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return hf, ours_from_hf(hf)


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens]), use_cache=False).logits[0]


def _decode(model: LlamaModel, kv: KVCache, prompt: list[int], steps: int):
    """Greedy: (prompt logits [T, V], the steps' logits [steps, V], the tokens chosen)."""
    sid = kv.open_session()
    reused = kv.match_prefix(sid, prompt)
    first = model.forward_cached(prompt[reused:], kv, sid)
    logits, toks, last = [], [], first[-1]
    for _ in range(steps):
        toks.append(int(last.argmax()))
        last = model.forward_cached([toks[-1]], kv, sid)[-1]
        logits.append(last)
    return first, torch.stack(logits), toks, reused, sid


def test_config_maps_hf_fields(tiny):
    _, ours = tiny
    c = ours.cfg
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.group) == (2, 4, 2, 16, 2)
    assert c.rope_theta == 100_000.0 and c.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.cache_config().num_heads == 2  # the cache holds KV heads only


def test_prefill_and_greedy_decode_match_hf(tiny):
    hf, ours = tiny
    kv = KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    prompt = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    first, steps, toks, reused, _ = _decode(ours, kv, prompt, 8)
    assert reused == 0
    ref = _hf_logits(hf, prompt + toks)
    assert (first - ref[: len(prompt)]).abs().max() < TOL
    assert (steps - ref[len(prompt) :]).abs().max() < TOL
    assert toks == ref[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert ref.std() > 0.3  # logits far from trivial: the tolerance means something


def test_prefill_computes_only_the_last_logits_the_same(tiny):
    _, ours = tiny
    prompt = list(range(3, 40))
    a, b = (KVCache(ours.cache_config(block_size=BLOCK)) for _ in range(2))
    mlp_rows = []
    hook = ours.model.layers[-1].mlp.register_forward_hook(
        lambda mod, args, out: mlp_rows.append(args[0].shape[-2]))
    try:
        sa, sb = a.open_session(), b.open_session()
        full = ours.forward_cached(prompt, a, sa)
        last = ours.prefill(prompt, b, sb)
    finally:
        hook.remove()
    assert last.shape == (128,) and torch.allclose(last, full[-1], atol=1e-6)
    assert mlp_rows == [len(prompt), 1]  # the last layer's MLP ran on the sampled row alone
    for layer in (0, ours.cfg.num_layers - 1):  # ... and its attention stored every row's K/V
        (ka, va), = a.read_runs(sa, layer)
        (kb, vb), = b.read_runs(sb, layer)
        assert ka.shape[-2] == len(prompt) and torch.equal(ka, kb) and torch.equal(va, vb)


def test_second_session_reuses_prefix_blocks_and_matches_hf(tiny):
    hf, ours = tiny
    kv = KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    g = torch.Generator().manual_seed(2)
    system = torch.randint(0, 128, (3 * BLOCK + 3,), generator=g).tolist()
    a = system + torch.randint(0, 128, (5,), generator=g).tolist()
    b = system + torch.randint(0, 128, (6,), generator=g).tolist()
    _decode(ours, kv, a, 4)
    before = kv.stats()
    first, steps, toks, reused, _ = _decode(ours, kv, b, 8)
    after = kv.stats()
    assert reused == 3 * BLOCK
    assert after["prefix_hit_blocks"] - before["prefix_hit_blocks"] == 3
    ref = _hf_logits(hf, b + toks)
    assert (first - ref[reused : len(b)]).abs().max() < TOL
    assert (steps - ref[len(b) :]).abs().max() < TOL


@pytest.mark.parametrize("kv_dtype,rel", [("fp16", 0.01), ("int8", 0.05), ("int4", 0.4)])
def test_reduced_precision_kv_stays_close(tiny, kv_dtype, rel):
    """fp16/int8/int4 K/V through the unchanged cache API (blocks leave the fp window and are
    quantized): logits near HF's fp32 ones, relative to their largest magnitude (a sanity
    bound on random weights, not a quality figure; measured 0.002 / 0.02 / 0.27)."""
    hf, ours = tiny
    kv = KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20, kv_dtype=kv_dtype,
                                   fp_window=BLOCK))
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    first, steps, toks, _, _ = _decode(ours, kv, prompt, 8)
    ref = _hf_logits(hf, prompt + toks)
    err = max((first - ref[: len(prompt)]).abs().max(), (steps - ref[len(prompt) :]).abs().max())
    assert err < rel * ref.abs().max()
    if kv_dtype != "fp16":
        assert kv.stats()["quantized_blocks"] > 0


@pytest.mark.slow
def test_smollm2_matches_hf(one_thread):
    """SmolLM2-135M-Instruct from the model directory: a chat-templated prompt and 16 greedy
    tokens through the cache, logits within 1e-4 of HF's cache-free forward (measured 5.7e-5
    at logits up to 38; HF's own DynamicCache decode differs from its cache-free forward by
    5.0e-5 here, so 1e-4 is near the fp32 floor for 30 layers, not a loose bound)."""
    from node.models import smollm2 as models

    try:
        loaded = models.load(verify_hashes=False)
    except models.ModelMissingError:
        pytest.skip(f"no converted model: run `{models.FETCH_COMMAND}`")
    tok = loaded.tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is federated learning?"}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    ids = list(ids)
    ours = LlamaModel.from_state_dict(LlamaConfig.from_hf(loaded.config), loaded.state_dict)
    kv = KVCache(ours.cache_config(pool_bytes=64 << 20))
    first, steps, toks, _, _ = _decode(ours, kv, ids, 16)
    hf = transformers.LlamaForCausalLM.from_pretrained(loaded.path, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    ref = _hf_logits(hf, ids + toks)
    assert (first - ref[: len(ids)]).abs().max() < TOL
    assert (steps - ref[len(ids) :]).abs().max() < TOL
    assert toks == ref[len(ids) - 1 : -1].argmax(-1).tolist()


# -- behind the node's model interface (CachedLM): Sessions drive it ---------------------------

def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF's own greedy ``generate`` (its DynamicCache), never stopping early."""
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_is_a_cached_lm_with_a_cache_free_forward_and_loss_like_hf(tiny):
    from node.models.interface import CachedLM

    hf, ours = tiny
    assert isinstance(ours, CachedLM) and ours.context_len == 512
    assert not hasattr(ours, "generate")  # no decode loop of its own: node.engine.sessions samples
    names = ours.parameter_layout().names
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: once
    assert len(names) == len(hf.state_dict()) - 1
    batch = torch.randint(0, 128, (3, 25), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(batch, use_cache=False)
        assert (ours(batch) - ref.logits).abs().max() < TOL
        ref_loss = hf(batch[:, :-1], labels=batch[:, :-1], use_cache=False).loss
    # HF shifts its labels inside; ours takes [B, T + 1] (inputs [:, :-1], targets [:, 1:])
    loss = ours.train_loss(batch[:, :-1])
    assert loss.requires_grad and abs(loss.item() - ref_loss.item()) < 1e-5


def test_session_turns_equal_hf_greedy_generate_token_for_token(tiny):
    """Sessions.turn (the node's one decode loop) over the cache: a system prompt, a turn and
    a second turn on top of the first reply, each equal to HF's greedy generate of the whole
    conversation so far."""
    from node.engine.sessions import Sessions

    hf, ours = tiny
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 128, (2 * BLOCK + 3,), generator=g).tolist()
    user1 = torch.randint(0, 128, (7,), generator=g).tolist()
    user2 = torch.randint(0, 128, (4,), generator=g).tolist()
    chats = Sessions(ours, KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20)))
    s = chats.create(system)
    r1 = chats.turn(s, user1, 12)
    assert list(r1.tokens) == _hf_greedy(hf, system + user1, 12)
    r2 = chats.turn(s, user2, 10)
    history = system + user1 + list(r1.tokens) + user2
    assert list(r2.tokens) == _hf_greedy(hf, history, 10)
    assert chats.tokens(s) == history + list(r2.tokens)
    ref = _hf_logits(hf, history)  # the turn's text log-loss is HF's too
    nll = torch.nn.functional.cross_entropy(ref[-len(user2) - 1 : -1], torch.tensor(user2),
                                            reduction="sum")
    assert abs(r2.nll - float(nll)) < 1e-4 and r2.scored == len(user2)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_batched_turns_sharing_a_system_prompt_equal_one_at_a_time(tiny, kv_dtype):
    """4 sessions with one system prompt (3 full blocks, shared in the cache) and their own
    questions: ``turn_batch`` (one ``forward_batch`` per step, the prefix attended once for
    all sessions and query heads) replies exactly as ``turn`` does for each alone."""
    from node.engine.sessions import Sessions

    _, ours = tiny
    g = torch.Generator().manual_seed(6)
    system = torch.randint(0, 128, (3 * BLOCK + 2,), generator=g).tolist()
    questions = [torch.randint(0, 128, (1 + 2 * i,), generator=g).tolist() for i in range(4)]

    def cache():
        return KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20, kv_dtype=kv_dtype))

    kv = cache()
    chats = Sessions(ours, kv)
    ids = [chats.create(system) for _ in questions]
    assert kv.stats()["blocks_shared"] >= 3
    together = chats.turn_batch(ids, questions, 12)
    alone = []
    for q in questions:
        one = Sessions(ours, cache())
        alone.append(one.turn(one.create(system), q, 12))
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert all(abs(a.nll - b.nll) < 1e-4 for a, b in zip(together, alone))
    assert [chats.tokens(s) for s in ids] == [system + q + list(r.tokens)
                                             for q, r in zip(questions, together)]
    assert len({r.tokens for r in together}) > 1  # the sessions' own tails matter


def test_batched_step_logits_match_hf(tiny):
    """forward_batch's logits for sessions of different lengths (a shared prefix, own tails)
    against HF's cache-free forward of each sequence."""
    hf, ours = tiny
    kv = KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, 128, (2 * BLOCK,), generator=g).tolist()
    seqs = [system + torch.randint(0, 128, (1 + 3 * i,), generator=g).tolist() for i in range(3)]
    sids = [kv.open_session() for _ in seqs]
    for sid, seq in zip(sids, seqs):
        ours.prefill(seq, kv, sid)
    worst = 0.0
    for _ in range(5):
        toks = torch.randint(0, 128, (len(sids),), generator=g).tolist()
        logits = ours.forward_batch(toks, kv, sids)
        for i, t in enumerate(toks):
            seqs[i].append(t)
            worst = max(worst, float((logits[i] - _hf_logits(hf, seqs[i])[-1]).abs().max()))
    assert worst < TOL


def test_sparse_session_attends_what_its_policy_keeps(tiny):
    """A heavy-hitter policy whose budget holds everything keeps the dense logits (the policy
    observes one row of weights per query head); a sliding window drops old positions."""
    from cache.sparsity import SlidingWindow, TopKRetention

    _, ours = tiny
    prompt = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(8)).tolist()

    def run(policy):
        kv = KVCache(ours.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
        sid = kv.open_session(policy)
        logits = [ours.forward_cached(prompt, kv, sid)[-1]]
        for _ in range(6):
            logits.append(ours.forward_cached([int(logits[-1].argmax())], kv, sid)[-1])
        return torch.stack(logits), kv, sid

    dense, _, _ = run(None)
    full, _, _ = run(TopKRetention(budget=64, recent=4, sinks=2))
    assert (full - dense).abs().max() < 1e-5
    window, kv, sid = run(SlidingWindow(window=8, sinks=2))
    assert torch.isfinite(window).all()
    assert len(kv.resident_positions(sid, 0)) < kv.length(sid)


def _greedy_logits(model: LlamaModel, prompt: list[int], steps: int) -> torch.Tensor:
    kv = KVCache(model.cache_config(block_size=BLOCK, pool_bytes=1 << 20))
    first, logits, _, _, _ = _decode(model, kv, prompt, steps)
    return torch.cat([first, logits])


def test_fused_weights_are_the_parameters_and_the_state_dict_is_hfs(tiny):
    """q/k/v (gate/up) are views of one fused matrix, so decode's one matmul reads the very
    parameters: an in-place update of q_proj (an optimizer step) reaches the fused path, and
    the state dict still holds HF's names and values."""
    hf, ours = tiny
    m = copy.deepcopy(ours)
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    assert attn.qkv.fused.weight() is None  # autograd on: the module path
    with torch.no_grad():
        w, gu = attn.qkv.fused.weight(), mlp.gate_up.fused.weight()
        assert w is not None and gu is not None
        assert w.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
        assert torch.equal(w[:, :64], attn.q_proj.weight.t())
        ref = hf.state_dict()
        for name, t in m.state_dict().items():
            assert torch.equal(t, ref[name]), name
        prompt = list(range(5, 30))
        before = _greedy_logits(m, prompt, 2)
        attn.q_proj.weight.mul_(1.5)
        after = _greedy_logits(m, prompt, 2)
        hf2 = copy.deepcopy(hf)
        hf2.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        assert (before - after).abs().max() > 1e-3
        assert (after[: len(prompt)] - _hf_logits(hf2, prompt)).abs().max() < TOL


class _Delta(torch.nn.Module):
    """A stand-in for a LoRA wrapper: the base linear plus a fixed low-rank delta."""

    def __init__(self, base: torch.nn.Linear, scale: float):
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(9)
        self.a = torch.randn(base.in_features, 2, generator=g)
        self.b = scale * torch.randn(2, base.out_features, generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a @ self.b


def test_an_adapter_on_q_and_v_is_used_by_decode(tiny):
    """Replacing q_proj/v_proj with a wrapper turns the fused path off for that layer: a zero
    delta decodes like the plain model, a non-zero one like the same model without fusion."""
    _, ours = tiny
    prompt = list(range(7, 31))
    plain = _greedy_logits(ours, prompt, 4)
    for scale in (0.0, 0.5):
        m = copy.deepcopy(ours)
        for layer in m.model.layers:
            layer.self_attn.q_proj = _Delta(layer.self_attn.q_proj, scale)
            layer.self_attn.v_proj = _Delta(layer.self_attn.v_proj, scale)
        with torch.no_grad():
            assert m.model.layers[0].self_attn.qkv.fused.weight() is None
        got = _greedy_logits(m, prompt, 4)
        if scale == 0.0:
            assert (got - plain).abs().max() < 1e-5
        else:  # reference: the cache-free forward, which always calls the modules
            seq = prompt + got[len(prompt) - 1 : -1].argmax(-1).tolist()
            with torch.no_grad():
                ref = m(torch.tensor([seq]))[0]
            assert (got - plain).abs().max() > 1e-2 and (got - ref).abs().max() < TOL


def test_a_replaced_parameter_is_fused_again_and_decode_reads_it(tiny):
    """A new k_proj/gate_proj parameter (its storage no longer the fused matrix: what a
    dtype change, ``deepcopy`` or an assignment does) is fused again before decode uses the
    matrix, so decode reads the new weights and matches HF with the same change."""
    hf, ours = tiny
    m, hf2 = copy.deepcopy(ours), copy.deepcopy(hf)
    for model in (m, hf2):
        layer = model.model.layers[1]
        for mod in (layer.self_attn.k_proj, layer.mlp.gate_proj):
            mod.weight = torch.nn.Parameter(mod.weight.detach() * 1.3)
    prompt = list(range(2, 27))
    with torch.no_grad():
        ref = _hf_logits(hf2, prompt)
        assert (ref - _hf_logits(hf, prompt)).abs().max() > 1e-3
    assert (_greedy_logits(m, prompt, 1)[: len(prompt)] - ref).abs().max() < TOL
    attn = m.model.layers[1].self_attn
    with torch.no_grad():
        w = attn.qkv.fused.weight()
    assert w.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(w[:, 64:96], attn.k_proj.weight.t())


def test_rope_table_rows_are_the_computed_values(tiny):
    _, ours = tiny
    rot = ours.model.rotary_emb
    cos, sin = rot.table(300, torch.float32)
    want_cos, want_sin = rot(torch.arange(300))
    assert cos.shape[0] >= 300 and torch.equal(cos[:300], want_cos)
    assert torch.equal(sin[:300], want_sin)


def test_refusing_under_inference_mode_keeps_the_model_trainable(tiny):
    """A re-fuse (here after deepcopy) first met inside ``torch.inference_mode`` must not turn
    the parameters into inference tensors: the cache-free loss still backpropagates."""
    _, ours = tiny
    m = copy.deepcopy(ours)
    with torch.inference_mode():
        _greedy_logits(m, list(range(4, 20)), 1)
    batch = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    m.train_loss(batch).backward()
    assert m.model.layers[0].self_attn.q_proj.weight.grad.abs().max() > 0


def test_a_bf16_rms_norm_equals_hfs_normalize_in_fp32_round_then_scale():
    """A bf16 model's RMSNorm gives what HF's LlamaRMSNorm gives (normalize in fp32, round to
    bf16, multiply by the bf16 weight); torch's one-call bf16 kernel with the weight rounds
    once and differs by an ulp in a quarter of the values, so it is not used."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from node.models.llama import RMSNorm
    g = torch.Generator().manual_seed(0)
    ours, hf = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(576, generator=g))
        hf.weight.copy_(ours.weight)
    ours, hf = ours.to(torch.bfloat16), hf.to(torch.bfloat16)
    x = (torch.randn(64, 576, generator=g) * 3).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))
