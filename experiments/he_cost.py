"""HE cost against model size: bytes per parameter and seconds per round for plaintext, TenSEAL with
NVFlare's defaults, fedkv without packing and fedkv with packing, plus Flower's SecAgg+ baseline.

    python -m experiments.he_cost --quick          # 1e4..1e6 params, 10 clients; ~1 min on 2 cores
    python -m experiments.he_cost                  # 1e4..1e7 params; ~7 min, ~9.4 GB peak RSS
    python -m experiments.he_cost --quick --sizes 1e4,3e4 --clients 3 --no-secagg   # tiny (tests)

Writes ``<out>/he_cost/<UTC timestamp>/``: ``points.csv`` (every HE/plaintext point),
``secagg.csv`` (Flower FedAvg and SecAgg+ rounds), ``summary.md``, ``bytes_per_param.png``,
``seconds_per_round.png``, ``meta.json`` (configuration, versions, estimate vs actual duration)
and ``secagg.log`` (the Flower simulation's log).

HE modes (one point per model size and mode; the measuring functions are
``experiments.bench_he``'s, unchanged, so the numbers mean exactly what its docstring says):

* data — ``clients`` updates of ``params`` values, N(0, 0.3) clipped to [-1, 1], weights drawn
  from [500, 1000] (``max_weight`` 1000): the same recipe as ``bench_he``, seeded per size.
* ``plaintext`` — float32 bytes, numpy sum (Flower's plain FedAvg wire, without Flower).
* ``tenseal_default`` — TenSEAL high-level API with NVFlare's defaults: N=8192, coeff
  [60, 40, 40], scale 2^40, public-key encryption, ``ckks_vector`` chunks of 4,096, ``serialize()``.
* ``fedkv_none`` / ``fedkv_8bit`` / ``fedkv`` — ``crypto`` with the ``fedkv-4096`` preset, seeded
  symmetric ciphertexts at the last level; ``none`` carries one real per slot part, ``fedkv_8bit``
  (the encoding before issue 13) 8-bit stochastic quantization with headroom for
  ``--max-clients`` contributions, ``fedkv`` the dense packing (``PackingConfig.dense``): headroom
  for exactly ``--clients`` and ``--values-per-part`` values per slot part.
* ``bytes_per_param`` — bytes ONE client uploads / params (``aggregate_bytes_per_param``: the
  aggregate the server sends back).
* ``seconds_per_round`` = encrypt (median over the clients; clients encrypt in parallel) +
  aggregate (server: parse and add all ``clients`` updates, serialise the result; median over
  ``repeats``) + decrypt (one client; median over ``repeats``). Compute only: no transport.
  ``total_cpu_s`` counts every client's encryption.

SecAgg+ baseline (``experiments.secagg_baseline``, run in a child process): Flower's legacy
``SecAggPlusWorkflow`` + ``secaggplus_mod`` vs plain FedAvg in one ``run_simulation`` with
``--secagg-clients`` clients: the bytes one client's replies serialise to over a round (all four
SecAgg+ stages), the wall time of a round through Flower's simulation transport (which polls
every 0.1 s) and the protocol's compute alone (client masking + server unmasking, comparable to
the HE modes' seconds per round). See that module's docstring for exactly what is counted.

The expected duration printed before the sweep comes from a calibration run just before it
(each HE mode at the two ``CALIBRATION_PARAMS`` sizes with 2 clients: a fixed cost plus a
cost per parameter for each phase, scaled to the sweep's sizes and clients) plus
a per-point cost of the SecAgg+ run documented below (not calibrated on the fly).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from crypto import PRESETS, PackingConfig
from experiments.bench_he import bench_fedkv, bench_plaintext, bench_tenseal_default
from experiments.output import (
    add_common_args,
    format_duration,
    make_run_dir,
    markdown_table,
    plot_lines,
    print_estimate,
    print_results_dir,
    progress,
    write_csv,
    write_json,
)

SCRIPT = "he_cost"
MODES = ("plaintext", "tenseal_default", "fedkv_none", "fedkv_8bit", "fedkv")
QUICK_SIZES = (10_000, 30_000, 100_000, 300_000, 1_000_000)
FULL_SIZES = (10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000, 10_000_000)
QUICK_SECAGG_SIZES = (10_000, 100_000)
FULL_SECAGG_SIZES = (100_000, 1_000_000)
CLIP_RANGE, MAX_WEIGHT = 1.0, 1000.0
CALIBRATION_PARAMS = (24_576, 196_608)  # 2 and 16 full fedkv ciphertexts

# Cost of the SecAgg+ child process, from runs on this 2-core machine on 2026-11-29 (flwr 1.42,
# 5 clients, 3 rounds per mode): sizes 1e4+1e5 took 16 s, 1e4+1e6 took 28 s. Model: ~12 s fixed
# (Ray start, warm-up round, shutdown) + per size and round (FedAvg and SecAgg+ together)
# ~1 s + 4 us per parameter. Documented, not calibrated at run time.
SECAGG_FIXED_S, SECAGG_ROUND_S, SECAGG_PER_PARAM_ROUND_S = 12.0, 1.0, 4e-6

# Resident bytes per parameter and client a mode holds at its peak (blobs of every client), for the
# memory guard; plus the data itself (X, its clipped copy, the weighted product: 3 x float64).
# Seen: the full run (10 clients, 1e7 params) peaked at 9.4 GB RSS, in tenseal_default: ~70 + 24.
PEAK_BYTES_PER_PARAM_CLIENT = {"plaintext": 4.0, "tenseal_default": 70.0, "fedkv_none": 8.1, "fedkv_8bit": 2.7,
                               "fedkv": 1.7}
DATA_BYTES_PER_PARAM_CLIENT = 24.0

POINT_COLUMNS = (
    "mode", "params", "clients", "repeats", "upload_bytes_per_client", "bytes_per_param",
    "aggregate_bytes_per_param", "encrypt_s_per_client", "aggregate_s", "decrypt_s", "seconds_per_round",
    "total_cpu_s", "max_abs_error", "ciphertexts_per_client", "saturated", "seed",
)
SECAGG_COLUMNS = (
    "mode", "params", "clients", "rounds", "upload_bytes_per_client_round", "upload_bytes_per_param",
    "download_bytes_per_param", "upload_vector_bytes", "upload_keys_shares_bytes", "seconds_per_round",
    "round_seconds_min", "round_seconds_max", "client_protocol_s", "server_protocol_s", "protocol_s",
    "max_abs_error", "num_shares", "reconstruction_threshold",
)
LABELS = {
    "plaintext": "plaintext fp32",
    "tenseal_default": "TenSEAL, NVFlare defaults",
    "fedkv_none": "fedkv, no packing",
    "fedkv_8bit": "fedkv, packed 8-bit (before issue 13)",
    "fedkv": "fedkv, dense packing (headroom = clients)",
    "flower_fedavg": "Flower FedAvg",
    "flower_secaggplus": "Flower SecAgg+",
}


def parse_sizes(text: str) -> list[int]:
    """'1e4,3e4' -> [10000, 30000]; every size a positive integer, sorted, no duplicates."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part!r}") from None
        if not math.isfinite(value) or value < 1 or value != int(value):
            raise argparse.ArgumentTypeError(f"a size must be a positive integer, not {part!r}")
        sizes.append(int(value))
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sorted(set(sizes))


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; known: {', '.join(MODES)}")
    if not modes:
        raise argparse.ArgumentTypeError("no modes given")
    return [m for m in MODES if m in modes]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.he_cost", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, quick_help="CI-sized run: sizes 1e4..1e6, 3 repeats, SecAgg+ at 1e4 and 1e5 (< 5 min)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="comma-separated model sizes, e.g. 1e4,3e4 (quick: 1e4..1e6; full: 1e4..1e7)")
    p.add_argument("--clients", type=int, default=10, help="clients summed per HE round (default 10)")
    p.add_argument("--repeats", type=int, default=None, help="timing repeats of aggregate/decrypt (default 3)")
    p.add_argument("--modes", type=parse_modes, default=list(MODES), help=f"subset of {','.join(MODES)}")
    p.add_argument("--values-per-part", type=int, default=5,
                   help="fedkv: values per slot part, headroom for exactly --clients (default 5: 1.6 B/param)")
    p.add_argument("--bits", type=int, default=8, help="fedkv_8bit quantization bits (default 8)")
    p.add_argument("--max-clients", type=int, default=32, help="fedkv_8bit / fedkv_none packing headroom (default 32)")
    p.add_argument("--preset", default="fedkv-4096", choices=sorted(PRESETS), help="fedkv CKKS preset")
    p.add_argument("--no-secagg", action="store_true", help="skip the Flower SecAgg+ baseline")
    p.add_argument("--secagg-sizes", type=parse_sizes, default=None,
                   help="SecAgg+ model sizes (quick: 1e4,1e5; full: 1e5,1e6)")
    p.add_argument("--secagg-clients", type=int, default=5, help="clients in the SecAgg+ simulation (default 5)")
    p.add_argument("--secagg-rounds", type=int, default=3, help="timed rounds per mode and size (default 3)")
    p.add_argument("--secagg-timeout", type=float, default=1800.0, help="seconds before the SecAgg+ run is killed")
    p.add_argument("--mem-fraction", type=float, default=0.6,
                   help="skip a point whose estimated peak memory exceeds this share of MemAvailable")
    return p


