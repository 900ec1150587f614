"""Servers a measurement starts are stopped when it is told to stop
(``experiments.served_process``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from federation.deploy.flwr_sandbox import alive

ROOT = Path(__file__).resolve().parents[2]

RUN = """
import subprocess, sys, time
from experiments.served_process import sigterm_unwinds
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                          start_new_session=True)
with sigterm_unwinds():
    try:
        print(server.pid, flush=True)
        time.sleep(120)
    finally:
        server.kill()
        server.wait()
"""


def test_a_sigterm_still_runs_the_finally_that_stops_the_servers():
    """``timeout`` sends SIGTERM: Python's default dies without unwinding, and a server in its
    own session kept serving. Inside ``sigterm_unwinds`` the run exits 143 through its
    ``finally``, and the server is gone."""
    run = subprocess.Popen([sys.executable, "-c", RUN], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = None
    try:
        server = int(run.stdout.readline())
        assert alive(server)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 143
        deadline = time.monotonic() + 10
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server)
    finally:
        if run.poll() is None:
            run.kill()
        if server is not None and alive(server):
            os.kill(server, signal.SIGKILL)


def test_the_previous_handler_is_back_afterwards():
    from experiments.served_process import sigterm_unwinds
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_unwinds():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
