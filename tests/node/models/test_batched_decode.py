"""Batched multi-session decode (issue 9 item 5): one forward per step for B sessions of
different lengths, shared prefixes attended once, equal to full recomputation."""

import pytest
import torch

from cache import KVCache, ShapeMismatchError
from node.models.byte_model import ModelConfig, TinyTransformer
from node.engine.sessions import Sessions


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig(n_layers=2, n_heads=2, d_model=32, context_len=256)).eval()


def cache_for(model, **kw) -> KVCache:
    return KVCache(model.cfg.cache_config(block_size=4, pool_bytes=4 << 20, **kw))


def full_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]))[0, -1]


def decode_batched_and_compare(model, kv, sids, seqs, steps=6):
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(steps):
        toks = torch.randint(0, 256, (len(sids),), generator=g).tolist()
        logits = model.forward_batch(toks, kv, sids)
        for i, t in enumerate(toks):
            seqs[i].append(t)
            worst = max(worst, float((logits[i] - full_logits(model, seqs[i])).abs().max()))
    return worst


def test_batched_decode_with_a_shared_prefix_equals_full_recomputation(model):
    kv = cache_for(model)
    prefix = list(range(30, 62))  # 8 full blocks
    seqs = [prefix + list(range(i + 1)) for i in range(5)]  # tails of 1..5 tokens
    sids = []
    for s in seqs:
        sids.append(kv.open_session())
        model.prefill(s, kv, sids[-1])
    assert kv.stats()["blocks_shared"] >= 7  # the prefix is held once
    assert decode_batched_and_compare(model, kv, sids, seqs) <= 1e-4


def test_batched_decode_with_forks_and_unrelated_sessions(model):
    kv = cache_for(model)
    a = kv.open_session()
    model.prefill(list(range(23)), kv, a)
    b = kv.fork(a)  # shares every block, including the partial tail (copy-on-write)
    c = kv.open_session()
    model.prefill([5, 6, 7], kv, c)  # nothing shared with a and b
    seqs = [list(range(23)), list(range(23)), [5, 6, 7]]
    assert decode_batched_and_compare(model, kv, [a, b, c], seqs, steps=7) <= 1e-4
    assert kv.stats()["cow_copies"] >= 1


def test_batched_turns_equal_one_session_at_a_time(model):
    prompts = [bytes(list(range(40)) + [i] * (i + 1)) for i in range(4)]
    kv = cache_for(model, kv_dtype="int8", fp_window=8)
    chats = Sessions(model, kv)
    ids = [chats.create() for _ in prompts]
    together = chats.turn_batch(ids, prompts, 10)
    alone = []
    for p in prompts:
        one = Sessions(model, cache_for(model, kv_dtype="int8", fp_window=8))
        alone.append(one.turn(one.create(), p, 10))
    assert [r.reply for r in together] == [r.reply for r in alone]
    assert together[0].scored == alone[0].scored  # later prompts take the shared prefix cached
    assert [chats.history(s) for s in ids] == [p + r.reply for p, r in zip(prompts, together)]
    for s in ids:
        chats.close(s)
    assert kv.stats()["sessions_open"] == 0


def test_a_batched_turn_goes_on_from_where_each_session_is(model):
    """Sessions of different lengths, one of them stale after a write-back: the batched turn
    feeds each its text (recomputing the stale one) and decodes them together, exactly as
    one turn after another does on a cache of its own (fp32)."""
    def script(batched: bool) -> list[bytes]:
        chats = Sessions(model, cache_for(model))
        ids = [chats.create(b"system prompt " * 3) for _ in range(3)]
        chats.send(ids[0], b"first turn", 5)
        chats.cache.bump_version()
        chats.send(ids[1], b"x", 3)  # recomputed now; ids[0] and ids[2] stay stale
        texts = [b"again", b"", b"hello"]
        if batched:
            return [r.reply for r in chats.turn_batch(ids, texts, 6)]
        return [chats.send(s, t, 6) for s, t in zip(ids, texts)]

    assert script(batched=True) == script(batched=False)


def test_batched_turn_refusals_leave_the_sessions_alone(model):
    chats = Sessions(model, cache_for(model))
    a, b = chats.create(b"abc"), chats.create(b"abc")
    for bad, match in [(([a, a], [b"x", b"y"], 2), "once"), (([a, b], [b"x"], 2), "texts"),
                       (([a, b], [b"x", b"y"], -1), "max_new_tokens"),
                       (([a, b], [b"x", b"y"], 300), "context_len")]:
        with pytest.raises(ValueError, match=match):
            chats.turn_batch(*bad)
    assert chats.history(a) == chats.history(b) == b"abc"
    assert chats.turn_batch([], [], 4) == []


def test_batch_errors_name_the_problem(model):
    kv = cache_for(model)
    s = kv.open_session()
    model.prefill([1, 2, 3], kv, s)
    with pytest.raises(ShapeMismatchError, match="one token per distinct session"):
        kv.begin_batch([s, s], [1, 2])
    with pytest.raises(ShapeMismatchError, match="one token per distinct session"):
        kv.begin_batch([s], [1, 2])


