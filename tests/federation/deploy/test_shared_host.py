"""Two FLWR_HOMEs on one host: B's run never lands in A's local SuperLink, and B's stop stops
only B's (issue 30: a run landed in another user's SuperLink on Flower's default port).

The fast tests use stand-ins (``link_fakes``): A's "SuperLink" is a small HTTP server on the
port, B's ``flwr run`` hands the run to whatever answers there, as Flower 1.42's does. The slow
test does the same with the real ``flower-superlink`` and a real ``flwr run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from federation.deploy import check as check_mod
from federation.deploy import stop as stop_mod
from federation.deploy.flwr_sandbox import alive, free_port, make_app_dir
from federation.deploy.local_superlink import LinkSettings
from tests.federation.deploy import link_fakes as fakes
from tests.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[3]
DEFAULT_PORT = 39091  # Flower 1.42's FLWR_LOCAL_SUPERLINK_HTTP_API_PORT default
PORT_VARS = ("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT")


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A's and B's folders; this process is B (FLWR_HOME, FEDKV_NODE_DIR, cwd); everything started
    is stopped by pid afterwards, also when the test fails."""
    dirs = {who: tmp_path / who for who in ("a", "b")}
    for d in dirs.values():
        (d / "work").mkdir(parents=True)
    monkeypatch.setenv("FLWR_HOME", str(dirs["b"] / "flwr-home"))
    monkeypatch.setenv("FEDKV_NODE_DIR", str(dirs["b"] / "nodes"))
    monkeypatch.setenv("FAKE_FLWR_LANDED", str(dirs["b"] / "landed.json"))
    for var in PORT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(dirs["b"] / "work")
    exe = fakes.fake_superlink_exe(tmp_path)
    monkeypatch.setattr(check_mod, "LINK", LinkSettings(executable=exe, start_timeout_s=120), raising=False)
    started: list[int] = []
    yield {**dirs, "exe": exe, "flwr": fakes.fake_flwr_exe(tmp_path), "started": started}
    fakes.stop_all(started, [dirs["a"] / "flwr-home", dirs["b"] / "flwr-home"])


def _foreign(host: dict, port: int):
    a = host["a"]
    proc = fakes.start_foreign(host["exe"], a / "flwr-home", port, a / "work", a / "nodes")
    host["started"].append(proc.pid)
    return proc


def _check(host: dict) -> int:
    return check_mod.main(["--", str(host["flwr"]), "run", str(REPO), "--stream",
                           "--federation-config", "num-supernodes=5 client-resources-num-cpus=1"])


def _landed(host: dict) -> dict:
    return json.loads((host["b"] / "landed.json").read_text())


def test_a_run_on_the_default_port_never_lands_in_another_flwr_homes_superlink(host, capsys) -> None:
    if not fakes.port_is_free(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} is in use on this host")
    foreign = _foreign(host, DEFAULT_PORT)

    assert _check(host) == 0
    landed = _landed(host)
    assert landed["flwr_home"] == str(host["b"] / "flwr-home"), f"the run landed in {landed}"
    assert landed["port"] != DEFAULT_PORT and landed["pid"] != foreign.pid
    assert landed["cwd"] == str(host["b"] / "work") and landed["node_dir"] == str(host["b"] / "nodes")
    assert f"fedkv: local SuperLink pid {landed['pid']} on 127.0.0.1:{landed['port']} (started" in \
        capsys.readouterr().out

    # B's stop stops B's SuperLink, by pid, and leaves A's running
    assert stop_mod.main([]) == 0
    out = capsys.readouterr().out
    assert f"stopped SuperLink pid {landed['pid']}" in out and str(foreign.pid) not in out
    assert not alive(landed["pid"]) and alive(foreign.pid)
    # and says so when nothing of B's is left, naming who holds the default port
    assert stop_mod.main([]) == 0
    out = capsys.readouterr().out
    assert "no local SuperLink running" in out and f"127.0.0.1:{DEFAULT_PORT} is held by pid {foreign.pid}" in out


def test_a_taken_port_that_the_user_chose_is_refused(host, capsys, monkeypatch) -> None:
    port = free_port()
    foreign = _foreign(host, port)
    monkeypatch.setenv(PORT_VARS[0], str(port))

    code = _check(host)
    err = capsys.readouterr().err
    assert not (host["b"] / "landed.json").exists(), f"the run landed in {_landed(host)}"
    assert code == 2
    assert f"127.0.0.1:{port} (FLWR_LOCAL_SUPERLINK_HTTP_API_PORT) is held by pid {foreign.pid}" in err
    assert "not by a SuperLink that fedkv started for FLWR_HOME=" in err and "Traceback" not in err
    assert alive(foreign.pid)


