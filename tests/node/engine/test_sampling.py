"""node.engine.sampling: the per-token processors (penalties, top-k, top-p, min-p), seeded sampling,
logprobs, and the two backends carrying a request's ``SamplingParams`` to every token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import KVCache
from node.engine.generation import GenerationRequest
from node.engine.sampling import (SamplingParams, Sampler, apply_min_p, apply_penalties, apply_top_k,
                           apply_top_p, greedy, top_logprobs)
from node.engine.scheduler_backend import ScheduledBackend
from node.engine.serial_backend import SerialBackend
from tests.tiny_models import tiny_llama

V = 32
floats = st.lists(st.floats(-20, 20, allow_nan=False), min_size=V, max_size=V)
tokens = st.lists(st.integers(0, V - 1), max_size=12)


def _probs(values) -> torch.Tensor:
    return torch.softmax(torch.tensor(values), -1)


# -- the processors ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(floats, tokens, tokens, st.floats(-2, 2), st.floats(-2, 2), st.floats(0.1, 3))
def test_penalties_match_vllm_semantics(values, prompt, output, presence, frequency, rep):
    logits = torch.tensor(values)
    got = apply_penalties(logits, prompt, output, presence, frequency, rep)
    for t in range(V):
        want = values[t]
        if t in prompt or t in output:  # HF's repetition penalty: prompt and output
            want = want / rep if want > 0 else want * rep
        n = output.count(t)  # OpenAI's presence/frequency: the output only
        want -= frequency * n + presence * (n > 0)
        assert math.isclose(float(got[t]), want, rel_tol=1e-5, abs_tol=1e-4)


def test_neutral_penalties_return_the_logits_untouched():
    logits = torch.randn(V)
    assert apply_penalties(logits, [1, 2], [3, 3], 0.0, 0.0, 1.0) is logits


@settings(max_examples=60, deadline=None)
@given(floats, st.integers(1, V))
def test_top_k_keeps_the_k_most_likely(values, k):
    p = _probs(values)
    kept = apply_top_k(p, k)
    assert int((kept > 0).sum()) <= k
    assert float(kept.max()) == float(p.max())
    cut = p.sort(descending=True).values[k - 1]
    assert bool(((kept > 0) == (p >= cut)).all()) or int((p == cut).sum()) > 1  # ties aside


def test_top_k_minus_one_or_vocab_keeps_all():
    p = _probs(torch.randn(V).tolist())
    assert torch.equal(apply_top_k(p, -1), p) and torch.equal(apply_top_k(p, V + 5), p)


@settings(max_examples=60, deadline=None)
@given(floats, st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(values, top_p):
    p = _probs(values)
    kept = apply_top_p(p, top_p)
    s = p.sort(descending=True).values
    n = int((kept > 0).sum())
    assert n >= 1 and float(s[: n - 1].sum()) < top_p + 1e-6  # without the last: below p
    assert float(s[:n].sum()) >= min(top_p, float(s.sum())) - 1e-5  # with it: reaches p


@settings(max_examples=60, deadline=None)
@given(floats, st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_above_min_p_times_the_top(values, min_p):
    p = _probs(values)
    kept = apply_min_p(p, min_p)
    assert bool(((kept > 0) == (p >= min_p * p.max())).all())
    assert float(kept.max()) == float(p.max())


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0), dict(top_k=0),
                                dict(top_k=-2), dict(min_p=1.5), dict(presence_penalty=2.5),
                                dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                dict(logprobs=21), dict(logprobs=-1), dict(top_p=float("nan"))])
def test_params_out_of_range_are_refused_naming_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]),
                min_size=1, max_size=9),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.integers(1, 3))
def test_greedy_is_the_first_largest_as_torch_max_takes_it(values, dtype, rows):
    """Ties, infinities and NaN (largest, as torch.max has it) pick what ``max``'s indices pick,
    in every dtype (numpy's argmax for fp32/fp64, ``max`` for the rest) and shape."""
    x = torch.tensor([values] * rows, dtype=dtype)
    for t in (x, x[0], x.t().contiguous().t()):
        assert torch.equal(greedy(t), t.max(-1).indices)
    assert greedy(x).dtype == torch.int64


def test_greedy_reads_a_tensor_that_needs_grad():
    x = torch.randn(2, V, requires_grad=True)
    assert torch.equal(greedy(x * 2), (x * 2).max(-1).indices)


def test_defaults_are_openais():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, p.logprobs) == (1.0, 1.0, -1, 0.0, 0.0, 0.0, 1.0, None)


