"""``python -m cache``: read and change a live node's cache from another process.

    python -m cache stats --dir DIR              # the live engine's stats (strict JSON)
    python -m cache set evict_batch 24 --dir DIR # validated, applied by the engine: 16 → 24
    python -m cache tunables                     # the tunables and their allowed values
    python -m cache overhead [--quick]           # what the instrumentation costs (JSON)

Exit codes: 0 ok; 2 bad usage or a value the validator refuses; 1 no live engine (no
snapshot, its writer exited, or no answer in time) or an unreadable file in ``DIR/live``.
The engine side and the file protocol are in ``cache/control.py``.

``stats`` on a node's cache directory whose own engine (the trainer's, live only while a
ClientApp message runs) is not live shows the live engine of an agent that keeps its cache
in a subdirectory instead, named in ``dir``: ``python -m node.serving.serve --cache-dir DIR``
publishes in ``DIR/serve``. ``set`` never changes another engine than ``DIR``'s; its error
names the live one. The JSON is strict: a figure that is not finite (an accuracy before
any sample) is ``null``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from cache.control import (
    CorruptLiveFileError, NoLiveEngineError, Snapshot, live_engines_below, read_snapshot,
    request_change,
)
from cache.errors import ConfigError
from cache.tunables import TUNABLES, validate_tunable

OK, NO_ENGINE, BAD_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cache", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    stats = sub.add_parser("stats", help="print the live engine's stats snapshot (JSON)")
    stats.add_argument("--dir", required=True, help="the cache directory (KVCache.open)")
    put = sub.add_parser("set", help="change a tunable of the live engine")
    put.add_argument("key", help="one of: " + ", ".join(TUNABLES))
    put.add_argument("value")
    put.add_argument("--dir", required=True, help="the cache directory (KVCache.open)")
    put.add_argument("--timeout", type=float, default=5.0,
                     help="seconds to wait for the engine's answer (default 5)")
    sub.add_parser("tunables", help="list the tunables and their allowed values")
    over = sub.add_parser("overhead", help="time a decode loop with and without the "
                                           "instrumentation (JSON)")
    over.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    return p


def _finite(obj: object) -> object:
    """``obj`` with every non-finite float (NaN, ±inf) replaced by None: JSON has no NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _print_json(obj: object, **kw) -> None:
    print(json.dumps(_finite(obj), allow_nan=False, **kw))


def _print_snapshot(directory: str, snap: Snapshot) -> None:
    _print_json({"dir": directory, "pid": snap.pid, "age_s": round(snap.age_s, 3),
                 "live": snap.live, "stats": snap.stats}, indent=1)


def _stats(directory: str) -> int:
    try:
        snap, own_error = read_snapshot(directory), None
    except (NoLiveEngineError, CorruptLiveFileError) as e:
        snap, own_error = None, e
    if snap is None or not snap.live:
        below = live_engines_below(directory)
        if below:  # e.g. node.serving.serve on DIR publishes in DIR/serve while the trainer is idle
            where, live = below[0]
            why = own_error if snap is None else snap.why_not_live()
            others = "".join(f"; also live: {d} (pid {s.pid})" for d, s in below[1:])
            _print_snapshot(where, live)
            print(f"python -m cache stats: {directory} has no live engine of its own ({why}); "
                  f"this is the live engine in {where} (pid {live.pid}){others}", file=sys.stderr)
            return OK
        if own_error is not None:
            raise own_error
    _print_snapshot(directory, snap)
    if not snap.live:
        print(f"python -m cache stats: no live engine for {directory}: {snap.why_not_live()} "
              f"(the snapshot above is {snap.age_s:.1f} s old)", file=sys.stderr)
        return NO_ENGINE
    return OK


def _set(directory: str, key: str, raw: str, timeout: float) -> int:
    value = validate_tunable(key, raw)  # refused here, before any live engine is asked
    try:
        answer = request_change(directory, key, value, timeout_s=timeout)
    except NoLiveEngineError as e:  # never redirected: name the live engine below instead
        hints = "".join(f"; the engine in {d} (pid {s.pid}) is live: python -m cache set "
                        f"{key} {raw} --dir {d}" for d, s in live_engines_below(directory))
        raise NoLiveEngineError(f"{e}{hints}") from None
    print(f"{key}: {answer['old']!r} → {answer['new']!r} (engine pid {answer.get('pid')})")
    return OK


def _tunables() -> int:
    for name, spec in TUNABLES.items():
        print(f"{name}: {spec.allowed}")
    return OK


def _overhead(quick: bool) -> int:
    from cache.overhead import OverheadConfig, measure_overhead  # torch: only for this command
    _print_json(measure_overhead(OverheadConfig.quick() if quick else OverheadConfig()))
    return OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "stats":
            return _stats(args.dir)
        if args.command == "set":
            return _set(args.dir, args.key, args.value, args.timeout)
        if args.command == "tunables":
            return _tunables()
        return _overhead(args.quick)
    except ConfigError as e:  # includes ChangeRejectedError and UnknownTunableError
        print(f"python -m cache {args.command}: {e}", file=sys.stderr)
        return BAD_USAGE
    except (NoLiveEngineError, CorruptLiveFileError) as e:
        print(f"python -m cache {args.command}: {e}", file=sys.stderr)
        return NO_ENGINE


if __name__ == "__main__":
    sys.exit(main())
