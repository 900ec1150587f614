"""The node's one ASGI server (issue 33): the red team's probes, 16 streams from one client
queued fairly, models by name, and a usable context.

Live servers on ephemeral loopback ports (``test_openai_api.serving`` or an ``OpenAIServer``
built here), always shut down; the byte model and the tiny random Llama. The real SmolLM2
runs under ``-m slow`` (skipped without ``python -m node.models.smollm2 fetch``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from cache import KVCache  # noqa: E402
from node.serving.openai_api import APIConfig, OpenAIServer  # noqa: E402
from node.serving.openai_protocol import PromptCodec  # noqa: E402
from node.engine.scheduler import SchedulerConfig  # noqa: E402
from node.engine.scheduler_backend import ScheduledBackend  # noqa: E402
from node.tasks.tasks import lm_model  # noqa: E402
from tests.node.live_server import running  # noqa: E402
from tests.node.serving.test_openai_api import (MESSAGES, TENANTS, TOKENS, client,  # noqa: E402
                                        llama_parts, serving)  # noqa: F401 -- a fixture


def _post(port: int, path: str, data: bytes, token: str = TOKENS["alice"]) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Authorization": f"Bearer {token}",
                                  "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- the red team's probes ------------------------------------------------------------------------
def test_a_header_trickle_is_cut_and_holds_nobody(one_thread):
    """A client that sends its request head one byte every 50 ms never completes it: the
    server drops it (its head deadline) long before the head is sent -- the old server's
    per-read socket timeout let it hold a thread as long as bytes kept coming -- and 40 such
    clients do not keep another from being served meanwhile."""
    config = APIConfig(socket_timeout_s=1.0)
    with serving(lm_model(seed=0).eval(), None, "fedkv-byte", config) as s:
        port = s.server_address[1]
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 400 + b"\r\n\r\n"
        cut: list[bool] = []

        def trickle() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                try:
                    for i in range(len(head)):  # 400+ bytes at 20/s: 20 s if never cut
                        c.sendall(head[i:i + 1])
                        time.sleep(0.05)
                    cut.append(c.recv(1024) == b"")  # a reply: the head was taken whole
                except OSError:  # reset: cut while sending
                    cut.append(True)
        slow = threading.Thread(target=trickle)
        slow.start()
        others = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(40)]
        try:
            for o in others:
                o.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            for _ in range(3):
                r = client(s).completions.create(model="fedkv-byte", prompt="hi", max_tokens=2)
                assert r.usage.completion_tokens == 2
        finally:
            for o in others:
                o.close()
            slow.join(60)
        assert cut == [True]


@pytest.mark.parametrize("data, says", [
    (b'{"model": "fedkv-byte", "prompt": "caf\xc3", "max_tokens": 2}', "JSON"),
    (b'{"model": "fedkv-byte", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    (b"\xff\xfe{}", "JSON")])
def test_invalid_utf8_and_deep_json_are_400_naming_the_problem(one_thread, data, says):
    with serving(lm_model(seed=0).eval(), None, "fedkv-byte") as s:
        status, body = _post(s.server_address[1], "/v1/completions", data)
        assert status == 400 and says in body["error"]["message"], body
        assert body["error"]["type"] == "invalid_request_error"
        assert client(s).completions.create(model="fedkv-byte", prompt="hi", max_tokens=1)


def test_a_body_that_never_arrives_is_408_and_frees_the_connection(one_thread):
    config = APIConfig(socket_timeout_s=0.5)
    with serving(lm_model(seed=0).eval(), None, "fedkv-byte", config) as s:
        with socket.create_connection(("127.0.0.1", s.server_address[1]), timeout=30) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + TOKENS["alice"].encode() + b"\r\nContent-Length: 100\r\n\r\n{")
            reply = c.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply


# -- 16 streams of one client, fair to another ----------------------------------------------------
@contextlib.contextmanager
def _scheduled(max_running: int, config: APIConfig = APIConfig()):
    model = lm_model(seed=0).eval()
    backend = ScheduledBackend(model, KVCache(model.cache_config(pool_bytes=1 << 21)),
                               SchedulerConfig(max_running=max_running), model_id="fedkv-byte")
    try:
        with running(OpenAIServer(("127.0.0.1", 0), backend, PromptCodec(None), TENANTS,
                                  config, context_len=model.context_len)) as server:
            yield server
    finally:
        backend.close()


def _stream(s, tenant: str, done: list, tokens: int = 40) -> None:
    text = "".join(ch.choices[0].text for ch in client(s, tenant).completions.create(
        model="fedkv-byte", prompt=f"{tenant} asks", max_tokens=tokens, temperature=0,
        stream=True))
    done.append((tenant, len(text) > 0))


def test_one_client_streams_16_requests_queued_and_another_tenant_is_not_starved(one_thread):
    """Alice opens 16 streams on a backend that runs 2 sequences at once: none is refused
    (the default per-tenant limit is 16; they queue). Bob's one request, sent while alice's
    are queued, takes the next free slot ahead of them: it ends before most of hers."""
    with _scheduled(max_running=2) as s:
        done: list = []
        alice = [threading.Thread(target=_stream, args=(s, "alice", done)) for _ in range(16)]
        for t in alice:
            t.start()
        deadline = time.monotonic() + 30
        while s._active["alice"] < 16 and time.monotonic() < deadline and len(done) < 16:
            time.sleep(0.005)
        bob = threading.Thread(target=_stream, args=(s, "bob", done))
        bob.start()
        while s._active["bob"] < 1 and bob.is_alive():  # admitted: alice's that ended already
            time.sleep(0.001)                           # ended before bob could compete
        ended_first = len(done)
        for t in (*alice, bob):
            t.join(120)
    assert sorted(done) == sorted([("alice", True)] * 16 + [("bob", True)]), done
    after_bob_came = [t for t, _ in done].index("bob") - ended_first
    # the two running, then bob beside one of them (FIFO: after every queued one of alice's)
    assert after_bob_came <= 4, (ended_first, done)


def test_the_fair_gate_grants_the_tenant_holding_fewest_slots():
    import asyncio

    from node.serving.fair_gate import FairGate, Refused

    async def scenario() -> list[str]:
        gate, order = FairGate(per_tenant=3, max_queue=5, slots=1), []

        async def one(tenant: str) -> None:
            gate.admit(tenant)
            taken = await gate.acquire(tenant, 1)
            order.append(tenant)
            await asyncio.sleep(0.01)
            gate.release(tenant, taken)
            gate.leave(tenant)
        tasks = [asyncio.create_task(one("a")) for _ in range(3)]
        await asyncio.sleep(0)  # a holds the slot, two of a's wait
        tasks.append(asyncio.create_task(one("b")))
        await asyncio.sleep(0)
        with pytest.raises(Refused) as e:
            gate.admit("a")  # its 4th
        assert e.value.status == 429
        await asyncio.gather(*tasks)
        return order
    assert asyncio.run(scenario()) == ["a", "b", "a", "a"]


# -- models by name -------------------------------------------------------------------------------
@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_models_by_name_share_base_weights_and_never_share_kv(llama_parts):
    from node.models.lora import LoraConfig, adapt
    from node.serving.served_models import ServedModels
    base, codec = llama_parts
    adapted = adapt(base, LoraConfig(seed=3))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    shared = {id(p) for p in base.parameters()}
    assert all(id(p) in shared for n, p in adapted.named_parameters() if "lora_" not in n)
    cache = lambda m: KVCache(m.cache_config(pool_bytes=1 << 21))  # noqa: E731
    b0 = ScheduledBackend(base, cache(base), model_id="tiny-llama")
    b1 = ScheduledBackend(adapted, cache(adapted), model_id="tiny-llama:run-7-v3")
    models = ServedModels("tiny-llama", b0, {"tiny-llama:run-7-v3": b1},
                          {"tiny-llama:run-7-v3": "run 7, version 3"})
    try:
        with running(OpenAIServer(("127.0.0.1", 0), b0, PromptCodec(codec), TENANTS,
                                  context_len=base.context_len, models=models)) as s:
            c = client(s)
            listed = {m.id: m for m in c.models.list().data}
            assert list(listed) == ["tiny-llama", "tiny-llama:run-7-v3"]
            assert listed["tiny-llama:run-7-v3"].model_extra["parent"] == "tiny-llama"
            prompt = PromptCodec(codec).messages(MESSAGES)
            replies = {}
            for name, model in (("tiny-llama", base), ("tiny-llama:run-7-v3", adapted)):
                r = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=6,
                                              temperature=0)
                assert r.model == name and r.usage.prompt_tokens_details.cached_tokens == 0
                want = _greedy(model, prompt, 6)
                ends = [i for i, t in enumerate(want) if t in codec.eos_ids]
                want = want[:ends[0]] if ends else want
                assert r.choices[0].message.content == PromptCodec(codec).decode(want)
                replies[name] = want
            assert replies["tiny-llama"] != replies["tiny-llama:run-7-v3"]
            with pytest.raises(openai.NotFoundError) as e:
                c.chat.completions.create(model="tiny-llama:run-9-v1", messages=MESSAGES)
            assert e.value.body["code"] == "model_not_found"
    finally:
        models.close()


def test_cli_lora_modules(capsys):
    from node.serving.openai_api import _args
    a = _args(["--model", "smollm2", "--lora-modules", "mine=/tmp/x", "--lora-modules", "b=/y"])
    assert a.lora_modules == [("mine", "/tmp/x"), ("b", "/y")]
    for bad in (["--model", "smollm2", "--lora-modules", "nodir"],
                ["--lora-modules", "a=/x"]):
        with pytest.raises(SystemExit):
            _args(bad)
    assert "--lora-modules" in capsys.readouterr().err


# -- context -----------------------------------------------------------------------------------------
def test_a_prompt_over_the_context_names_the_flags(one_thread):
    with serving(lm_model(seed=0).eval(), None, "fedkv-byte") as s:
        with pytest.raises(openai.BadRequestError) as e:
            client(s).completions.create(model="fedkv-byte", prompt="x" * 200, max_tokens=2)
    msg = e.value.body["message"]
    assert e.value.body["code"] == "context_length_exceeded"
    assert "--max-context" in msg and "--pool-mib" in msg


def test_the_default_pool_holds_the_default_context():
    """SmolLM2's shape (30 layers, 3 KV heads of 64, fp32: 46,080 B a token): the default pool
    holds one request of 4,096 tokens; ``max_tokens`` defaults to the context."""
    from cache.sizing import arena_bytes_per_token
    from node.models.llama import LlamaConfig, LlamaModel
    from node.serving.openai_api import _args
    from node.serving.server_cli import SMOLLM2_CONTEXT, context_len, default_pool_mib
    cfg = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=8, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    assert arena_bytes_per_token(model.cache_config()) == 46_080
    context = context_len(model, None)
    assert context == SMOLLM2_CONTEXT == 4096 and context_len(model, 8192) == 8192
    pool = default_pool_mib(model, context) * (1 << 20)
    assert pool // 46_080 >= 4096
    assert _args([]).max_tokens is None


@pytest.mark.slow
def test_smollm2_takes_a_4000_token_prompt(one_thread):
    from node.models import smollm2 as models
    from node.models.llama import LlamaModel
    from node.serving.server_cli import context_len, default_pool_mib
    d = models.default_dir()
    if not (d / "model.safetensors").is_file():
        pytest.skip("python -m node.models.smollm2 fetch has not been run")
    from node.models.chat import ChatCodec
    model, codec = LlamaModel.from_pretrained(d).eval(), ChatCodec.from_dir(d)
    context = context_len(model, None)
    pool = int(default_pool_mib(model, context) * (1 << 20))
    backend = ScheduledBackend(model, KVCache(model.cache_config(pool_bytes=pool)),
                               model_id="smollm2")
    try:
        with running(OpenAIServer(("127.0.0.1", 0), backend, PromptCodec(codec), TENANTS,
                                  context_len=context)) as s:
            ids = (codec.encode("The quick brown fox jumps over the lazy dog. ") * 400)[:4000]
            r = client(s, timeout=900).completions.create(model="smollm2", prompt=ids,
                                                          max_tokens=4, temperature=0)
            assert r.usage.prompt_tokens == 4000 and r.usage.completion_tokens >= 1
    finally:
        backend.close()
