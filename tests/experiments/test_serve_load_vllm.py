"""experiments.vllm_contender: the HTTP backend counts every token of a stream (merged chunks
too), stamps the first, drops (never raises) a failed request, the server is killed by its
process group, and serve_load reports a missing vLLM as a skip with its reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from experiments import serve_load as sl
from experiments import vllm_contender as vc
from experiments.served_process import (group_cpu_seconds, machine_busy_seconds, pause_group,
                                         stop_group)
from tests.hang_guard import HANG_GUARD_S

pytest.importorskip("httpx")


class _Fake(BaseHTTPRequestHandler):
    """An OpenAI-style SSE server; ``server.mode`` picks what it answers."""

    def log_message(self, *args: object) -> None:
        pass

    def _sse(self, chunks: list, done: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.flush()
        if done:
            self.wfile.write(b"data: [DONE]\n\n")

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        mode = self.server.mode

        def ch(ids, finish=None, usage=None, with_ids=True):
            c = {"index": 0, "text": "x" * len(ids), "finish_reason": finish,
                 "token_ids": ids if with_ids else None}  # vLLM writes null when not asked
            return {"choices": [c], **({"usage": usage} if usage else {})}
        if mode == "max_tokens":  # what ignore_eos asks for: max_tokens ids, one a chunk
            n = body["max_tokens"]
            self._sse([ch([7], "length" if k == n - 1 else None) for k in range(n)])
        elif mode == "merged":  # 6 tokens in 3 chunks, then the usage-only chunk
            self._sse([ch([11, 12]), ch([13]), ch([14, 15, 16], "length"),
                       {"choices": [], "usage": {"completion_tokens": 6}}])
        elif mode == "usage":  # no ids: the running count only
            self._sse([ch([0], usage={"completion_tokens": 2}, with_ids=False),
                       ch([0], "length", {"completion_tokens": 5}, with_ids=False)])
        elif mode == "500":
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"oops")
        elif mode == "cut":  # tokens, then the connection closes without [DONE]
            self._sse([ch([1]), ch([2])], done=False)
            self.close_connection = True
        elif mode == "error_chunk":
            self._sse([ch([1]), {"error": {"message": "engine died", "code": 500}}])
        elif mode == "error_object":  # the older ErrorResponse shape
            self._sse([ch([1]), {"object": "error", "message": "engine died", "code": 500}])
        elif mode == "no_finish":
            self._sse([ch([1])])


@pytest.fixture
def fake():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    srv.mode, srv.bodies = "merged", []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)


def _backend(srv) -> vc.VllmBackend:
    return vc.VllmBackend(f"http://127.0.0.1:{srv.server_address[1]}", "m", clients=4,
                          timeout_s=30)


def test_merged_chunks_count_every_token_and_the_first_is_stamped(fake):
    b = _backend(fake)
    try:
        rec = sl._one(b, sl.Req((5, 6, 7), 6), timeout_s=30)
        (h,) = b.submit(sl.GenerationRequest((5, 6, 7), 6))
        ids = list(h.tokens(timeout=30))
    finally:
        b.close()
    assert rec.tokens == 6 and not rec.dropped and rec.ttft_s >= 0 and rec.tpot_s is not None
    assert ids == [11, 12, 13, 14, 15, 16] and h.finish_reason == "length"
    body = fake.bodies[0]
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 6 and body["stream"] is True
    assert body["temperature"] == 0 and body["ignore_eos"] is True  # as serve_load's others
    assert body["return_token_ids"] is True


def test_without_ids_the_running_usage_count_is_used(fake):
    fake.mode = "usage"
    b = _backend(fake)
    try:
        rec = sl._one(b, sl.Req((5,), 5), timeout_s=30)
    finally:
        b.close()
    assert rec.tokens == 5 and not rec.dropped


@pytest.mark.parametrize("mode", ["500", "cut", "error_chunk", "error_object", "no_finish"])
def test_a_failed_request_is_dropped_not_raised(fake, mode):
    fake.mode = mode
    b = _backend(fake)
    try:
        rec = sl._one(b, sl.Req((5, 6), 4), timeout_s=30)
        (h,) = b.submit(sl.GenerationRequest((5, 6), 4))
        list(h.tokens(timeout=30))
    finally:
        b.close()
    assert rec.dropped and h.finish_reason == "error" and h.error


def test_nothing_listening_is_dropped_not_raised():
    b = vc.VllmBackend(f"http://127.0.0.1:{vc.free_port()}", "m", clients=1, timeout_s=5)
    try:
        assert sl._one(b, sl.Req((5,), 2), timeout_s=30).dropped
    finally:
        b.close()


def test_vllm_never_sees_fedkv_on_its_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/fedkv/tree")
    env = vc.own_env({"X": "1"})
    assert "PYTHONPATH" not in env and env["X"] == "1"


def test_unavailable_says_why():
    assert "no vLLM python" in vc.unavailable(None)
    assert "not an executable" in vc.unavailable("/nonexistent/python")
    assert "cannot import vllm" in vc.unavailable(sys.executable)  # fedkv's venv has no vLLM


def _fake_vllm(tmp_path, serve: bool):
    """A ``vllm.entrypoints.openai.api_server`` that serves /health (or exits at once) and
    starts a child that would outlive a kill of the server's pid alone."""
    pkg = tmp_path / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(textwrap.dedent(f"""
        import subprocess, sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        port = int(sys.argv[sys.argv.index("--port") + 1])
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(tmp_path / "child.pid")!r}, "w").write(str(child.pid))
        if not {serve}:
            sys.exit(3)
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
        HTTPServer(("127.0.0.1", port), H).serve_forever()
    """))