def test_batched_decode_after_reset_and_refill_to_the_same_length_attends_the_new_tokens(model):
    """Issue 22 0a: a session reset and refilled (same first block, other tokens after it) to
    the length it had must not continue the previous step's tail buffer."""
    kv = cache_for(model)
    a, b = kv.open_session(), kv.open_session()
    seqs = [list(range(100, 110)), list(range(10))]
    model.prefill(seqs[0], kv, a)
    model.prefill(seqs[1], kv, b)
    decode_batched_and_compare(model, kv, [a, b], seqs, steps=2)  # the buffer now holds b
    kv.reset_session(b)
    seqs[1] = seqs[1][:4] + [200 + i for i in range(len(seqs[1]) - 4)]  # block 0 cached
    model.prefill(seqs[1], kv, b)
    assert kv.stats()["prefix_hit_blocks"] >= 1  # the same first tail block as before
    assert decode_batched_and_compare(model, kv, [a, b], seqs, steps=3) <= 1e-4


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_prefix_another_session_quantized_moves_logits_within_the_documented_bound(model, dtype):
    """Issue 22 0, "decide and test": a prefix-cache hit attaches the prefix as cached (here
    quantized by another session), a cold prefill attends its own K/V at full precision in
    the layers before the last; the difference is inherent (Pressure.quantize_old documents
    it) and bounded: no more than 3x what quantization moves a cold prefill's logits."""
    prompts = [list(range(40)) + [i] * (i + 1) for i in range(4)]
    warm = cache_for(model, kv_dtype=dtype, fp_window=8)
    model.prefill(prompts[0], warm, warm.open_session())  # quantizes the shared prefix
    assert warm.stats()["quantized_blocks"] >= 8
    hit_vs_cold, cold_vs_exact = [], []
    for p in prompts[1:]:
        hits = warm.stats()["prefix_hit_blocks"]
        hit = model.prefill(p, warm, warm.open_session())
        assert warm.stats()["prefix_hit_blocks"] - hits == 10
        cold_kv = cache_for(model, kv_dtype=dtype, fp_window=8)
        cold = model.prefill(p, cold_kv, cold_kv.open_session())
        hit_vs_cold.append(float((hit - cold).abs().max()))
        cold_vs_exact.append(float((cold - full_logits(model, p)).abs().max()))
    assert max(hit_vs_cold) > 0  # the difference is real, not an artefact of the test
    assert max(hit_vs_cold) <= 3 * max(cold_vs_exact)


def test_batched_decode_stays_exact_as_sessions_leave_join_and_reorder(model):
    """Tail slots (cache.batch.TailBuffer): rows that continue append, new rows gather into
    a free slot, and the logits still equal full recomputation in every step."""
    kv = cache_for(model)
    prefix = list(range(40, 56))
    seqs = {}
    for i in range(5):
        sid = kv.open_session()
        seqs[sid] = prefix + list(range(i + 2))
        model.prefill(seqs[sid], kv, sid)
    ids = list(seqs)
    g = torch.Generator().manual_seed(3)
    worst, steps, begin = 0.0, [], kv.begin_batch
    kv.begin_batch = lambda s, t: steps.append(begin(s, t)) or steps[-1]
    for members in ([0, 1, 2], [0, 1, 2], [1, 2, 3], [3, 2, 1], [4, 3, 0, 2], [2, 4]):
        sids = [ids[m] for m in members]
        toks = torch.randint(0, 256, (len(sids),), generator=g).tolist()
        logits = model.forward_batch(toks, kv, sids)
        for i, (sid, t) in enumerate(zip(sids, toks)):
            seqs[sid].append(t)
            worst = max(worst, float((logits[i] - full_logits(model, seqs[sid])).abs().max()))
    assert worst <= 1e-4
    assert any(s.rows is not None for s in steps)  # rows read from slots out of row order
    assert any(0 < len(s.gather) < len(s.sids) for s in steps)  # a joiner gathered alone


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_a_new_tail_buffer_never_reads_memory_it_did_not_write(model, monkeypatch, kv_dtype):
    """The tail buffer is allocated uninitialized and zeroed only where nothing is gathered:
    with every fresh allocation poisoned (NaN), the batch's logits are still those of an
    unpoisoned run (int8: quantized blocks take the decode-per-row path)."""
    def run(poison: bool):
        kv = cache_for(model, kv_dtype=kv_dtype, fp_window=4)
        sids = []
        for i, n in enumerate((3, 29, 11)):
            sids.append(kv.open_session())
            model.prefill([(7 * i + j) % 256 for j in range(n)], kv, sids[-1])
        real = torch.empty

        def poisoned(*a, **k):
            t = real(*a, **k)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        if poison:
            monkeypatch.setattr(torch, "empty", poisoned)
        out = [model.forward_batch([1, 2, 3], kv, sids), model.forward_batch([4, 5], kv, sids[1:])]
        monkeypatch.undo()
        return out
    got, want = run(True), run(False)
    assert all(torch.isfinite(g).all() for g in got)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
