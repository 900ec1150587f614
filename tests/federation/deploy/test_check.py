"""python -m federation.deploy.check: config errors before anything starts, and a run's exit status."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from federation.deploy import check as check_mod
from federation.deploy.check import BAD_CONFIG, OK, RUN_FAILED, check, main, run_and_read_status
from federation.deploy.local_superlink import LinkSettings
from tests.federation.deploy import link_fakes

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _own_flwr_home(tmp_path, monkeypatch):
    """A wrapped run starts its local SuperLink: here a stand-in, in a FLWR_HOME of the test's
    own, stopped by its recorded pid afterwards."""
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    for var in ("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT"):
        monkeypatch.delenv(var, raising=False)
    exe = link_fakes.fake_superlink_exe(tmp_path / "link")
    monkeypatch.setattr(check_mod, "LINK", LinkSettings(executable=exe, start_timeout_s=120))
    yield
    link_fakes.stop_all([], [home])


def test_the_default_config_is_ok(capsys) -> None:
    assert main(["--app", str(REPO)]) == OK
    assert capsys.readouterr().out.strip().endswith("fedkv: config ok")


def test_an_unknown_key_is_named_with_the_closest_known_keys(capsys) -> None:
    assert main(["--app", str(REPO), "--run-config", "num-rounds=2"]) == BAD_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "fedkv: config error: unknown key 'num-rounds' (did you mean num-server-rounds")


def test_every_bad_value_is_reported_at_once_without_a_traceback(capsys) -> None:
    code = main(["--app", str(REPO), "--run-config", "noise-multiplier=-1 task='mnist'"])
    err = capsys.readouterr().err
    assert code == BAD_CONFIG and "Traceback" not in err
    assert "noise-multiplier must be >= 0" in err and "task must be one of" in err


def test_federation_config_problems() -> None:
    got = check(federation_config=["num-supernode=5"], app_dir=REPO).problems
    assert got == ["unknown key 'num-supernode' (did you mean num-supernodes?)"]
    got = check(federation_config=["num-supernodes=1"], app_dir=REPO).problems
    assert got and "min-clients=2" in got[0]
    got = check(federation_config=[f"client-resources-num-cpus={(os.cpu_count() or 1) + 1}"], app_dir=REPO).problems
    assert got and "never start a node" in got[0]
    assert "does not parse" in check(["task='lm"], app_dir=REPO).problems[0]  # malformed TOML value


def test_one_cpu_per_node_is_not_flagged_as_serial() -> None:
    assert check(federation_config=["client-resources-num-cpus=1"], app_dir=REPO).notes == [] or (os.cpu_count() or 1) < 2


def _fake_flwr(tmp_path: Path, body: str) -> Path:
    """An executable named ``flwr`` that plays ``flwr run`` (prints what the real one would)."""
    exe = tmp_path / "bin" / "flwr"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\nimport sys, pathlib\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _results(tmp_path: Path, status: str) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"status": status, "rounds": []}))
    return path


@pytest.mark.parametrize("status, code", [("completed", OK), ("failed: ValueError: boom", RUN_FAILED),
                                          ("stopped: round 1: 1 admitted node(s) < min-clients=2", RUN_FAILED)])
def test_a_wrapped_run_exits_with_its_status(tmp_path, capsys, status, code) -> None:
    results = _results(tmp_path, status)
    exe = _fake_flwr(tmp_path, f"print('INFO : fedkv round 1/1 ...')\nprint('FEDKV_RESULTS {results}')")
    assert main(["--", str(exe), "run", str(REPO), "--stream"]) == code
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == f"FEDKV_RESULTS {results}"  # the run's own output passes through
    assert out[-1].startswith("fedkv: exit 0: run completed" if code == OK else f"fedkv: exit 1: run {status}")


def test_a_bad_config_never_starts_the_run(tmp_path, capsys) -> None:
    marker = tmp_path / "started"
    exe = _fake_flwr(tmp_path, f"pathlib.Path({str(marker)!r}).touch()")
    code = main(["--", str(exe), "run", str(REPO), "--stream", "--run-config", "num-rounds=2"])
    assert code == BAD_CONFIG and not marker.exists()
    assert "did you mean num-server-rounds" in capsys.readouterr().err


def test_a_run_that_names_no_results_file_failed(tmp_path) -> None:
    exe = _fake_flwr(tmp_path, "print('Successfully started run 1')")
    code, last = run_and_read_status([str(exe), "run", ".", "--stream"])
    assert code == RUN_FAILED and "no results file" in last


def test_flwr_run_failing_itself_passes_its_code_through(tmp_path) -> None:
    exe = _fake_flwr(tmp_path, "sys.exit(3)")
    assert run_and_read_status([str(exe), "run", ".", "--stream"])[0] == 3


def test_without_stream_the_outcome_cannot_be_read(tmp_path, capsys) -> None:
    exe = _fake_flwr(tmp_path, "")
    assert main(["--", str(exe), "run", str(REPO)]) == BAD_CONFIG
    assert "add --stream" in capsys.readouterr().err


def test_only_flwr_run_is_wrapped(capsys) -> None:
    assert main(["--", "ls", "-l"]) == BAD_CONFIG
    assert "expected a 'flwr run ...' command" in capsys.readouterr().err
