"""Check a run's configuration before Flower starts anything, and give a run an exit status.

    python -m federation.deploy.check --run-config "task='digits' num-rounds=2"
    python -m federation.deploy.check -- flwr run . --stream --federation-config "num-supernodes=5"

The first form checks a ``--run-config`` string (and ``--federation-config``) against the app's
``[tool.flwr.app.config]`` and ``federation.config.RunConfig``: every problem on its own line,
an unknown key named with the closest known keys, exit 2. Flower itself answers an unknown key
with ``[code: 15] Invalid run configuration.`` and puts the reason in the SuperLink's log, and
a bad value surfaces only after Ray has started.

The second form checks the configuration of the ``flwr run`` command after ``--``, runs it
(its output passes through), reads the ``status`` of the results file the ServerApp names in
its ``FEDKV_RESULTS <path>`` line and exits 0 only for a completed run: ``flwr run --stream``
exits 0 whatever happened to the run.

When the run goes to a local simulation SuperLink (``:local:``, Flower's default connection),
the run is handed only to a SuperLink that this FLWR_HOME's fedkv started: it is started on
free ports with this environment's ``flower-superlink`` and recorded by pid, or the recorded
one is reused after checking it is still that process (``federation.deploy.local_superlink``);
``flwr run`` gets its ports. A SuperLink of another user or FLWR_HOME answering on Flower's
default port is never used, and one it could not avoid (a taken
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``) is refused: exit 2, nothing started.
``python -m federation.deploy.stop`` stops it by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from federation.config import ConfigError, RunConfig, config_lines, unknown_key
from federation.deploy import local_superlink
from federation.deploy.local_superlink import LinkSettings, LocalSuperLinkError

OK, RUN_FAILED, BAD_CONFIG = 0, 1, 2
RESULTS_LINE = re.compile(r"FEDKV_RESULTS (\S+)")
FEDERATION_KEYS = {
    "num-supernodes": int, "client-resources-num-cpus": float, "client-resources-num-gpus": float,
    "backend": str, "verbose": bool, "init-args-num-cpus": int, "init-args-num-gpus": float,
    "init-args-logging-level": str, "init-args-log-to-driver": bool,
}
"""Flower 1.42's ``SimulationConfig`` fields, as ``--federation-config`` spells them."""
FLOWER_DEFAULT_CPUS_PER_NODE = 2.0
"""Flower's default ``client-resources-num-cpus`` (``flwr.supercore.constant``)."""
LINK = LinkSettings()
"""How the local SuperLink of a wrapped run is started (tests swap in a stand-in executable)."""


