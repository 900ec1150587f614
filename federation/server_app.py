"""fedkv ServerApp: reads the run config, runs the rounds, writes one results JSON.

* ``dp-mode`` none/local/distributed -> ``OpaqueFedAvg`` over signed codec bytes
  (plaintext codec when ``he=false``, CKKS via crypto/ when ``he=true``). Clients
  clip/noise locally. Key provisioning first (``federation.provisioning.KeyService``: in
  this process, the dealer; see that module for the deployment split); the strategy gets
  only the dealer-signed public context and the verifier of the nodes' public keys.
* ``dp-mode=flower-central`` -> Flower's FedAvg + client-side fixed clipping baseline.

The results file path is absolute and printed at the end (the ServerApp's cwd is the
SuperLink's, not necessarily the project's).
"""

from __future__ import annotations

from dataclasses import asdict
from logging import ERROR, INFO

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from federation.config import RunConfig
from federation.flower_central import run_flower_central
from federation.provisioning import KeyService
from federation.results import RoundRecord, RunResults
from federation.strategy import NotEnoughClients, OpaqueFedAvg
from node.cache_node import model_layout

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
            dim = model_layout(cfg.task, cfg.seed).size
            keys = KeyService(cfg.he, cfg.ckks_preset, timeout=cfg.round_timeout)
            results.provisioning = keys.stats
            strategy = OpaqueFedAvg(
                cfg, dim, keys.verifier, keys.public_context, wait_for_nodes_s=cfg.round_timeout
            )
            if strategy.packing is not None:
                results.encoding = {**asdict(strategy.packing), "preset": cfg.ckks_preset, "dim": dim}
                log(INFO, "fedkv: CKKS encoding %s", results.encoding)

            def on_round(rec: RoundRecord) -> None:
                results.rounds.append(rec)
                log(INFO, "fedkv %s", rec.summary(cfg.num_server_rounds))

            strategy.run(grid, on_round, admit=keys.admit)
        results.status = "completed"
    except NotEnoughClients as err:
        results.status = f"stopped: {err}"
        log(ERROR, "fedkv: run stopped: %s", err)
        error = err
    except Exception as err:
        results.status = f"failed: {type(err).__name__}: {err}"
        raise
    finally:
        if results.status == "running":
            results.status = "failed"
        path = results.write(cfg.results_dir)
        log(INFO, "fedkv: results written to %s", path)
        print(f"FEDKV_RESULTS {path}", flush=True)
    if error is not None:
        raise error