def test_the_next_run_reuses_the_superlink_it_started(host, capsys) -> None:
    assert _check(host) == 0
    first = _landed(host)
    assert first["flwr_home"] == str(host["b"] / "flwr-home") and not first.get("started_by_flwr")
    assert _check(host) == 0
    assert _landed(host)["pid"] == first["pid"]
    assert f"fedkv: local SuperLink pid {first['pid']} on 127.0.0.1:{first['port']} (reused" in \
        capsys.readouterr().out


def test_a_superlink_started_from_another_environment_is_refused(host, capsys, monkeypatch) -> None:
    assert _check(host) == 0
    first = _landed(host)
    (host["b"] / "landed.json").unlink()
    monkeypatch.setenv("FEDKV_NODE_DIR", str(host["b"] / "other-nodes"))  # its nodes would write elsewhere

    assert _check(host) == 2
    err = capsys.readouterr().err
    assert not (host["b"] / "landed.json").exists()
    assert f"SuperLink (pid {first['pid']}" in err and "started from another environment" in err
    assert f"node_root {host['b'] / 'nodes'} (now {host['b'] / 'other-nodes'})" in err
    assert "python -m federation.deploy.stop" in err and alive(first["pid"])


# -- end to end: the real flower-superlink and flwr run ----------------------------------------------
def _flwr_superlink_cmd(flwr_home: Path, port: int, control_port: int) -> list[str]:
    """``flwr run``'s own command for a local SuperLink (flwr.cli.local_superlink, flwr 1.42)."""
    runtime = flwr_home / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)  # as flwr does before it starts one
    return [str(Path(sys.executable).parent / "flower-superlink"), "--insecure", "--simulation", "--isolation",
            "subprocess", "--control-api-address", f"127.0.0.1:{control_port}", "--host", "127.0.0.1",
            "--port", str(port), "--log-file", str(runtime / "superlink.log"), "--database",
            str(runtime / "state.db")]


def _env(flwr_home: Path, node_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PORT_VARS}
    env.update(FLWR_HOME=str(flwr_home), FEDKV_NODE_DIR=str(node_dir), PYTHONPATH=str(REPO),
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", FLWR_DISABLE_UPDATE_CHECK="1",
               FLWR_TELEMETRY_ENABLED="0", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_run_lands_in_its_own_superlink_and_stop_leaves_the_other(tmp_path) -> None:
    """A's real SuperLink on Flower's default port; B runs the README's main job (1 round, digits)."""
    if not fakes.port_is_free(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} is in use on this host")
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "work").mkdir(parents=True)
    app = make_app_dir(b / "app")
    started: list[int] = []
    try:
        foreign = subprocess.Popen(_flwr_superlink_cmd(a / "flwr-home", DEFAULT_PORT, free_port()),
                                   env=_env(a / "flwr-home", a / "nodes"), cwd=a / "work", start_new_session=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(foreign.pid)
        fakes.wait_listening(DEFAULT_PORT, foreign)
        run = subprocess.run(
            [sys.executable, "-m", "federation.deploy.check", "--", "flwr", "run", str(app), "--stream",
             "--federation-config", "num-supernodes=2 client-resources-num-cpus=1",
             "--run-config", "num-server-rounds=1 task='digits'"],
            env=_env(b / "flwr-home", b / "nodes"), cwd=b / "work", capture_output=True, text=True,
            timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)
        out = run.stdout + run.stderr
        results = [line.split()[1] for line in out.splitlines() if line.startswith("FEDKV_RESULTS ")]
        assert results and Path(results[-1]).is_relative_to(b / "work"), out[-4000:]
        assert run.returncode == 0 and out.strip().splitlines()[-1].startswith("fedkv: exit 0: run completed")
        assert any((b / "nodes").glob("run-*/node-*")) and not (a / "nodes").exists()
        assert not (a / "work" / "results").exists()
        mine = fakes.recorded_pid(b / "flwr-home")
        assert mine is not None and mine != foreign.pid

        done = subprocess.run([sys.executable, "-m", "federation.deploy.stop"], env=_env(b / "flwr-home", b / "nodes"),
                              cwd=b / "work", capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert done.returncode == 0 and f"stopped SuperLink pid {mine}" in done.stdout, done.stdout + done.stderr
        assert not alive(mine) and alive(foreign.pid) and foreign.poll() is None
    finally:
        fakes.stop_all(started, [a / "flwr-home", b / "flwr-home"])
        if started:
            foreign.wait(timeout=30)
