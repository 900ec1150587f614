"""node.serving.serve_metrics through node.serving.openai_api: ``/health``, ``/metrics`` and one log line a request.

Live servers on ephemeral loopback ports (``test_openai_api.serving``: always shut down), the
tiny random Llama (a real chat template, multi-byte tokens) on the scheduler backend. The
server updates its metrics and writes its log line once the reply is sent, so a test waits
(bounded) until the figures for its requests are in, then checks them exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from node.serving.openai_api import APIConfig  # noqa: E402
from node.tasks.tasks import lm_model  # noqa: E402
from tests.hang_guard import HANG_GUARD_S  # noqa: E402
from tests.node.serving.test_openai_api import (MESSAGES, TOKENS, _Silent, client,  # noqa: E402
                                        llama_parts, serving)  # noqa: F401 -- a fixture


def _get(server, path: str, token: str | None = None) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), r.headers  # case-insensitive (uvicorn sends lower-case names)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def _samples(server) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` (no token: the default), keyed by name and sorted labels."""
    status, body, headers = _get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in prometheus_parser.text_string_to_metric_families(body.decode())
            for s in fam.samples}


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


CHAT = "/v1/chat/completions"


def _wait_for(predicate, what: str, limit_s: float = HANG_GUARD_S):
    """Poll ``predicate`` (the server records a request just after replying) until it holds."""
    deadline = time.monotonic() + limit_s
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


@pytest.fixture
def llama_server(llama_parts, one_thread):  # noqa: F811 -- the imported fixture
    model, codec = llama_parts
    with serving(model, codec, "tiny-llama", backend="scheduler") as s:
        yield s


def test_health_needs_no_token_and_tells_no_secret(llama_server):
    status, body, _ = _get(llama_server, "/health")
    assert status == 200
    got = json.loads(body)
    assert got == {"status": "ok", "model": "tiny-llama", "model_loaded": True,
                   "version": llama_server.backend.version}
    for tenant, token in TOKENS.items():
        assert tenant.encode() not in body and token.encode() not in body


@pytest.mark.parametrize("backend", ["scheduler", "serial"])
def test_health_is_503_once_the_backend_stopped(llama_parts, one_thread, backend):  # noqa: F811
    model, codec = llama_parts
    with serving(model, codec, "tiny-llama", backend=backend) as s:
        assert _get(s, "/health")[0] == 200
        s.backend.close()
        status, body, _ = _get(s, "/health")
    got = json.loads(body)
    assert status == 503 and got["status"] == "unavailable" and got["model_loaded"] is False
    assert got["reason"]


def test_metrics_count_requests_tokens_and_ttft(llama_server):
    before = _samples(llama_server)
    r = client(llama_server).chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                                     max_tokens=6, temperature=0)
    status, _, _ = _get(llama_server, "/v1/models", token="not-a-token")
    assert status == 401

    def settled():
        s = _samples(llama_server)
        done = _value(s, "fedkv_requests_total", route=CHAT, code="200") - \
            _value(before, "fedkv_requests_total", route=CHAT, code="200")
        refused = _value(s, "fedkv_requests_total", route="/v1/models", code="401") - \
            _value(before, "fedkv_requests_total", route="/v1/models", code="401")
        return s if done >= 1 and refused >= 1 else None
    after = _wait_for(settled, "the chat completion and the 401 counted")

    def delta(name: str, **labels) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)
    assert delta("fedkv_requests_total", route=CHAT, code="200") == 1
    assert delta("fedkv_requests_total", route="/v1/models", code="401") == 1
    assert delta("fedkv_prompt_tokens_total") == r.usage.prompt_tokens > 0
    assert delta("fedkv_generation_tokens_total") == r.usage.completion_tokens > 0
    assert delta("fedkv_time_to_first_token_seconds_count") == 1
    assert delta("fedkv_request_duration_seconds_count", route=CHAT) == 1
    if r.usage.completion_tokens > 1:
        assert delta("fedkv_time_per_output_token_seconds_count") == 1
    assert _value(after, "fedkv_model_version") == llama_server.backend.version
    for gauge in ("fedkv_requests_waiting", "fedkv_requests_running", "fedkv_preemptions_total"):
        assert (gauge, ()) in after, gauge
    assert ("fedkv_kv_cache_hit_blocks_total", (("tier", "hot"),)) in after
    assert ("fedkv_kv_sessions_open", ()) in after
    assert _value(after, "fedkv_kv_sessions_open") == 0  # the reply is done: its session closed
    assert _value(after, "fedkv_kv_blocks_referenced") == 0
    assert _value(after, "fedkv_kv_blocks_used") > 0 and _value(after, "fedkv_kv_bytes_allocated") > 0


def test_metrics_carry_no_tenant_or_token(llama_server):
    client(llama_server, "bob").chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                                        max_tokens=2)
    status, body, _ = _get(llama_server, "/metrics")
    assert status == 200 and b"fedkv_requests_total" in body
    for tenant, token in TOKENS.items():
        assert tenant.encode() not in body and token.encode() not in body