def make_data(size: int, clients: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bench_he's data recipe (its run() does not expose it): clipped N(0, 0.3), weights in [500, 1000]."""
    rng = np.random.default_rng([seed, size])
    X = np.clip(rng.normal(0.0, 0.3, (clients, size)), -CLIP_RANGE, CLIP_RANGE)
    w = rng.integers(500, 1001, clients).astype(np.float64)
    expected = (w[:, None] * X).sum(axis=0) / w.sum()
    return X, w, expected


def packings(args: argparse.Namespace) -> dict[str, PackingConfig]:
    return {
        "fedkv": PackingConfig.dense(PRESETS[args.preset].slot_bits, args.clients, args.values_per_part,
                                     clip_range=CLIP_RANGE, max_weight=MAX_WEIGHT),
        "fedkv_8bit": PackingConfig(mode="packed", bits=args.bits, clip_range=CLIP_RANGE, max_clients=args.max_clients,
                               max_weight=MAX_WEIGHT),
        "fedkv_none": PackingConfig(mode="none", clip_range=CLIP_RANGE, max_clients=args.max_clients,
                                    max_weight=MAX_WEIGHT),
    }


def run_mode(mode: str, X: np.ndarray, w: np.ndarray, expected: np.ndarray, repeats: int,
             packs: dict[str, PackingConfig], preset: str, seed: int) -> dict[str, Any]:
    if mode == "plaintext":
        return bench_plaintext(X, w, expected, repeats)
    if mode == "tenseal_default":
        return bench_tenseal_default(X, w, expected, repeats)
    return bench_fedkv(X, w, expected, repeats, packs[mode], preset, seed, mode)


def to_row(mode: str, size: int, clients: int, repeats: int, seed: int, r: dict[str, Any]) -> dict[str, Any]:
    s = r["seconds"]
    return {
        "mode": mode,
        "params": size,
        "clients": clients,
        "repeats": repeats,
        "upload_bytes_per_client": round(r["bytes_per_param"] * size),
        "bytes_per_param": r["bytes_per_param"],
        "aggregate_bytes_per_param": r["aggregate_bytes_per_param"],
        "encrypt_s_per_client": s["encrypt_per_client"],
        "aggregate_s": s["aggregate"],
        "decrypt_s": s["decrypt"],
        "seconds_per_round": s["end_to_end"],
        "total_cpu_s": s["total_cpu"],
        "max_abs_error": r["max_abs_error"],
        "ciphertexts_per_client": int(r.get("ciphertexts_per_client", 0)),
        "saturated": int(r.get("saturated", 0)),
        "seed": seed,
    }


def calibrate(args: argparse.Namespace, modes: list[str], packs: dict[str, PackingConfig]) -> dict[str, dict[str, list[float]]]:
    """Time every mode once at each of CALIBRATION_PARAMS with 2 clients and fit, per phase, a
    fixed cost plus a cost per parameter (aggregate: per parameter and client)."""
    n = 2
    timed: dict[str, list[tuple[int, dict[str, float]]]] = {m: [] for m in modes}
    data = []
    for c in CALIBRATION_PARAMS:
        t = time.perf_counter()
        X, w, expected = make_data(c, n, args.seed + 999)
        data.append((time.perf_counter() - t) / (c * n))
        for mode in modes:
            s = run_mode(mode, X, w, expected, 1, packs, args.preset, args.seed)["seconds"]
            timed[mode].append((c, {"encrypt": s["encrypt_per_client"], "aggregate": s["aggregate"] / n,
                                    "decrypt": s["decrypt"]}))
    rates: dict[str, dict[str, list[float]]] = {"data": {"per_value": [0.0, max(data)]}}
    for mode, pts in timed.items():
        (c1, t1), (c2, t2) = pts
        rates[mode] = {}
        for phase in t1:
            slope = (t2[phase] - t1[phase]) / (c2 - c1)
            if slope <= 0:  # noise: fall back to the larger point, all of it per parameter
                rates[mode][phase] = [0.0, t2[phase] / c2]
            else:
                rates[mode][phase] = [max(t1[phase] - slope * c1, 0.0), slope]
    return rates


def _cost(fit: list[float], size: float) -> float:
    return fit[0] + fit[1] * size


def estimate_point(rates: dict[str, dict[str, list[float]]], mode: str, size: int, clients: int, repeats: int) -> float:
    r = rates[mode]
    return clients * _cost(r["encrypt"], size) + repeats * (clients * _cost(r["aggregate"], size)
                                                            + _cost(r["decrypt"], size))


def estimate_sweep(rates: dict[str, dict[str, list[float]]], sizes: list[int] | tuple[int, ...], modes: list[str],
                   clients: int, repeats: int) -> float:
    """Seconds for the HE sweep: per size, the data once plus every mode's point."""
    return sum(_cost(rates["data"]["per_value"], d * clients)
               + sum(estimate_point(rates, m, d, clients, repeats) for m in modes) for d in sizes)


def estimate_secagg(sizes: list[int], rounds: int) -> float:
    return SECAGG_FIXED_S + sum(rounds * (SECAGG_ROUND_S + SECAGG_PER_PARAM_ROUND_S * d) for d in sizes)


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_bytes(mode: str, size: int, clients: int) -> float:
    return size * clients * (DATA_BYTES_PER_PARAM_CLIENT + PEAK_BYTES_PER_PARAM_CLIENT[mode])


# ---------------------------------------------------------------------------------------- SecAgg+

def _session_pids(sid: int) -> list[int]:
    """Pids of live processes in session ``sid`` (the child's own session: it and what it spawned)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields after the command: state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def run_secagg(run_dir: Path, sizes: list[int], clients: int, rounds: int, seed: int,
               timeout: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run experiments.secagg_baseline in a child process in its own session; afterwards stop
    whatever of that session is still alive (Ray's processes, if any) by pid."""
    json_out = run_dir / "secagg.json"
    cmd = [sys.executable, "-m", "experiments.secagg_baseline", "--sizes", ",".join(map(str, sizes)),
           "--clients", str(clients), "--rounds", str(rounds), "--seed", str(seed), "--json-out", str(json_out)]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    with open(run_dir / "secagg.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
    leftover = _session_pids(proc.pid)
    for pid in leftover:
        try:
            os.kill(pid, signal.SIGKILL if rc is None else signal.SIGTERM)
        except ProcessLookupError:
            pass
    if rc is None:
        proc.wait()
    info = {"command": shlex.join(cmd), "returncode": rc, "wall_seconds": time.perf_counter() - t,
            "child_pid": proc.pid, "leftover_pids_stopped": leftover}
    if rc != 0:
        why = "timed out" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"SecAgg+ run {why}; see {run_dir / 'secagg.log'}")
    return json.loads(json_out.read_text()), info


def secagg_row(r: dict[str, Any]) -> dict[str, Any]:
    stages = r["upload_bytes_by_stage"]
    vector = stages.get("collect_masked_vectors", stages.get("fit", 0.0))
    return {
        "mode": "flower_" + r["mode"],
        "params": r["params"],
        "clients": r["clients"],
        "rounds": r["rounds"],
        "upload_bytes_per_client_round": round(r["upload_bytes_per_client_round"]),
        "upload_bytes_per_param": r["upload_bytes_per_param"],
        "download_bytes_per_param": r["download_bytes_per_param"],
        "upload_vector_bytes": round(vector),
        "upload_keys_shares_bytes": round(sum(stages.get(k, 0.0) for k in ("setup", "share_keys", "unmask"))),
        "seconds_per_round": r["seconds_per_round"],
        "round_seconds_min": min(r["round_seconds"]),
        "round_seconds_max": max(r["round_seconds"]),
        "client_protocol_s": r["client_protocol_seconds"],
        "server_protocol_s": r["server_protocol_seconds"],
        "protocol_s": r["protocol_seconds"],
        "max_abs_error": r["max_abs_error"],
        "num_shares": r["num_shares"],
        "reconstruction_threshold": r["reconstruction_threshold"],
    }


# ------------------------------------------------------------------------------------- reporting

def _pivot(rows: list[dict[str, Any]], key: str, modes: list[str]) -> list[dict[str, Any]]:
    sizes = sorted({r["params"] for r in rows})
    out = []
    for d in sizes:
        line: dict[str, Any] = {"params": d}
        for m in modes:
            hit = [r[key] for r in rows if r["params"] == d and r["mode"] == m]
            line[m] = hit[0] if hit else "skipped"
        out.append(line)
    return out


def plots(run_dir: Path, rows: list[dict[str, Any]], srows: list[dict[str, Any]], modes: list[str]) -> list[Path]:
    def series(rs: list[dict[str, Any]], mode: str, key: str) -> tuple[list[float], list[float]] | None:
        pts = sorted((r["params"], r[key]) for r in rs if r["mode"] == mode)
        return ([p for p, _ in pts], [v for _, v in pts]) if pts else None

    n_he = rows[0]["clients"] if rows else 0
    b: dict[str, tuple[list[float], list[float]]] = {}
    t: dict[str, tuple[list[float], list[float]]] = {}
    styles: dict[str, dict[str, Any]] = {}
    for m in modes:
        if (xy := series(rows, m, "bytes_per_param")) is not None:
            b[LABELS[m]] = xy
        if (xy := series(rows, m, "seconds_per_round")) is not None:
            t[f"{LABELS[m]} ({n_he} clients)"] = xy
    for m in ("flower_fedavg", "flower_secaggplus"):
        k = srows[0]["clients"] if srows else 0
        for key, target, label, style in (
            ("upload_bytes_per_param", b, f"{LABELS[m]} (Flower message bytes)", {"linestyle": "--", "marker": "s"}),
            ("seconds_per_round", t, f"{LABELS[m]}, {k} clients: round wall (simulation)",
             {"linestyle": "--", "marker": "s"}),
            ("protocol_s", t, f"{LABELS[m]}, {k} clients: protocol compute", {"linestyle": ":", "marker": "x"}),
        ):
            if (xy := series(srows, m, key)) is not None:
                target[label] = xy
                styles[label] = style
    return [
        plot_lines(run_dir / "bytes_per_param.png", b, xlabel="model size (parameters)",
                   ylabel="bytes uploaded per parameter (one client)", title="Upload size vs model size",
                   styles=styles),
        plot_lines(run_dir / "seconds_per_round.png", t, xlabel="model size (parameters)",
                   ylabel="seconds per round", styles=styles,
                   title="Time per round (HE: encrypt + aggregate + decrypt)"),
    ]


def write_summary(run_dir: Path, args: argparse.Namespace, rows: list[dict[str, Any]], srows: list[dict[str, Any]],
                  modes: list[str], meta: dict[str, Any]) -> Path:
    n, reps = meta["clients"], meta["repeats"]
    lines = [
        "# HE cost vs model size",
        "",
        f"`{meta['command']}` — {meta['mode']} mode, seed {args.seed}, {n} clients per HE round, "
        f"{reps} timing repeats, {meta['cpu_count']} CPUs (shared: timings are noisy), "
        f"started {meta['started_utc']} UTC, took {format_duration(meta['wall_seconds'])} "
        f"(estimated {format_duration(meta['estimate_seconds'])}).",
        "",
        "## Bytes uploaded per parameter (one client)",
        "",
        markdown_table(_pivot(rows, "bytes_per_param", modes), floatfmt=".3f"),
        f"## Seconds per round (encrypt one client + aggregate {n} + decrypt; compute only)",
        "",
        markdown_table(_pivot(rows, "seconds_per_round", modes), floatfmt=".3g"),
        "## Max |decrypted mean - exact mean|",
        "",
        markdown_table(_pivot(rows, "max_abs_error", modes), floatfmt=".2g"),
    ]
    if meta.get("skipped"):
        lines += ["Skipped (memory guard): " + ", ".join(f"{s['mode']} at {s['params']:,}" for s in meta["skipped"]), ""]
    if srows:
        cols = ["mode", "params", "clients", "upload_bytes_per_param", "upload_vector_bytes",
                "upload_keys_shares_bytes", "seconds_per_round", "protocol_s", "max_abs_error"]
        lines += [
            f"## Flower SecAgg+ vs plain FedAvg ({srows[0]['clients']} clients, run_simulation, "
            f"median of {srows[0]['rounds']} rounds)",
            "",
            markdown_table(srows, cols, headers={"upload_bytes_per_param": "upload B/param",
                                                 "upload_vector_bytes": "vector msg B",
                                                 "upload_keys_shares_bytes": "keys+shares B",
                                                 "seconds_per_round": "round wall s",
                                                 "protocol_s": "protocol compute s"}, floatfmt=".4g"),
            "Upload bytes: every reply a client sends in a round, serialised as Flower 1.42 pushes it "
            "(Message + nested objects, no gRPC/TLS framing); for SecAgg+ the masked-vector message "
            "(int64 values mod 2^32) plus setup keys, encrypted key shares and unmask shares. Round wall "
            "time goes through Flower's simulation transport, which polls every 0.1 s (SecAgg+ has 4 "
            "exchanges per round, FedAvg 1). Protocol compute = slowest client's time in the mods minus "
            "fit + server time outside send_and_receive; compare it with the HE seconds per round.",
            "",
        ]
    elif args.no_secagg:
        lines += ["SecAgg+ baseline skipped (--no-secagg).", ""]
    lines += [
        "## What is measured",
        "",
        "- Modes: plaintext fp32 (numpy sum); TenSEAL high-level API with NVFlare's defaults (N=8192, "
        "[60,40,40], 2^40, public-key, 4,096-value ckks_vectors); fedkv `crypto` with preset "
        f"`{args.preset}`, mode none, mode packed as before issue 13 (fedkv_8bit: {args.bits}-bit, headroom for "
        f"{args.max_clients}) and the dense packing (fedkv: {args.values_per_part} values per slot part, "
        f"headroom for the {args.clients} clients summed).",
        "- bytes/param: one client's upload / params. Seconds per round: encrypt (median over clients; "
        "clients encrypt in parallel) + aggregate (server parses and adds all clients, serialises) + "
        "decrypt (one client), medians over repeats; `experiments.bench_he`'s functions.",
        "- Every point is in `points.csv` (HE) and `secagg.csv` (Flower); plots on log axes in "
        "`bytes_per_param.png` and `seconds_per_round.png`.",
        "",
    ]
    path = run_dir / "summary.md"
    path.write_text("\n".join(lines))
    return path


# ------------------------------------------------------------------------------------------ main

def run(args: argparse.Namespace) -> Path:
    if args.clients < 1:
        raise SystemExit("--clients must be >= 1")
    if args.clients > args.max_clients:
        raise SystemExit(f"--clients {args.clients} exceeds the packing headroom --max-clients {args.max_clients}")
    if not args.no_secagg and args.secagg_clients < 3:
        raise SystemExit("--secagg-clients must be >= 3 (SecAgg+ needs 3)")
    sizes = args.sizes or list(QUICK_SIZES if args.quick else FULL_SIZES)
    secagg_sizes = [] if args.no_secagg else (args.secagg_sizes or list(QUICK_SECAGG_SIZES if args.quick
                                                                        else FULL_SECAGG_SIZES))
    repeats = args.repeats or 3
    if repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    modes, packs, n = args.modes, packings(args), args.clients
    t_start = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    run_dir = make_run_dir(args.out, SCRIPT)

    print(f"calibrating each mode at {' and '.join(f'{c:,}' for c in CALIBRATION_PARAMS)} params, 2 clients ...",
          flush=True)
    rates = calibrate(args, modes, packs)
    he_est = estimate_sweep(rates, sizes, modes, n, repeats)
    sa_est = estimate_secagg(secagg_sizes, args.secagg_rounds) if secagg_sizes else 0.0
    basis = (f"HE part {format_duration(he_est)} from the calibration just run (fixed + per-parameter cost "
             f"per phase, two sizes), scaled to the sweep; SecAgg+ part {format_duration(sa_est)} from the per-point cost documented in "
             f"experiments/he_cost.py, not calibrated now; timings on a shared machine swing +-40%")
    estimate = time.perf_counter() - t_start + he_est + sa_est
    print_estimate(estimate, basis, label=f"this {'quick' if args.quick else 'full'} run")
    if args.quick and not args.sizes:
        full = estimate_sweep(rates, FULL_SIZES, modes, n, repeats) + estimate_secagg(list(FULL_SECAGG_SIZES), args.secagg_rounds)
        print(f"(the full run, sizes up to {FULL_SIZES[-1]:,}, would take ~{format_duration(full)} by the same estimate)")

    avail = mem_available()
    budget = args.mem_fraction * avail if avail else math.inf
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    points = [(d, m) for d in sizes for m in modes]
    data_for: tuple[int, Any] | None = None
    for d, m in progress(points, total=len(points), desc="he_cost"):
        if peak_bytes(m, d, n) > budget:
            skipped.append({"mode": m, "params": d, "estimated_peak_gb": peak_bytes(m, d, n) / 1e9})
            print(f"skipping {m} at {d:,} params: ~{peak_bytes(m, d, n) / 1e9:.1f} GB estimated peak > "
                  f"{budget / 1e9:.1f} GB budget", flush=True)
            continue
        if data_for is None or data_for[0] != d:
            data_for = None
            gc.collect()
            data_for = (d, make_data(d, n, args.seed))
        X, w, expected = data_for[1]
        r = run_mode(m, X, w, expected, repeats, packs, args.preset, args.seed + 1 + MODES.index(m))
        rows.append(to_row(m, d, n, repeats, args.seed, r))
        del r
    data_for = None
    gc.collect()
    write_csv(run_dir / "points.csv", rows, POINT_COLUMNS)

    srows: list[dict[str, Any]] = []
    secagg_info: dict[str, Any] = {}
    if secagg_sizes:
        print(f"SecAgg+ baseline: {args.secagg_clients} clients, sizes {secagg_sizes}, "
              f"{args.secagg_rounds} rounds per mode (Flower run_simulation in a child process) ...", flush=True)
        results, secagg_info = run_secagg(run_dir, secagg_sizes, args.secagg_clients, args.secagg_rounds, args.seed,
                                          args.secagg_timeout)
        srows = [secagg_row(r) for r in results]
        write_csv(run_dir / "secagg.csv", srows, SECAGG_COLUMNS)

    import tenseal as ts

    meta = {
        "command": "python -m experiments.he_cost " + shlex.join(sys.argv[1:]),
        "mode": "quick" if args.quick else "full",
        "sizes": sizes,
        "modes": modes,
        "clients": n,
        "repeats": repeats,
        "seed": args.seed,
        "preset": args.preset,
        "packing": {"bits": args.bits, "max_clients": args.max_clients, "clip_range": CLIP_RANGE,
                    "max_weight": MAX_WEIGHT, "dense_values_per_part": args.values_per_part,
                    "dense_bits": packings(args)["fedkv"].bits, "dense_max_clients": args.clients},
        "secagg": {"sizes": secagg_sizes, "clients": args.secagg_clients, "rounds": args.secagg_rounds,
                   **secagg_info},
        "calibration_rates_s_per_param": rates,
        "estimate_seconds": estimate,
        "estimate_basis": basis,
        "skipped": skipped,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "tenseal": getattr(ts, "__version__", "?"),
        "started_utc": started,
    }
    plots(run_dir, rows, srows, modes)
    meta["wall_seconds"] = time.perf_counter() - t_start
    meta["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # this process (Linux: KiB)
    write_summary(run_dir, args, rows, srows, modes, meta)
    write_json(run_dir / "meta.json", meta)
    print((run_dir / "summary.md").read_text())
    print(f"took {format_duration(meta['wall_seconds'])} (estimated {format_duration(estimate)})")
    print_results_dir(run_dir)
    return run_dir


def main(argv: list[str] | None = None) -> Path:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
