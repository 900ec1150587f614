"""fedkv ServerApp: reads the run config, runs the rounds, writes one results JSON.

The ServerApp holds public material only: it never creates, receives or parses a CKKS secret
context (in simulation a node makes the key; in deployment the provisioner did, see
``federation.key_service``). ``federation.run.run_rounds`` does the work; this file is the
Flower entry point and the results file around it. A run config that does not parse still
writes a results file (``status: failed: <reason>``) before anything else runs.

The results file path is absolute and printed at the end (the ServerApp's cwd is the
SuperLink's, not necessarily the project's).
"""

from __future__ import annotations

from logging import ERROR, INFO

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from federation.config import ConfigError, RunConfig, config_lines, results_dir_of
from federation.logs import configure_logging
from federation.results import RunResults
from federation.run import run_rounds
from federation.strategy import RunStopped

configure_logging()  # each log line once (Opacus adds a root handler on import)
app = ServerApp()


def _write(results: RunResults, results_dir: str) -> None:
    """Write the results file, then the run's last line: its outcome and the file's path."""
    path = results.write(results_dir)
    print(f"FEDKV_RESULTS {path}", flush=True)
    log(INFO if results.status == "completed" else ERROR, "%s", results.outcome_line(path))


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Config errors and a stopped run (too few nodes, or ``max-rejected-rounds`` aggregates in a
    row refused by every node: ``RunStopped``) end with one clear line and a ``status`` in the
    results file, no traceback (``flwr run`` exits 0 whatever the ServerApp does: ``python -m
    federation.deploy.check -- flwr run ...`` turns the status into an exit code).
    Anything else is a bug: it is recorded, then raised so Flower marks the run failed."""
    try:
        cfg = RunConfig.from_run_config(context.run_config)
    except ConfigError as err:
        results = RunResults(config=dict(context.run_config), mode="invalid", run_id=context.run_id,
                             status=f"failed: {err}")
        _write(results, results_dir_of(context.run_config))
        return
    results = RunResults(config=cfg.as_dict(), mode=cfg.mode, run_id=context.run_id)
    for line in config_lines(cfg):
        log(INFO, "fedkv: %s", line)
    try:
        run_rounds(grid, cfg, int(context.run_id), results, wait_for_nodes_s=cfg.round_timeout,
                   on_round=lambda rec: log(INFO, "fedkv %s", rec.summary(cfg.num_server_rounds)))
        results.status = "completed"
    except RunStopped as err:  # NotEnoughClients, AggregatesRefused
        results.status = f"stopped: {err}"
    except Exception as err:
        results.status = f"failed: {type(err).__name__}: {err}"
        raise
    finally:
        if results.status == "running":
            results.status = "failed"
        _write(results, cfg.results_dir)