def _gone(pid: int, within_s: float = HANG_GUARD_S) -> bool:
    """``pid`` ended within ``within_s`` (a kill is delivered asynchronously)."""
    end = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.1)
    return not _alive(pid)


def _reap(pid: int) -> None:
    """The fake's child, stopped by its pid even when the test failed."""
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie (exited, not yet reaped) is gone
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_server_and_its_children_are_stopped_by_process_group(tmp_path):
    _fake_vllm(tmp_path, serve=True)
    server = vc.VllmServer(sys.executable, tmp_path, tmp_path / "v.log", "m",
                           vc.VllmSettings(start_timeout_s=60), {"PYTHONPATH": str(tmp_path)})
    child = int((tmp_path / "child.pid").read_text())
    try:
        assert server.report()["start_s"] >= 0 and _alive(server.proc.pid) and _alive(child)
        assert server.report()["version"] == "unknown"  # the fake is no installed distribution
        server.close()
        assert server.proc.poll() is not None and _gone(child)
    finally:
        _reap(child)


def test_a_server_that_exits_fails_the_start_and_leaves_nothing(tmp_path):
    _fake_vllm(tmp_path, serve=False)
    try:
        with pytest.raises(RuntimeError, match="exited with 3"):
            vc.VllmServer(sys.executable, tmp_path, tmp_path / "v.log", "m",
                          vc.VllmSettings(start_timeout_s=60), {"PYTHONPATH": str(tmp_path)})
        assert _gone(int((tmp_path / "child.pid").read_text()))
    finally:
        if (tmp_path / "child.pid").is_file():
            _reap(int((tmp_path / "child.pid").read_text()))


def test_vllm_runs_in_every_cell_in_the_rotation(fake, one_thread):
    fake.mode = "max_tokens"
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    fake_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)  # the server's process group
    server = type("S", (), {"url": url, "name": "tiny", "settings": vc.VllmSettings(),
                            "proc": fake_proc,
                            "backend": lambda self, n: vc.VllmBackend(url, "tiny", n)})()
    served = sl.load_served("tiny", seed=0)
    try:
        res, rows = sl.run_model(served, [1, 2], sl.LoadConfig(requests_per_client=1, max_new=4,
                                                               max_prompt=48, think_s=0,
                                                               settle_s=0.0),
                                 seed=0, trace=None, servers={sl.VLLM: server})
    finally:
        stop_group(fake_proc)
    assert all(r["cpu_cores"] > 0 for r in rows)  # the clients' CPU at least, for every system
    firsts = [r["system"] for r in rows if r["repeat"] == 0][::4]
    assert firsts == ["fedkv_scheduler", "fedkv_no_scheduler"]  # a rotation over four systems
    for cell in res["by_clients"].values():
        assert cell[sl.VLLM]["dtype"] == "bfloat16" and cell[sl.VLLM]["tokens_per_s"] > 0
    got = {r["system"]: r for r in rows if r["clients"] == 2}
    assert got[sl.VLLM]["dropped"] == 0
    warm, measured = fake.bodies[:2], fake.bodies[2:]  # one untimed pass of 2 requests first
    assert all(b["max_tokens"] <= 4 for b in warm)
    assert len(measured) == 4 + 4 and all(b["ignore_eos"] for b in fake.bodies)


