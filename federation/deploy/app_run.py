"""``flwr run`` of the app against the demo's SuperLink, and ``--kill-one``: SIGKILL a SuperNode
mid round R-1 of R once it received that round's train message."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import tomllib
from dataclasses import fields
from pathlib import Path

from federation.deploy.demo import CONNECTION, Demo, RunOutcome, tail
from federation.deploy.processes import VENV_BIN, say
from federation.deploy.flwr_sandbox import make_app_dir

__all__ = ["kill_plan", "kill_round", "run_app", "run_config"]


def _app_dir(dest: Path, ref: str | None) -> Path:
    """The app folder ``flwr run`` builds: the working tree, or ``git archive <ref>``."""
    if ref is None:
        return make_app_dir(dest)
    from federation.deploy.flwr_sandbox import PACKAGES, REPO

    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref, "pyproject.toml", *PACKAGES],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_config(demo: Demo, app: Path) -> str:
    values: dict[str, object] = {
        "num-server-rounds": demo.rounds, "task": demo.task, "results-dir": str(demo.work / "results"),
        "round-timeout": float(demo.round_timeout), "min-clients": 2,
    }
    if _accepts(app, "server-kit"):
        values["server-kit"] = str(demo.kits["server"])
    text = " ".join(f"{k}={_toml(v)}" for k, v in values.items())
    return f"{text} {demo.extra_run_config}".strip()


def _accepts(app: Path, key: str) -> bool:
    """Pass a new key only when both the RunConfig and the app's pyproject know it
    (flwr rejects run-config keys its pyproject lacks)."""
    from federation.config import RunConfig

    in_config = key.replace("-", "_") in {f.name for f in fields(RunConfig)}
    app_config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"].get("config", {})
    return in_config and key in app_config


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"'{v}'" if isinstance(v, str) else str(v)


def _pump(proc: subprocess.Popen, lines: list[str], log: Path) -> None:
    with open(log, "a", errors="replace") as fh:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            lines.append(line)
            fh.write(line)
            fh.flush()


def _victim_got_train(demo: Demo, victim: int, nth: int) -> bool:
    return tail(demo.logs / f"supernode-{victim}.log", 10_000_000).count("Receiving: train.fedkv") >= nth


def kill_round(rounds: int) -> int:
    """The round ``--kill-one`` kills a node in: the one before the last, so the key rotation
    that follows the departure is seen in the last round (round 1 of 1 or 2, R-1 of R)."""
    return max(1, rounds - 1)


def kill_plan(nodes: int, rounds: int) -> str:
    """What ``--kill-one`` will do, in words (said before the run starts)."""
    return (f"--kill-one: SuperNode partition {nodes - 1} is SIGKILLed mid round "
            f"{kill_round(rounds)} of {rounds}, once it received that round's train message")


def run_app(demo: Demo, timeout: float) -> RunOutcome:
    """``flwr run <app> fedkv-demo --stream``; with kill_one, SIGKILL the victim mid round
    ``kill_round(rounds)``."""
    app = _app_dir(demo.work / "app", demo.app_ref)
    cmd = [str(VENV_BIN / "flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", run_config(demo, app)]
    say(f"flwr run ... --run-config \"{cmd[-1]}\"")
    proc = demo.procs.start("flwr-run", cmd, demo.logs / "flwr-run.log", demo.env, cwd=app, pipe=True)
    lines: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc, lines, demo.logs / "flwr-run.log"), daemon=True)
    reader.start()
    victim, at_round = demo.nodes - 1, kill_round(demo.rounds)
    if demo.kill_one:
        say(kill_plan(demo.nodes, demo.rounds))
    killed, deadline = None, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if demo.kill_one and killed is None and _round_done(lines, at_round - 1) \
                and _victim_got_train(demo, victim, at_round):
            pids = demo.procs.kill(f"supernode-{victim}")
            killed = demo.killed = victim
            say(f"SIGKILLed SuperNode partition {victim} (pids {pids}) after it received its round-{at_round} train message")
        time.sleep(0.3)
    if proc.poll() is None:
        say(f"flwr run still running after {timeout:.0f}s; stopping it")
        demo.procs.stop("flwr-run")
    reader.join(timeout=10)
    return RunOutcome(proc.returncode, lines, killed, _results(lines))


def _round_done(lines: list[str], rnd: int) -> bool:
    return rnd <= 0 or any(re.search(rf"fedkv round {rnd}/\d+", line) for line in list(lines))


def _results(lines: list[str]) -> dict | None:
    found = re.findall(r"FEDKV_RESULTS (\S+)", "".join(lines))
    if not found:
        return None
    try:
        return json.loads(Path(found[-1]).read_text())
    except (OSError, ValueError):
        return None
