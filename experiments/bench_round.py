"""One small federation, plaintext vs CKKS, through the real ``flwr run`` CLI in one invocation.

    python -m experiments.bench_round --quick --json

Both runs use the same seed, nodes, rounds and clipping (dp-mode local with sigma 0, so the
plaintext run clips exactly like the encrypted one); only ``he`` differs. Per run: the median
round time (train phase + evaluate phase as the ServerApp sees it, round 1 included and
excluded), upload bytes per client per round, the final metric, and the per-phase seconds. The
runs are interleaved (plain, he, plain, he, ...) when ``--repeats`` > 1. The last line printed
is ONE JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from federation.deploy.flwr_sandbox import flwr_sandbox


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(results: dict) -> dict:
    rounds = results["rounds"]
    per_round = [r["seconds"]["train_phase"] + r["seconds"]["evaluate_phase"] for r in rounds]
    phases = {}
    for key in ("train", "encrypt", "aggregate", "decrypt", "writeback", "sign", "verify"):
        vals = [r["seconds"][key] for r in rounds if key in r["seconds"]]
        if vals:
            phases[key] = _median(vals)
    last = rounds[-1]
    return {
        **phase_accounting(rounds),
        "status": results["status"],
        "seconds_per_round": _median(per_round),
        "seconds_per_round_after_first": _median(per_round[1:]),
        "round_seconds": per_round,
        "upload_bytes_per_client_per_round": _median([r["upload_bytes_mean"] for r in rounds]),
        "aggregate_bytes": _median([r.get("aggregate_bytes", float("nan")) for r in rounds]),
        "final_metric": last["eval_metric"],
        "metric": last.get("metric", "accuracy"),
        "final_eval_loss": last["eval_loss"],
        "phase_seconds_median": phases,
        "clients_per_round": [r["num_clients"] for r in rounds],
        "encoding": {k: results.get("encoding", {}).get(k) for k in ("preset", "bits", "clip_range", "max_clients")},
    }


def phase_accounting(rounds: list[dict]) -> dict:
    """Medians over rounds of each server phase, each node phase (summed over nodes), the share
    of the round's wall time the named server phases explain, and of the server's waits the
    node handlers explain (the rest of a wait is ``transport``: Flower's queues and polling)."""
    def medians(rows: list[dict]) -> dict:
        keys = sorted({k for r in rows for k in r})
        return {k: _median([r.get(k, 0.0) for r in rows]) for k in keys}

    server = [r.get("server_seconds") or {} for r in rounds]
    explained = [1.0 - s.get("other", 0.0) / r["seconds"]["round"] for s, r in zip(server, rounds)
                 if r["seconds"].get("round")]
    waits = [s.get("wait", 0.0) + s.get("eval_wait", 0.0) for s in server]
    busy = [r["seconds"].get("nodes_busy", 0.0) for r in rounds]
    return {
        "server_phase_seconds_median": medians(server),
        "node_phase_seconds_median": {
            ph: medians([(r.get("node_seconds") or {}).get(ph, {}) for r in rounds]) for ph in ("train", "evaluate")},
        "round_wall_explained_by_server_phases": _median(explained),
        "waits_explained_by_node_handlers": _median([b / w for b, w in zip(busy, waits) if w > 0]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5 nodes, 3 rounds, digits, 2 repeats")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--task", default="digits", choices=["digits", "lm"])
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=None, help="runs per mode (default 2 quick, 4 full)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--packing-bits", type=int, default=5,
                   help="he run: bits per value (default 5: 5 values per 40-bit slot part with 3 headroom bits)")
    p.add_argument("--max-clients", type=int, default=None,
                   help="he run: packing headroom in contributions (default: --nodes, the real number of contributors)")
    p.add_argument("--error-feedback", type=int, choices=(0, 1), default=1, help="he run: carry residuals (default 1)")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 4)
    common = {"task": args.task, "num-server-rounds": args.rounds, "seed": args.seed,
              "dp-mode": "local", "noise-multiplier": 0.0, "clip-norm": 1.0, "min-clients": 2}
    encoding = {"packing-bits": args.packing_bits, "max-clients": args.max_clients or args.nodes,
                "error-feedback": bool(args.error_feedback)}
    print(f"bench_round: {args.nodes} nodes x {args.rounds} rounds, task {args.task}, "
          f"{repeats} run(s) per mode; expect ~{35 * 2 * repeats} s", file=sys.stderr)
    out: dict[str, list[dict]] = {"plain": [], "he": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedkv-bench-round-") as tmp, \
            flwr_sandbox(Path(tmp)) as box:
        for i in range(repeats):
            for mode in ("plain", "he"):
                rc = {**common, **(encoding if mode == "he" else {}), "he": mode == "he",
                      "results-dir": str(Path(tmp) / f"{mode}-{i}")}
                run = box.run(args.nodes, rc)
                if run.results_path is None:
                    raise SystemExit(f"{mode} run wrote no results (exit {run.returncode}):\n"
                                     + run.output[-3000:])
                res = json.loads(run.results_path.read_text())
                if res["status"] != "completed":
                    raise SystemExit(f"{mode} run did not complete: {res['status']}")
                s = summarise(res)
                s["cli_wall_s"] = run.wall_s
                out[mode].append(s)
                print(f"  {mode} run {i + 1}: {s['seconds_per_round']:.3f} s/round, "
                      f"{s['upload_bytes_per_client_per_round']:.0f} B up/client/round, "
                      f"{s['metric']} {s['final_metric']:.4f}", file=sys.stderr)

    def med(mode: str, key: str) -> float:
        return _median([r[key] for r in out[mode]])

    def pooled(mode: str, skip_first: bool) -> float:
        return _median([x for r in out[mode] for x in r["round_seconds"][int(skip_first):]])

    result = {
        "task": args.task, "nodes": args.nodes, "rounds": args.rounds, "repeats": repeats,
        "seconds_per_round": {m: pooled(m, False) for m in out},
        "seconds_per_round_after_first": {m: pooled(m, True) for m in out},
        "upload_bytes_per_client_per_round": {
            m: med(m, "upload_bytes_per_client_per_round") for m in out},
        "final_metric": {m: med(m, "final_metric") for m in out},
        "metric": out["he"][0]["metric"],
        "he_encoding": {**encoding, **out["he"][0].get("encoding", {})},
    }
    sp, up, fm = (result["seconds_per_round"], result["upload_bytes_per_client_per_round"],
                  result["final_metric"])
    result["ratios"] = {
        "seconds_per_round_he_vs_plain": sp["he"] / sp["plain"],
        "seconds_per_round_after_first_he_vs_plain":
            result["seconds_per_round_after_first"]["he"]
            / result["seconds_per_round_after_first"]["plain"],
        "upload_he_vs_plain": up["he"] / up["plain"],
        "final_metric_he_minus_plain": fm["he"] - fm["plain"],
    }
    result["runs"] = out
    result["elapsed_s"] = time.perf_counter() - t0
    result["notes"] = (
        "seconds_per_round: median over the rounds of all repeats of the ServerApp's "
        "train+evaluate phase wall "
        "time (includes client training, encryption, transport through the simulation, "
        "aggregation, decryption, write-back, evaluation). Round 1 of the HE run does not "
        "include key provisioning (done before round 1, not timed here). Same seed, same "
        "clipping (dp-mode local, sigma 0); only `he` differs.")
    r = result["ratios"]
    print(f"HE vs plaintext: round time x{r['seconds_per_round_he_vs_plain']:.2f}, upload "
          f"x{r['upload_he_vs_plain']:.2f}, final {result['metric']} "
          f"{fm['he']:.4f} vs {fm['plain']:.4f}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
