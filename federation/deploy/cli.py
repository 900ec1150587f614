"""A real multi-process Flower deployment on this machine: TLS, SuperNode auth, a crash.

``python -m federation.deploy demo ...``: the steps in order (``_demo_steps``), the cleanup
that stops every process by pid whatever happened, and the one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from federation.deploy.app_run import run_app
from federation.deploy.demo import Demo, prepare, tail
from federation.deploy.netns import Netns
from federation.deploy.processes import interrupt, say
from federation.deploy.superlink import (
    refusal_results, register_nodes, start_refusal_probes, start_superlink, start_supernodes,
)
from federation.deploy.flwr_sandbox import REPO
from federation.deploy.serve_probe import ServeProbe

__all__ = ["demo_main", "main", "parse_args", "summary", "workdir_note"]


def workdir_note(work: Path, removed: bool) -> str:
    """Where kits, logs and results are after the demo (or that they were removed, and how
    to keep them)."""
    if removed:
        return (f"kits, logs and results were in {work}, a temporary directory now removed "
                f"(--keep keeps it; --workdir DIR writes them to DIR and keeps them)")
    return f"kits, logs and results are kept in {work} (kits/, logs/, results/)"


def summary(demo: Demo, leftovers: int, wall_s: float) -> dict[str, object]:
    outcome, refused = demo.outcome, demo.refused
    res = (outcome.results if outcome else None) or {}
    link_log = tail(demo.logs / "superlink.log", 10_000_000)
    return {
        "tls": "Uvicorn running on https://" in link_log,
        "node_auth": bool(demo.node_ids) and refused.get("unregistered", False),
        "rounds_completed": len(res.get("rounds", [])),
        "status": res.get("status"),
        "killed_node": demo.killed,
        "key_rotations": res.get("key_rotations", 0),
        "refused_unregistered": refused.get("unregistered", False),
        "refused_bad_cert": refused.get("bad-cert", False),
        "server_key_origin": res.get("key_origin"),
        "kv_blocks_on_disk_per_round": [r.get("kv_blocks_on_disk", 0) for r in res.get("rounds", [])],
        "serving_per_round": [r.get("serving", {}) for r in res.get("rounds", [])],
        "serve_agent": demo.serve.report() if demo.serve is not None else None,
        "leftover_processes": leftovers,
        "wall_s": round(wall_s, 1),
        "nodes": demo.nodes,
        "netns": demo.netns is not None,
        "nodes_in_own_netns": demo.isolated_nodes,
        "sealed_kits": demo.seal_kits,
        "workdir": str(demo.work),
    }


def demo_main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    own_work = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="fedkv-demo-")) if own_work else Path(args.workdir).resolve()
    demo = Demo(work, args.nodes, args.rounds, args.task, args.round_timeout, args.kill_one, args.run_config)
    demo.app_ref, demo.seal_kits = args.app_ref, args.seal_kits
    if args.serve:
        demo.serve = ServeProbe(work, work / "serve-node-0" / "kv-cache")
    if args.netns:
        demo.netns = Netns(f"{os.getpid() % 10000}")
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    error: BaseException | None = None
    try:
        _demo_steps(demo, args)
    except (Exception, KeyboardInterrupt, SystemExit) as exc:
        error = exc
        say(f"demo failed: {type(exc).__name__}: {exc}")
    finally:
        leftovers = _cleanup(demo, previous)
    remove_work = own_work and not args.keep
    out = _report(demo, error, leftovers, time.monotonic() - t0, remove_work=remove_work)
    say(workdir_note(work, removed=remove_work))
    print(json.dumps(out), flush=True)
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return 130
    return 0 if error is None and out["rounds_completed"] == args.rounds else 1


def _cleanup(demo: Demo, handlers: dict[int, object]) -> int:
    """Stop every process by pid, remove namespaces; returns how many processes survived."""
    for sig in handlers:  # a second Ctrl-C must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    try:
        say("stopping every process started, by pid")
        leftovers = demo.procs.stop_all()
        if demo.netns:
            demo.netns.remove()
            if demo.netns.leftovers():
                say(f"could not remove {demo.netns.leftovers()}")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return leftovers


def _report(demo: Demo, error: BaseException | None, leftovers: int, wall_s: float, remove_work: bool) -> dict:
    out = summary(demo, leftovers, wall_s)
    out["started_processes"] = len(demo.procs.seen)
    if demo.work.is_dir():  # for whoever checks afterwards that none of them is still alive
        (demo.work / "pids.json").write_text(json.dumps(demo.procs.started_pids()))
    if error is not None:
        out["error"] = f"{type(error).__name__}: {error}"
    if remove_work:
        shutil.rmtree(demo.work, ignore_errors=True)
        out["workdir"] = None
    return out


def _demo_steps(demo: Demo, args: argparse.Namespace) -> None:
    if args.nodes < 2 + int(args.kill_one):
        raise ValueError("need at least 2 surviving nodes (min-clients=2)")
    if args.serve and args.task != "lm":
        raise ValueError("--serve needs --task lm (the digits model does not generate text)")
    prepare(demo)
    start_superlink(demo)
    register_nodes(demo)
    probes = start_refusal_probes(demo)
    start_supernodes(demo)
    demo.refused = refusal_results(demo, probes)
    if demo.serve is not None:
        demo.serve.start(demo.procs, {**demo.env, **demo.node_env}, demo.logs / "serve-node-0.log", REPO)
    try:
        demo.outcome = run_app(demo, args.run_timeout)
    finally:
        if demo.serve is not None:
            demo.serve.stop()
    say(f"flwr run exited with {demo.outcome.returncode}; results status: "
        f"{(demo.outcome.results or {}).get('status')}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m federation.deploy", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="provision, start SuperLink + SuperNodes with TLS and auth, run, clean up")
    d.add_argument("--nodes", type=int, default=5)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--kill-one", action="store_true",
                   help="SIGKILL the highest partition's SuperNode mid round R-1 of R (the round before "
                        "the last, so the key rotation after it is seen; round 1 with --rounds 1 or 2)")
    d.add_argument("--netns", action="store_true", help="each SuperNode in its own network namespace (root)")
    d.add_argument("--workdir", default=None,
                   help="keep kits, logs and results here (default: a temp dir, removed unless --keep)")
    d.add_argument("--seal-kits", action="store_true",
                   help="seal node secrets with a random passphrase given to the SuperNodes only "
                        "(FEDKV_NODE_KEY_PASSPHRASE in their environment)")
    d.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    d.add_argument("--task", default="digits")
    d.add_argument("--round-timeout", type=float, default=60.0,
                   help="seconds the server waits per phase; a killed node is reported unavailable by the "
                        "SuperLink <= 60 s after its last heartbeat anyway, so a longer timeout costs little")
    d.add_argument("--run-timeout", type=float, default=420.0, help="stop flwr run after this many seconds")
    d.add_argument("--app-ref", default=None, help="run the app as committed at this git ref (default: working tree)")
    d.add_argument("--run-config", default="", help="extra run-config overrides, e.g. \"local-epochs=1\"")
    d.add_argument("--serve", action="store_true",
                   help="run the OpenAI-compatible server (python -m node.serving.openai_api, scheduler "
                        "backend) beside SuperNode 0 on its cache directory and stream it a chat "
                        "completion every 0.5 s (--task lm)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return demo_main(args)
