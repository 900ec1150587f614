"""node.engine.structured_output: OpenAI's ``response_format`` as a grammar mask on each token, and
the server's ``logprobs`` / ``response_format`` through the official ``openai`` client."""

from __future__ import annotations

import builtins
import json
import math

import pytest
import torch

from node.engine.sampling import Sampler, SamplingParams
from node.engine import structured_output as so

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "size"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def _generate(grammar, vocab: int, seed: int, n: int = 200) -> bytes:
    """Random logits through a grammar-constrained sampler until it stops (bytes vocabulary)."""
    s = Sampler(SamplingParams(temperature=1.0, grammar=grammar), (), seed)
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        tok = s.pick(torch.randn(vocab, generator=g) * 3)
        if tok is None:
            return bytes(out)
        out.append(int(tok))
    raise AssertionError(f"no end after {n} tokens: {bytes(out)!r}")


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_under_a_schema_give_valid_json(seed):
    grammar = so.GrammarCompiler.for_bytes(256).compile(so.parse_response_format(JSON_SCHEMA))
    doc = json.loads(_generate(grammar, 256, seed))
    jsonschema.validate(doc, SCHEMA)


def test_json_object_gives_an_object():
    grammar = so.GrammarCompiler.for_bytes(256).compile(
        so.parse_response_format({"type": "json_object"}))
    assert isinstance(json.loads(_generate(grammar, 256, 3, n=2000)), dict)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "xml"}, "response_format.type"), ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
     "response_format.json_schema.schema")])
def test_bad_response_formats_are_refused_naming_the_field(fmt, param):
    with pytest.raises(so.FormatError) as e:
        so.GrammarCompiler.for_bytes(256).compile(so.parse_response_format(fmt))
    assert e.value.param == param


def test_text_format_is_no_constraint():
    assert so.parse_response_format({"type": "text"}) is None
    assert so.parse_response_format(None) is None


def test_without_the_library_the_error_says_what_to_install(monkeypatch):
    real = builtins.__import__

    def no_llguidance(name, *a, **kw):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(so.StructuredOutputUnavailable, match="pip install"):
        so.GrammarCompiler.for_bytes(256)


# -- the live server ---------------------------------------------------------------------------
openai = pytest.importorskip("openai")
from tests.node.serving.test_openai_api import (MESSAGES, byte_server, client,  # noqa: E402,F401
                                        llama_parts, serving)


SHORT = [{"role": "user", "content": "JSON, please."}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_through_the_client(byte_server, stream):
    c = client(byte_server)
    kw = dict(model="fedkv-byte", messages=SHORT, max_tokens=60, response_format=JSON_SCHEMA,
              temperature=0.8, seed=4, n=2)
    if stream:
        texts = ["", ""]
        for chunk in c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
    else:
        r = c.chat.completions.create(**kw)
        texts = [ch.message.content for ch in r.choices]
        assert {ch.finish_reason for ch in r.choices} == {"stop"}
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_response_format_with_a_tokenizer_model(llama_parts):
    model, codec = llama_parts
    with serving(model, codec, "tiny-llama", backend="scheduler") as s:
        r = client(s).chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                              max_tokens=120, response_format=JSON_SCHEMA)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_without_the_library_response_format_is_a_clear_400(byte_server, monkeypatch):
    real = builtins.__import__

    def no_llguidance(name, *a, **kw):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(openai.BadRequestError) as e:
        client(byte_server).chat.completions.create(model="fedkv-byte", messages=SHORT,
                                                    response_format=JSON_SCHEMA)
    assert e.value.body["param"] == "response_format" and "pip install" in e.value.body["message"]


def test_chat_logprobs_come_back_in_the_clients_objects(byte_server):
    r = client(byte_server).chat.completions.create(
        model="fedkv-byte", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3)
    content = r.choices[0].logprobs.content
    spelled = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    assert len(content) == 8 and spelled == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert math.isclose(t.logprob, tops[0], abs_tol=1e-6)  # greedy: the chosen is the top


def test_streamed_chat_logprobs_cover_every_token(byte_server):
    chunks = client(byte_server).chat.completions.create(
        model="fedkv-byte", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
        stream=True)
    got = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert len(got) == 8 and all(t.top_logprobs == [] for t in got)


def test_completion_logprobs_in_the_legacy_shape(byte_server):
    r = client(byte_server).completions.create(model="fedkv-byte", prompt="Hello", max_tokens=6,
                                               temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6  # a byte of a partial character: U+FFFD
    assert "".join(lp.tokens).replace("\ufffd", "") == r.choices[0].text.replace("\ufffd", "")
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(d) == 2 and max(d.values()) == pytest.approx(x)
               for d, x in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.parametrize("kw, param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"top_k": 0}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"response_format": {"type": "yaml"}}, "response_format.type")])
def test_bad_sampling_fields_are_400(byte_server, kw, param):
    body = {k: v for k, v in kw.items() if k in ("logprobs", "top_logprobs", "presence_penalty",
                                                   "frequency_penalty", "response_format")}
    extra = {k: v for k, v in kw.items() if k not in body}
    with pytest.raises(openai.BadRequestError) as e:
        client(byte_server).chat.completions.create(model="fedkv-byte", messages=MESSAGES,
                                                    extra_body=extra, **body)
    assert e.value.body["param"] == param


def test_penalties_and_top_k_change_the_reply(byte_server):
    c = client(byte_server)
    kw = dict(model="fedkv-byte", messages=MESSAGES, max_tokens=16, temperature=0)
    plain = c.chat.completions.create(**kw).choices[0].message.content
    penal = c.chat.completions.create(frequency_penalty=2.0, presence_penalty=2.0,
                                      extra_body={"repetition_penalty": 2.0, "top_k": 5,
                                                  "min_p": 0.05}, **kw)
    assert penal.choices[0].message.content != plain


@pytest.mark.slow
def test_smollm2_answers_in_the_schema_with_logprobs(one_thread):
    from node.models import smollm2 as models
    from node.models.chat import ChatCodec
    from node.models.llama import LlamaModel
    d = models.default_dir()
    if not (d / "model.safetensors").is_file():
        pytest.skip("python -m node.models.smollm2 fetch has not been run")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    with serving(LlamaModel.from_pretrained(d).eval(), ChatCodec.from_dir(d), "smollm2",
                 pool_bytes=64 << 20, backend="scheduler") as s:
        r = client(s, timeout=600).chat.completions.create(
            model="smollm2", max_tokens=40, temperature=0, logprobs=True, top_logprobs=2,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    choice = r.choices[0]
    jsonschema.validate(json.loads(choice.message.content), schema)
    assert choice.finish_reason == "stop"
    spelled = b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode()
    assert spelled == choice.message.content and all(len(t.top_logprobs) == 2
                                                     for t in choice.logprobs.content)


def test_a_refused_token_stops_the_sample_instead_of_raising():
    grammar = so.GrammarCompiler.for_bytes(256).compile(so.parse_response_format(JSON_SCHEMA))
    m = grammar.matcher()
    m.accept(ord("x"))  # not JSON: refused
    assert m.failed and m.mask(torch.zeros(256)) is None
