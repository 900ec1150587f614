"""How a ``flwr run`` simulation scales with the number of nodes: wall time, seconds per round,
provisioning, peak memory and the node directories left on disk.

    python -m experiments.bench_scale --nodes 5,20,50,100 --task lm --rounds 2 --json
    python -m experiments.bench_scale --nodes 20,100 --vs-checkout ../old --vs-cpus-per-node 2 --json

Each point is one cold ``flwr run . --stream`` (its own FLWR_HOME, SuperLink and node
directory), as a user runs it. ``--vs-checkout`` runs another checkout of the project at the
same points, interleaved with this one (A, B, A, B, ...), so both see the same machine load; the
last line printed is ONE JSON object with both series and their ratios. Peak memory is the
largest sum of RSS over the SuperLink and all its descendants (Ray included), sampled every
0.25 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from federation.deploy.flwr_sandbox import REPO, descendants, flwr_sandbox, superlink_pids


@dataclass(frozen=True)
class Series:
    """One checkout and how it is run."""

    name: str
    source: Path
    cpus_per_node: float
    run_config: dict[str, object]


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """Samples the RSS of a SuperLink's process family in a thread until stopped."""

    def __init__(self, flwr_home: Path, every_s: float = 0.25) -> None:
        self.flwr_home, self.every_s, self.peak = flwr_home, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            pids = [p for link in superlink_pids(self.flwr_home) for p in [link, *descendants(link)]]
            self.peak = max(self.peak, sum(_rss_bytes(p) for p in pids))


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def measure(series: Series, nodes: int, rounds: int, task: str, timeout: float) -> dict:
    """One cold run of ``series`` with ``nodes`` nodes."""
    rc = {**series.run_config, "task": task, "num-server-rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="fedkv-bench-scale-") as tmp:
        node_dir = Path(tmp) / "nodes"
        rc["results-dir"] = str(Path(tmp) / "results")
        with flwr_sandbox(Path(tmp), series.source) as box:
            box.env["FEDKV_NODE_DIR"] = str(node_dir)
            box.env["FEDKV_KEEP_RUNS"] = "0"  # measure what one run leaves
            with PeakMemory(box.flwr_home) as mem:
                run = box.run(nodes, rc, timeout=timeout,
                              extra_federation_config=f"client-resources-num-cpus={series.cpus_per_node:g}")
        if run.results_path is None:
            raise SystemExit(f"{series.name} at {nodes} nodes wrote no results (exit {run.returncode}):\n"
                             + run.output[-3000:])
        res = json.loads(run.results_path.read_text())
        per_round = [r["seconds"].get("round") for r in res["rounds"]]
        return {
            "nodes": nodes, "status": res["status"], "wall_s": run.wall_s,
            "round_s": per_round, "s_per_round": sum(per_round) / len(per_round) if per_round else None,
            "provision_s": res["rounds"][0]["seconds"].get("provision") if res["rounds"] else None,
            "eval_clients": [r.get("eval_clients") for r in res["rounds"]],
            "peak_rss_mb": mem.peak / 2**20, "node_dirs_mb": _disk_bytes(node_dir) / 2**20 if node_dir.exists() else 0.0,
            "final_metric": res["rounds"][-1]["eval_metric"] if res["rounds"] else None,
        }


def _median_point(points: list[dict]) -> dict:
    """Medians of the numeric figures over repeats (the first run's other fields)."""
    keys = ("wall_s", "s_per_round", "provision_s", "peak_rss_mb", "node_dirs_mb")
    return {**points[0], **{k: statistics.median(p[k] for p in points) for k in keys},
            "status": ",".join(sorted({p["status"] for p in points}))}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="5,20", help="comma-separated node counts (default 5,20)")
    p.add_argument("--task", default="lm", choices=["digits", "lm"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpus-per-node", type=float, default=1.0, help="client-resources-num-cpus (default 1)")
    p.add_argument("--vs-checkout", type=Path, default=None, help="another checkout to run at the same points")
    p.add_argument("--vs-cpus-per-node", type=float, default=2.0, help="its client-resources-num-cpus (default 2, Flower's)")
    p.add_argument("--repeats", type=int, default=1, help="sweeps (interleaved); medians reported")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    args = p.parse_args(argv)
    points = [int(n) for n in args.nodes.split(",")]
    runs = [Series("this", REPO, args.cpus_per_node, {})]
    if args.vs_checkout is not None:
        runs.append(Series("vs", args.vs_checkout.resolve(), args.vs_cpus_per_node, {}))
    print(f"bench_scale: task {args.task}, {args.rounds} rounds, nodes {points}, series "
          f"{[s.name for s in runs]}; expect ~{len(runs) * sum(30 + 2 * n for n in points) // 60} min", file=sys.stderr)
    raw: dict[str, dict[int, list[dict]]] = {s.name: {n: [] for n in points} for s in runs}
    for _ in range(args.repeats):
        for nodes in points:
            for series in runs:
                point = measure(series, nodes, args.rounds, args.task, args.timeout)
                raw[series.name][nodes].append(point)
                print(f"  {series.name} {nodes} nodes: wall {point['wall_s']:.0f} s, {point['s_per_round']:.1f} s/round, "
                      f"provision {point['provision_s']:.1f} s, peak {point['peak_rss_mb']:.0f} MB, "
                      f"node dirs {point['node_dirs_mb']:.0f} MB, {point['status']}", file=sys.stderr)
    out = {name: [_median_point(by_n[n]) for n in points] for name, by_n in raw.items()}
    result: dict = {"task": args.task, "rounds": args.rounds, "nodes": points, "repeats": args.repeats,
                    "series": out, "runs": raw, "cpus_per_node": {s.name: s.cpus_per_node for s in runs}}
    if "vs" in out:
        result["wall_ratio_vs_over_this"] = [b["wall_s"] / a["wall_s"] for a, b in zip(out["this"], out["vs"])]
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
