"""fedkv ServerApp: reads the run config, runs the rounds, writes one results JSON.

* ``dp-mode`` none/local/distributed -> ``OpaqueFedAvg`` over codec bytes (plaintext
  codec when ``he=false``, CKKS when crypto lands). Clients clip/noise locally.
* ``dp-mode=flower-central`` -> Flower's FedAvg + client-side fixed clipping baseline.

The results file path is absolute and printed at the end (the ServerApp's cwd is the
SuperLink's, not necessarily the project's).
"""

from __future__ import annotations

from logging import ERROR, INFO

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from federation.codec import make_aggregator
from federation.config import RunConfig
from federation.flower_central import run_flower_central
from federation.results import RoundRecord, RunResults
from federation.strategy import NotEnoughClients, OpaqueFedAvg
from node.federated import Layout, build_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_run_config(context.run_config)
    mode = "flower-central" if cfg.dp_mode == "flower-central" else ("he" if cfg.he else "plain")
    results = RunResults(config=cfg.as_dict(), mode=mode, run_id=context.run_id)
    log(INFO, "fedkv: mode=%s config=%s", mode, cfg.as_dict())

    error: Exception | None = None
    try:
        if mode == "flower-central":
            run_flower_central(grid, cfg, results)
            for rec in results.rounds:
                log(INFO, "fedkv %s", rec.summary(cfg.num_server_rounds))
        else:
            dim = Layout.of(build_model(cfg.task, cfg.seed)).size
            strategy = OpaqueFedAvg(
                cfg, lambda: make_aggregator(cfg.he, dim, cfg.packing), wait_for_nodes_s=cfg.round_timeout
            )

            def on_round(rec: RoundRecord) -> None:
                results.rounds.append(rec)
                log(INFO, "fedkv %s", rec.summary(cfg.num_server_rounds))

            strategy.run(grid, on_round)
        results.status = "completed"
    except NotEnoughClients as err:
        results.status = f"stopped: {err}"
        log(ERROR, "fedkv: run stopped: %s", err)
        error = err
    finally:
        if results.status == "running":
            results.status = "failed"
        path = results.write(cfg.results_dir)
        log(INFO, "fedkv: results written to %s", path)
        print(f"FEDKV_RESULTS {path}", flush=True)
    if error is not None:
        raise error