def test_metrics_auth_is_optional(llama_parts, one_thread):  # noqa: F811
    model, codec = llama_parts
    with serving(model, codec, "tiny-llama", APIConfig(metrics_auth=True),
                 backend="scheduler") as s:
        assert _get(s, "/metrics")[0] == 401
        assert _get(s, "/metrics", token=TOKENS["carol"])[0] == 200
        assert _get(s, "/health")[0] == 200  # a liveness probe never needs a key


def test_one_log_line_per_request_with_status_and_no_token(llama_server, caplog):
    caplog.set_level(logging.INFO, logger="fedkv")
    r = client(llama_server).chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                                     max_tokens=4)
    assert _get(llama_server, "/v1/models", token="wrong-token-0123456789")[0] == 401

    def lines():
        got = [rec.getMessage() for rec in caplog.records if rec.name == "fedkv.requests"]
        return got if len(got) >= 2 else None
    got = _wait_for(lines, "two request log lines")
    assert len(got) == 2
    chat = next(line for line in got if f"route={CHAT}" in line)
    refused = next(line for line in got if "route=/v1/models" in line)
    tenant = hashlib.sha256(b"alice").hexdigest()[:8]
    assert f"tenant={tenant}" in chat and "method=POST" in chat and "status=200" in chat
    assert f"prompt_tokens={r.usage.prompt_tokens}" in chat
    assert f"generated_tokens={r.usage.completion_tokens}" in chat
    assert "ttft_s=" in chat and "duration_s=" in chat
    assert "status=401" in refused and "tenant=-" in refused
    for line in got:
        for tenant_name, token in TOKENS.items():
            assert token not in line and tenant_name not in line
        assert "wrong-token" not in line


def test_a_streamed_request_counts_its_usage_and_ttft(llama_server):
    before = _samples(llama_server)
    chunks = list(client(llama_server).chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage

    def settled():
        s = _samples(llama_server)
        return s if _value(s, "fedkv_requests_total", route=CHAT, code="200") > \
            _value(before, "fedkv_requests_total", route=CHAT, code="200") else None
    after = _wait_for(settled, "the streamed request counted")

    def delta(name: str) -> float:
        return _value(after, name) - _value(before, name)
    assert delta("fedkv_prompt_tokens_total") == usage.prompt_tokens
    assert delta("fedkv_generation_tokens_total") == usage.completion_tokens
    assert delta("fedkv_time_to_first_token_seconds_count") == 1


def test_timeouts_and_rejections_are_logged(one_thread, caplog):
    caplog.set_level(logging.INFO, logger="fedkv")
    config = APIConfig(request_timeout_s=0.2)
    with serving(lm_model(seed=0).eval(), None, "fedkv-byte", config, wrap=_Silent) as s:
        c = client(s)
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model="fedkv-byte", prompt="hi")
        with pytest.raises(openai.APIError, match="timed out"):  # the stream's last event
            list(c.chat.completions.create(model="fedkv-byte", messages=MESSAGES, stream=True))
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="fedkv-byte", prompt="hi", temperature=5)

        def lines():
            got = [rec.getMessage() for rec in caplog.records if rec.name == "fedkv.requests"]
            return got if len(got) >= 3 else None
        got = _wait_for(lines, "three request log lines")
    assert len(got) == 3
    assert sum("route=/v1/completions" in g and "status=503 error=timeout" in g
               for g in got) == 1
    assert sum(f"route={CHAT}" in g and "status=200 error=timeout" in g for g in got) == 1
    assert sum("status=400 error=invalid_value" in g for g in got) == 1


def test_cli_metrics_and_log_flags(capsys):
    from node.serving.openai_api import _args
    a = _args([])
    assert (a.metrics_auth, a.log_level) == (False, "INFO")
    a = _args(["--metrics-auth", "--log-level", "WARNING"])
    assert (a.metrics_auth, a.log_level) == (True, "WARNING")
    with pytest.raises(SystemExit):
        _args(["--log-level", "LOUD"])
    assert "--log-level" in capsys.readouterr().err


def test_a_method_or_request_line_the_server_refuses_still_gets_its_answer(llama_server):
    """An unknown method (401 without a token: auth comes before routing; 405 with one) or a
    bad request line (400, uvicorn's own answer) before any route runs: recording the status
    must not break those replies."""
    import http.client
    import socket
    port = llama_server.server_address[1]
    for headers, status in (({}, 401), ({"Authorization": f"Bearer {TOKENS['alice']}"}, 405)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("PUT", "/v1/models", headers=headers)
            assert conn.getresponse().status == status
        finally:
            conn.close()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"NOT A REQUEST LINE\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 400")
    assert _get(llama_server, "/health")[0] == 200
