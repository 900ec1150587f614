"""Issue 30.1 with real processes: a SuperNode restart must not reopen an applied round.

SuperLink (TLS, SuperNode auth) + 2 SuperNodes with kits, as ``python -m federation.deploy demo``
starts them; the app's ServerApp is hostile (``replay_server_app.py``): one honest round (every
node applies round 1's aggregate), then, after this test restarted every SuperNode process (a
fresh ``context.state``, the same kit directory), round 1's aggregate offered again as the next
version. Every node must refuse it. A few minutes on 2 cores.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from federation import catch_up
from federation.deploy.app_run import run_config
from federation.deploy.demo import CONNECTION, Demo, prepare, tail, wait_for
from federation.deploy.flwr_sandbox import make_app_dir
from federation.deploy.processes import VENV_BIN
from federation.deploy.superlink import register_nodes, start_superlink, start_supernodes, supernode_cmd

NODES = 2


def _hostile_app(work: Path) -> Path:
    """The working tree's app with ``replay_server_app`` as its ServerApp."""
    app = make_app_dir(work / "app")
    shutil.copy(Path(__file__).with_name("replay_server_app.py"), app / "fedkv_replay_server.py")
    pyproject = app / "pyproject.toml"
    text, n = re.subn(r'(?m)^serverapp = ".*"$', 'serverapp = "fedkv_replay_server:app"', pyproject.read_text())
    assert n == 1
    pyproject.write_text(text)
    return app


def _restart_supernodes(demo: Demo) -> None:
    """Stop every SuperNode (SIGTERM: it leaves the SuperLink, so the new process may join at once)
    and start it again with the same command line."""
    for i in range(demo.nodes):
        demo.procs.stop(f"supernode-{i}")
        log = demo.logs / f"supernode-{i}-restarted.log"
        demo.procs.start(f"supernode-{i}-restarted", supernode_cmd(demo, i), log, {**demo.env, **demo.node_env})
    for i in range(demo.nodes):
        log = demo.logs / f"supernode-{i}-restarted.log"
        wait_for(lambda: "SuperNode ID:" in tail(log, 100_000), 120, f"SuperNode {i} to rejoin")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_restarted_supernode_refuses_a_replayed_aggregate(tmp_path) -> None:
    work = tmp_path / "demo"
    demo = Demo(work, NODES, rounds=1, task="digits", round_timeout=60.0, kill_one=False)
    results = work / "results"
    try:
        prepare(demo)
        start_superlink(demo)
        register_nodes(demo)
        start_supernodes(demo)
        app = _hostile_app(work)
        cmd = [str(VENV_BIN / "flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", run_config(demo, app)]
        run = demo.procs.start("flwr-run", cmd, demo.logs / "flwr-run.log", demo.env, cwd=app)

        def failed() -> str | None:
            return None if run.poll() is None else f"flwr run exited: {tail(demo.logs / 'flwr-run.log', 3000)}"

        wait_for(lambda: (results / "honest-done").exists(), 420, "the honest round", abort=failed)
        honest = json.loads((results / "honest-done").read_text())
        assert honest["history"] == 1 and honest["evaluated"] == NODES, honest
        _restart_supernodes(demo)
        (results / "restarted").write_text("")
        wait_for(lambda: (results / "replay.json").exists(), 300, "the nodes' answers to the replay", abort=failed)
        answers = json.loads((results / "replay.json").read_text())
        context = f"{answers}\n{tail(demo.logs / 'flwr-run.log', 3000)}"
        assert sorted(answers) == sorted(str(n) for n in honest["nodes"]), context
        for node, answer in answers.items():
            assert "error" in answer, f"node {node} applied the replayed aggregate: {context}"
            reason = answer["error"]
            # Flower wraps it: "<class '...ReplayedAggregate'>:<'replayed aggregate: ...'>"
            assert catch_up.REPLAYED in reason and not re.search(r"\d", reason), context
        deadline = time.monotonic() + 60
        while run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        leftovers = demo.procs.stop_all()
    assert leftovers == 0