def test_serve_load_without_vllm_reports_the_skip(tmp_path, one_thread, capsys):
    res = sl.main(["--models", "tiny", "--clients", "2", "--quick", "--json",
                   "--out", str(tmp_path), "--vllm-python", str(tmp_path / "none")])
    m = res["model"]["tiny"]
    why = m["settings"][sl.VLLM]["skipped"]
    assert "not an executable" in why and m["by_clients"]["2"][sl.VLLM] == {"skipped": why}
    assert m["by_clients"]["2"]["fedkv_scheduler"]["dtype"] == "float32"
    assert m["by_clients"]["2"]["hf_sequential"]["tokens_per_s"] > 0  # the baseline still runs
    assert m["settings"]["fedkv"]["dtype"] == "float32"
    assert f"{sl.VLLM} skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_real_vllm_streams_every_requested_token(tmp_path):
    """Needs a venv with vLLM's CPU build ($FEDKV_VLLM_PYTHON) and SmolLM2 (minutes)."""
    python = os.environ.get(vc.ENV_PYTHON)
    why = vc.unavailable(python)
    if why:
        pytest.skip(why)
    from node.models import smollm2 as models
    d = models.default_dir()
    if not (d / "config.json").is_file():
        pytest.skip(f"no SmolLM2 at {d} (python -m node.models.smollm2 fetch)")
    with vc.VllmServer(python, d, tmp_path / "vllm.log", "smollm2") as server:
        b = vc.VllmBackend(server.url, "smollm2", clients=2)
        try:
            recs = [sl._one(b, sl.Req(tuple(range(100, 160)), 12), timeout_s=300)
                    for _ in range(2)]
            (h,) = b.submit(sl.GenerationRequest(tuple(range(100, 160)), 12))
            ids = list(h.tokens(timeout=300))
        finally:
            b.close()
    assert [r.tokens for r in recs] == [12, 12] and not any(r.dropped for r in recs)
    assert len(ids) == 12 and all(0 <= t < 49152 for t in ids) and h.finish_reason == "length"


def test_machine_busy_seconds_counts_another_process_spinning():
    """``machine_cores`` counts every process on the machine, not only ours."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    before = machine_busy_seconds()
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        busy.wait(timeout=60)
    finally:
        if busy.poll() is None:
            busy.kill()
            busy.wait()
    assert machine_busy_seconds() - before >= 1.0


def test_group_cpu_seconds_counts_a_busy_server_group():
    """A contender's CPU is read from its process group (``cpu_cores`` in every cell)."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
    try:
        time.sleep(1.0)
        assert 0.3 < group_cpu_seconds(busy.pid) < 5.0
    finally:
        stop_group(busy)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _state_within(pid: int, want: str, timeout_s: float = 5.0) -> str:
    """The process's state once it is ``want``, else the last seen after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while (state := _state(pid)) != want and time.monotonic() < end:
        time.sleep(0.01)
    return state


def test_a_contender_is_paused_while_another_system_runs(fake, one_thread, monkeypatch):
    """Its process group is stopped (``T``) through every other system's cell and running in
    its own, and all of it runs again after the model's cells."""
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    fake_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
    server = type("S", (), {"url": url, "name": "tiny", "settings": vc.VllmSettings(),
                            "proc": fake_proc,
                            "backend": lambda self, n: vc.VllmBackend(url, "tiny", n)})()
    seen: list[tuple[str, str]] = []
    real_cell = sl._run_cell

    def cell(backend, *a, **kw):
        name = type(backend).__name__  # a signal lands a moment after killpg returns
        seen.append((name, _state_within(fake_proc.pid, "S" if name == "VllmBackend" else "T")))
        return real_cell(backend, *a, **kw)

    monkeypatch.setattr(sl, "_run_cell", cell)
    try:
        _, rows = sl.run_model(sl.load_served("tiny", seed=0), [1],
                               sl.LoadConfig(requests_per_client=1, max_new=4, max_prompt=48,
                                             think_s=0, settle_s=0.0),
                               seed=0, trace=None, servers={sl.VLLM: server})
        after = _state_within(fake_proc.pid, "S")
    finally:
        stop_group(fake_proc)
    assert {b for b, st in seen if st == "T"} == {"ScheduledBackend", "SerialBackend",
                                                  "HFSequentialBackend"}
    assert [st for b, st in seen if b == "VllmBackend"] == ["S"] and after == "S"
    assert all(r["machine_cores"] >= 0 for r in rows)  # a number in every row (not NaN)


def test_a_paused_group_still_stops_at_once_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    pause_group(proc)
    assert _state_within(proc.pid, "T") == "T"
    t0 = time.monotonic()
    stop_group(proc)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 20  # not the SIGKILL wait