@dataclass
class Checked:
    """What a check found: the parsed run config (None if it does not parse) and the problems."""

    config: RunConfig | None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the app's pyproject, as ``flwr run`` reads it."""
    path = app_dir / "pyproject.toml"
    try:
        return dict(tomllib.loads(path.read_text())["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
        raise ConfigError([f"{path}: no readable [tool.flwr.app.config] ({type(err).__name__})"]) from None


def parse_pairs(strings: Sequence[str], what: str) -> dict[str, Any]:
    """``key=value ...`` strings as Flower's CLI parses them (TOML values)."""
    from flwr.common.config import parse_config_args  # Flower's own parser: same answer as flwr run

    try:
        return dict(parse_config_args(list(strings)))
    except Exception as err:  # Flower raises ValueError / TOMLDecodeError for malformed pairs
        raise ConfigError([f"{what} does not parse: {err}"]) from None


def check(run_config: Sequence[str] = (), federation_config: Sequence[str] = (),
          app_dir: Path = Path(".")) -> Checked:
    """Every problem of a run's configuration, before anything starts."""
    try:
        overrides = parse_pairs(run_config, "--run-config")
        defaults = app_defaults(app_dir)
        federation = parse_pairs(federation_config, "--federation-config")
    except ConfigError as err:
        return Checked(None, err.problems)
    out = Checked(None)
    try:  # RunConfig names unknown keys too: the pyproject's keys are its fields
        out.config = RunConfig.from_run_config({**defaults, **overrides})
    except ConfigError as err:
        out.problems += err.problems
    _check_federation(federation, out)
    return out


def _check_federation(federation: dict[str, Any], out: Checked) -> None:
    for key, value in federation.items():
        if key not in FEDERATION_KEYS:
            out.problems.append(unknown_key(key, FEDERATION_KEYS, "Flower's simulation config"))
        elif not isinstance(value, FEDERATION_KEYS[key]) and not (FEDERATION_KEYS[key] is float and isinstance(value, int)):
            out.problems.append(f"{key} must be {FEDERATION_KEYS[key].__name__}, not {value!r}")
    nodes, cpus = federation.get("num-supernodes"), federation.get("client-resources-num-cpus")
    if isinstance(nodes, int) and out.config is not None and nodes < out.config.min_clients:
        out.problems.append(f"num-supernodes={nodes} < min-clients={out.config.min_clients}: "
                            "the run would stop before its first round")
    have = os.cpu_count() or 1
    if isinstance(cpus, (int, float)) and not 0 < cpus <= have:
        out.problems.append(f"client-resources-num-cpus={cpus}: must be in (0, {have}] on this machine "
                            "(Ray would never start a node)")
    per_node = cpus if isinstance(cpus, (int, float)) and cpus > 0 else FLOWER_DEFAULT_CPUS_PER_NODE
    if have // per_node < 2 <= have:
        out.notes.append(f"{per_node:g} CPUs per node on {have} CPUs: nodes run one at a time; "
                         f"client-resources-num-cpus={have // 2 if have >= 4 else 1} runs them in parallel")


# -- the wrapped flwr run ----------------------------------------------------------------------
@dataclass(frozen=True)
class FlwrRun:
    """What a wrapped ``flwr run`` command asks for."""

    app: Path
    run_config: list[str]
    federation_config: list[str]
    stream: bool
    connection: str | None
    """The SuperLink connection named after the app (None: the default one)."""


def flwr_run_parts(command: Sequence[str]) -> FlwrRun:
    """The parts of ``flwr run [APP] [CONNECTION] ...`` that the check reads."""
    if len(command) < 2 or Path(command[0]).name != "flwr" or command[1] != "run":
        raise ConfigError([f"expected a 'flwr run ...' command after --, got {' '.join(command)!r}"])
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("app", nargs="?", default=".")
    p.add_argument("connection", nargs="?", default=None)
    p.add_argument("--run-config", "-c", action="append", default=[])
    p.add_argument("--federation-config", action="append", default=[])
    p.add_argument("--stream", action="store_true")
    args, _ = p.parse_known_args(list(command[2:]))
    return FlwrRun(Path(args.app), args.run_config, args.federation_config, args.stream, args.connection)


def superlink_env(connection: str | None, settings: LinkSettings) -> dict[str, str]:
    """Start or verify this FLWR_HOME's own local SuperLink when the run goes to a local one, say
    which, and return the variables that point ``flwr run`` at it ({} for a remote SuperLink)."""
    address = local_superlink.local_address(connection)
    if address is None:
        return {}
    home = local_superlink.default_flwr_home()
    record, started = local_superlink.ensure(home, address == ":local-in-memory:", settings)
    print(f"fedkv: local SuperLink pid {record.pid} on 127.0.0.1:{record.http_port} "
          f"({'started' if started else 'reused'}; FLWR_HOME={home}; stop it with "
          "python -m federation.deploy.stop)", flush=True)
    return local_superlink.flwr_env(record)


def run_and_read_status(command: Sequence[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``command`` (with ``env`` added to ours) with its output passing through;
    (exit code, last line to print)."""
    results: list[str] = []
    with subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, env={**os.environ, **(env or {})}) as proc:
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                sys.stdout.write(line)
                results += RESULTS_LINE.findall(line)
        except KeyboardInterrupt:
            proc.terminate()  # our own child, by its pid
            raise
    if proc.returncode != 0:
        return proc.returncode, f"fedkv: flwr run exited with {proc.returncode}"
    if not results:
        return RUN_FAILED, ("fedkv: run FAILED: no results file was named (the ServerApp did not finish; "
                            "see $FLWR_HOME/local-superlink/superlink.log, FLWR_HOME defaults to ~/.flwr)")
    try:
        status = json.loads(Path(results[-1]).read_text()).get("status", "unknown")
    except (OSError, ValueError) as err:
        return RUN_FAILED, f"fedkv: run FAILED: results file {results[-1]} unreadable ({type(err).__name__})"
    if status == "completed":
        return OK, f"fedkv: exit 0: run completed (results {results[-1]})"
    return RUN_FAILED, f"fedkv: exit 1: run {status} (results {results[-1]})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m federation.deploy.check", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [--run-config S] [--federation-config S] [--app DIR] "
                                      "| %(prog)s -- flwr run APP --stream [...]")
    p.add_argument("--run-config", "-c", action="append", default=[], help="as flwr run takes it")
    p.add_argument("--federation-config", action="append", default=[], help="as flwr run takes it")
    p.add_argument("--app", default=".", help="the app directory (its pyproject.toml); default .")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = _parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        if command:
            wrapped = flwr_run_parts(command)
            if not wrapped.stream:
                raise ConfigError(["add --stream to the flwr run command: without it flwr run returns "
                                   "before the run ends and its outcome cannot be read"])
            app, run_cfg, fed_cfg = wrapped.app, wrapped.run_config, wrapped.federation_config
        else:
            app, run_cfg, fed_cfg = Path(args.app), args.run_config, args.federation_config
    except ConfigError as err:
        return _report(Checked(None, err.problems))
    checked = check(run_cfg, fed_cfg, app)
    if checked.problems or not command:
        return _report(checked)
    for note in checked.notes:
        print(f"fedkv: note: {note}", flush=True)
    try:
        env = superlink_env(wrapped.connection, LINK)
    except LocalSuperLinkError as err:
        print(f"fedkv: local SuperLink refused: {err}", file=sys.stderr)
        return BAD_CONFIG
    code, last = run_and_read_status(command, env)
    print(last, flush=True)
    return code


def _report(checked: Checked) -> int:
    if checked.problems:
        for problem in checked.problems:
            print(f"fedkv: config error: {problem}", file=sys.stderr)
        return BAD_CONFIG
    assert checked.config is not None
    for line in config_lines(checked.config):
        print(f"fedkv: {line}")
    for note in checked.notes:
        print(f"fedkv: note: {note}")
    print("fedkv: config ok")
    return OK


if __name__ == "__main__":
    sys.exit(main())