def test_a_seeded_sampler_repeats_and_top_k_one_is_greedy():
    logits = torch.randn(V)
    draw = lambda seed, **kw: [Sampler(SamplingParams(**kw), (), seed).pick(logits)  # noqa: E731
                               for _ in range(1)]
    assert draw(7) == draw(7)
    assert draw(3, top_k=1) == [int(logits.argmax())]
    assert draw(3, min_p=1.0) == [int(logits.argmax())]


def test_logprobs_are_the_raw_log_softmax_and_top_is_sorted():
    logits = torch.randn(V) * 3
    s = Sampler(SamplingParams(temperature=0.5, top_k=3, logprobs=5), (), 1)
    tok = s.pick(logits)
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(tok.logprob, float(ref[tok]), abs_tol=1e-5)
    assert len(tok.top_logprobs) == 5
    lps = [lp for _, lp in tok.top_logprobs]
    assert lps == sorted(lps, reverse=True)
    assert [i for i, _ in tok.top_logprobs] == ref.topk(5).indices.tolist()
    assert top_logprobs(ref, 0) == ()


# -- through the backends on a tiny model ------------------------------------------------------
PROMPT = (5, 9, 5, 9, 17, 3)


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_llama(std=0.2, vocab_size=64, max_position_embeddings=128)


def _reference(model, params: SamplingParams, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with penalties by full forwards (no cache): the tokens and each step's
    raw logits."""
    ids, out, steps = list(PROMPT), [], []
    with torch.no_grad():
        for _ in range(n):
            raw = model(torch.tensor([ids]))[0, -1]
            steps.append(raw)
            logits = apply_penalties(raw, PROMPT, out, params.presence_penalty,
                                     params.frequency_penalty, params.repetition_penalty)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out, steps


def _run(kind, model, params: SamplingParams, n: int):
    cls = {"serial": SerialBackend, "scheduler": ScheduledBackend}[kind]
    backend = cls(model, KVCache(model.cache_config(pool_bytes=1 << 20)))
    try:
        (h,) = backend.submit(GenerationRequest(PROMPT, n, params))
        return list(h.tokens(timeout=30)), h
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["serial", "scheduler"])
def test_greedy_with_penalties_follows_the_reference(model, kind):
    plain, _ = _reference(model, SamplingParams(temperature=0), 12)
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=1.0,
                            repetition_penalty=1.5)
    want, _ = _reference(model, params, 12)
    assert want != plain  # the penalties change this model's greedy tokens
    got, _ = _run(kind, model, params, 12)
    assert got == want


@pytest.mark.parametrize("kind", ["serial", "scheduler"])
def test_each_token_carries_its_logprob_and_top_logprobs(model, kind):
    params = SamplingParams(temperature=0, logprobs=4)
    got, _ = _run(kind, model, params, 6)
    want, steps = _reference(model, params, 6)
    assert got == want
    for tok, raw in zip(got, steps):
        ref = torch.log_softmax(raw.float(), -1)
        assert math.isclose(tok.logprob, float(ref[tok]), abs_tol=1e-4)
        assert [i for i, _ in tok.top_logprobs] == ref.topk(4).indices.tolist()
        assert all(math.isclose(lp, float(ref[i]), abs_tol=1e-4) for i, lp in tok.top_logprobs)
