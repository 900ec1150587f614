"""The real multi-process deployment (``python -m federation.deploy demo``), small version.

3 SuperNodes + 1 SuperLink with TLS and SuperNode auth on loopback, 2 rounds, one SuperNode
SIGKILLed in round 1 (the round before the last, so the key rotation that follows is seen). A few minutes: SuperNodes poll every 3 s, each message starts a
ClientApp process, and the SuperLink reports the killed node unavailable only after two
missed heartbeats (<= 60 s).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation.deploy.flwr_sandbox import REPO, alive
from tests.hang_guard import HANG_GUARD_S


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment names ``text`` (our work dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            try:
                if text.encode() in Path(f"/proc/{entry}/{name}").read_bytes() and alive(int(entry)):
                    found.append(int(entry))
                    break
            except OSError:
                pass
    return found


@pytest.mark.slow  # end-to-end (40-125 s): .ci/run runs it in its slow step
@pytest.mark.timeout(600)
def test_deploy_demo_survives_a_killed_supernode(tmp_path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "federation.deploy", "demo", "--nodes", "3", "--rounds", "2", "--kill-one",
         "--workdir", str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    context = f"{out}\n{proc.stderr[-4000:]}"
    assert out["tls"] is True and out["node_auth"] is True, context
    assert out["refused_unregistered"] is True and out["refused_bad_cert"] is True, context
    assert out["killed_node"] == 2, context
    assert out["rounds_completed"] == 2 and out["status"] == "completed", context
    assert out["leftover_processes"] == 0, context
    assert proc.returncode == 0, context

    started = json.loads((work / "pids.json").read_text())
    assert len(started) >= 3 + 1 + 2  # SuperLink, SuperNodes, refused probes at least
    assert not [pid for pid, st in started if alive(pid) and _start_time(pid) == st]
    assert not _processes_mentioning(str(work))

    assert out["key_rotations"] >= 1 and out["server_key_origin"]["party"] == "provisioner", context

    results = json.loads(next((work / "results").glob("*.json")).read_text())
    r1, r2 = results["rounds"]
    assert r1["num_clients"] == 2 and r1["sampled"] == 3  # killed mid-round: the survivors' sum
    assert r1["noise_shares_added"] == 1  # a survivor made the dead node's noise share
    assert r1["departed"] and r2["key_rotated"] and r2["key_epoch"] == 1 and r2["num_clients"] == 2
    assert results["provisioning"]["enrollment"] == "pinned"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deploy_demo_with_a_serving_agent_picks_up_every_version(tmp_path) -> None:
    """--serve: the OpenAI server (``node.serving.openai_api`` on the scheduler) beside SuperNode 0
    loads each model version the node writes back (one invalidation per write-back) and its
    replies and ``/v1/models`` move to the new versions."""
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "federation.deploy", "demo", "--nodes", "2", "--rounds", "3", "--task", "lm",
         "--serve", "--workdir", str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    context = f"{out}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0 and out["rounds_completed"] == 3, context
    agent = out["serve_agent"]
    assert agent["started"] and agent["errors"] == [], context
    assert agent["versions_loaded"] == [0, 1, 2, 3] and agent["invalidations"] == 3, context
    assert {"1", "2"} <= set(agent["replies_per_version"]), context
    assert {1, 2} <= set(agent["models_versions_seen"]), context
    assert out["leftover_processes"] == 0 and not _processes_mentioning(str(work)), context
    for r in out["serving_per_round"][1:]:  # every write-back invalidated the prompt's K/V
        assert r["recomputed_tokens"] > 0 and r["invalidated_blocks"] > 0 and math.isclose(r["ppl"], r["ppl_fresh"], rel_tol=1e-4), context


# --- what the demo says it does (no processes started) ------------------------------------------

def test_kill_one_kills_in_the_round_before_the_last_and_says_so() -> None:
    from federation import deploy
    from federation.deploy.app_run import kill_plan, kill_round

    assert [kill_round(r) for r in (1, 2, 3, 5)] == [1, 1, 2, 4]
    assert "partition 2 is SIGKILLed mid round 1 of 2" in kill_plan(3, 2)
    assert "mid round 2 of 3" in kill_plan(5, 3)
    doc = " ".join(deploy.__doc__.split())
    assert "round-2" not in doc and "round R-1 of R" in doc


def test_the_kill_one_help_names_the_round_it_kills_in(capsys) -> None:
    from federation.deploy.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "mid round R-1 of R" in help_text and "round 1 with --rounds 1 or 2" in help_text
    assert "removed unless --keep" in help_text


def test_the_last_line_says_where_the_logs_are_or_how_to_keep_them(tmp_path) -> None:
    from federation.deploy.cli import workdir_note

    kept = workdir_note(tmp_path, removed=False)
    assert str(tmp_path) in kept and "logs/" in kept and "results/" in kept
    gone = workdir_note(tmp_path, removed=True)
    assert "removed" in gone and "--keep" in gone and "--workdir DIR" in gone


def test_the_serve_probe_authenticates_with_the_token_the_agent_wrote(tmp_path) -> None:
    """--serve's client reads the server's ``serve-token`` (beside the cache directory) and
    sends it on every request; here against a stand-in OpenAI server on loopback that insists
    on it, streaming chunks whose fingerprints span versions 1 and 2."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from federation.deploy.serve_probe import ServeProbe
    from node.serving.serve_auth import ensure_token_file, parse_tokens
    from tests.node.live_server import running

    cache_dir = tmp_path / "serve-node-0" / "kv-cache"
    probe = ServeProbe(tmp_path, cache_dir, interval_s=0.05)
    assert ensure_token_file(probe.token_file) and probe.token_file == cache_dir.parent / "serve-token"
    token = parse_tokens(probe.token_file.read_text())[0][1]
    seen: list[str | None] = []

    class Agent(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self, body: dict | bytes) -> None:
            seen.append(self.headers.get("Authorization"))
            ok = seen[-1] == f"Bearer {token}"
            data = body if ok and isinstance(body, bytes) else \
                json.dumps(body if ok else {"error": "unauthorized"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            assert self.path == "/v1/chat/completions"
            self._answer(b"".join(b"data: " + json.dumps({"system_fingerprint": f"fedkv-v{v}"}).encode()
                                  + b"\n\n" for v in (1, 2)) + b"data: [DONE]\n\n")

        def do_GET(self) -> None:
            self._answer({"data": [{"version": 2}]} if self.path == "/v1/models"
                         else {"versions_seen": [0, 1, 2], "invalidations": 2})

    with running(ThreadingHTTPServer(("127.0.0.1", 0), Agent)) as server:
        probe.ready.write_text(json.dumps({"port": server.server_address[1]}))
        probe._thread.start()  # the client only: no agent process
        deadline = time.monotonic() + HANG_GUARD_S
        while len(probe.versions) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        probe.stop()
    report = probe.report()
    assert report["errors"] == [] and report["replies"] >= 3, report
    assert report["versions_loaded"] == [0, 1, 2] and report["invalidations"] == 2
    assert report["replies_per_version"] == {"2": report["replies"]}
    assert report["replies_spanning_versions"] == report["replies"]
    assert report["models_versions_seen"] == [2]
    assert seen and set(seen) == {f"Bearer {token}"}
