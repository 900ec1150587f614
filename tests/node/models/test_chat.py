"""Issue 23 item 3: sessions speak the model's language (``node.models.chat``).

On the byte model (the lm task's tiny model, the default product model): no codec, the identity
``ByteCodec`` and ``Sampling(temperature=0)`` all give today's greedy bytes; an EOS id and a stop
string end a reply (the cache keeps what was fed); a seeded top-p sample repeats. On
SmolLM2-135M-Instruct (skipped when ``python -m node.models.smollm2 fetch`` has not been run): the
tokens a session feeds are ``tokenizer.apply_chat_template`` of the same conversation, two
sessions with one system prompt share its full blocks, and the reply ends at ``<|im_end|>``.
"""

from __future__ import annotations

import pytest
import torch

from cache import KVCache
from node.cache_node import CacheNode, NodeSpec
from node.models.chat import ByteCodec
from node.engine.sessions import Sampling
from node.engine.sessions import Sessions
from node.tasks.tasks import make_task

SYSTEM = b"# You are a helpful Python assistant.\n"


@pytest.fixture(scope="module")
def lm_task(one_thread):
    return make_task("lm", 0, 3, 42, 1.0)


def _sessions(lm_task, codec=None) -> Sessions:
    node = CacheNode(NodeSpec(partition_id=0, num_partitions=3, task="lm"), task=lm_task)
    return Sessions(node.model, node.cache, codec)


def _greedy(chats: Sessions, text=b"def add(a, b):\n", n=12, **kw):
    sid = chats.create(SYSTEM)
    return chats, sid, chats.turn(sid, text, n, **kw)


# -- sampling -----------------------------------------------------------------------------
def test_temperature_zero_is_argmax_and_top_p_tiny_is_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert Sampling().pick(logits) == Sampling(temperature=0.0).pick(logits) == int(logits.argmax())
    g = torch.Generator().manual_seed(1)
    assert all(Sampling(1.0, 1e-6, g).pick(logits) == int(logits.argmax()) for _ in range(20))
    with pytest.raises(ValueError):
        Sampling(temperature=-1)
    with pytest.raises(ValueError):
        Sampling(top_p=0)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(2)
    picks = {Sampling(1.0, 0.7, g).pick(logits) for _ in range(200)}
    assert picks == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it: the 0.15 and 0.05 never drawn


# -- the byte model: nothing changes -------------------------------------------------------
def test_byte_model_unchanged_by_codec_and_temperature_zero(lm_task):
    _, _, plain = _greedy(_sessions(lm_task))
    _, _, ident = _greedy(_sessions(lm_task, ByteCodec()))
    _, _, zero = _greedy(_sessions(lm_task), sampling=Sampling(temperature=0.0))
    assert plain.tokens == ident.tokens == zero.tokens and len(plain.tokens) == 12
    assert plain.stop_reason == "length" and plain.text is None


def test_byte_model_batched_turns_unchanged(lm_task):
    chats = _sessions(lm_task)
    ids = [chats.create(SYSTEM) for _ in range(2)]
    batched = chats.turn_batch(ids, [b"def f(x):\n", b"import os\n"], 8)
    alone = [_greedy(_sessions(lm_task), t, 8)[2] for t in (b"def f(x):\n", b"import os\n")]
    assert [r.tokens for r in batched] == [r.tokens for r in alone]


def test_seeded_top_p_sample_repeats(lm_task):
    def sample(seed):
        s = Sampling(0.9, 0.9, torch.Generator().manual_seed(seed))
        return _greedy(_sessions(lm_task), n=16, sampling=s)[2].tokens
    assert sample(5) == sample(5)
    assert len({sample(5), sample(6), sample(7)}) > 1  # it does sample


def test_eos_ends_a_reply(lm_task):
    full = _greedy(_sessions(lm_task))[2].tokens
    codec = ByteCodec()
    codec.eos_ids = frozenset({full[3]})
    stop_at = full.index(full[3]) + 1
    chats, sid, r = _greedy(_sessions(lm_task, codec))
    assert r.tokens == full[:stop_at] and r.stop_reason == "eos"
    assert chats.history(sid) == SYSTEM + b"def add(a, b):\n" + bytes(full[:stop_at])


def test_stop_string_ends_the_reply_before_it_and_the_cache_keeps_what_was_fed(lm_task):
    full = bytes(_greedy(_sessions(lm_task))[2].tokens)
    text = ByteCodec().decode(full)  # the untrained model's bytes: not all valid UTF-8
    stop = next(c for c in text[2:] if c != "\ufffd")
    chats, sid, r = _greedy(_sessions(lm_task), stop=[stop])
    assert r.stop_reason == "stop" and r.text == text[: text.index(stop)]
    assert full.startswith(bytes(r.tokens))  # decoded up to the stop string, no further
    assert ByteCodec().decode(r.tokens).endswith(stop) and len(r.tokens) < len(full)
    assert chats.history(sid) == SYSTEM + b"def add(a, b):\n" + bytes(r.tokens)
    # the session goes on from what the cache holds
    assert chats.turn(sid, b"x", 2).stop_reason == "length"


# -- SmolLM2 with its chat template --------------------------------------------------------
@pytest.fixture(scope="module")
def smol(one_thread):
    pytest.importorskip("transformers")
    from node.models import smollm2 as models
    from node.models.chat import ChatCodec
    from node.models.llama import LlamaModel

    try:
        model = LlamaModel.from_pretrained(verify_hashes=False)
    except models.ModelMissingError:
        pytest.skip("SmolLM2 not fetched: python -m node.models.smollm2 fetch")
    return model.eval(), ChatCodec.from_dir()


def _smol_sessions(smol) -> Sessions:
    model, codec = smol
    return Sessions(model, KVCache(model.cache_config(pool_bytes=64 << 20)), codec)


SMOL_SYSTEM = "You are a concise assistant. Answer in one or two sentences."


def test_smollm2_session_feeds_the_chat_template(smol):
    model, codec = smol
    assert 2 in codec.eos_ids  # <|im_end|>
    chats = _smol_sessions(smol)
    sid = chats.create(SMOL_SYSTEM)
    assert chats.tokens(sid) == codec.conversation_ids([{"role": "system",
                                                         "content": SMOL_SYSTEM}])
    r1 = chats.turn(sid, "What is 2 + 2?", 24)
    r2 = chats.turn(sid, "And 3 + 3?", 6)  # cut by max_new_tokens: the template closes it
    assert r1.stop_reason == "eos" and r1.tokens[-1] in codec.eos_ids
    assert r2.stop_reason == "length" and len(r2.tokens) == 6
    messages = chats.session(sid).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == r1.text and r1.text.strip()
    assert chats.tokens(sid) == codec.conversation_ids(messages)
    chats.reset_conversation(sid)
    assert chats.session(sid).messages == messages[:1]
    assert chats.tokens(sid) == codec.system(SMOL_SYSTEM)


def test_smollm2_sessions_share_the_system_prompt_blocks(smol):
    model, codec = smol
    chats = _smol_sessions(smol)
    system = SMOL_SYSTEM + " " + "Be kind. " * 12
    n = len(codec.system(system))
    full = n // chats.cache.config.block_size
    assert full >= 2
    a = chats.create(system)
    before = chats.cache.stats()
    b = chats.create(system)
    after = chats.cache.stats()
    assert after["prefix_hit_blocks"] - before["prefix_hit_blocks"] == full
    assert after["blocks_shared"] >= full
    ra, rb = chats.turn_batch([a, b], ["Hi!", "Hello!"], 4)
    assert chats.tokens(a)[:n] == chats.tokens(b)[:n] == codec.system(system)
    assert chats.tokens(b) == codec.conversation_ids(chats.session(b).messages)


def test_smollm2_stop_string_and_seeded_sample(smol):
    chats = _smol_sessions(smol)
    sid = chats.create(SMOL_SYSTEM)
    r = chats.turn(sid, "Count from 1 to 10, separated by commas.", 40, stop=["5"])
    assert r.stop_reason == "stop" and "5" not in r.text and "4" in r.text

    def sample(seed):
        c = _smol_sessions(smol)
        s = Sampling(0.8, 0.9, torch.Generator().manual_seed(seed))
        return c.turn(c.create(SMOL_SYSTEM), "Name a fruit.", 8, sampling=s).tokens
    assert sample(3) == sample(3)
