"""Shared output plumbing for experiment scripts: a timestamped results directory, a CSV of every
point, a markdown summary, PNG plots (matplotlib, Agg backend), a progress bar, the common
``--quick/--seed/--out`` flags and an honest duration estimate line.

    parser = argparse.ArgumentParser(...)
    add_common_args(parser, quick_help="CI-sized run (< 5 min on 2 cores)")
    args = parser.parse_args()
    run_dir = make_run_dir(args.out, "he_cost")        # results/he_cost/20250101-120000/
    for point in progress(points, desc="he_cost"):
        ...
    write_csv(run_dir / "points.csv", rows)
    (run_dir / "summary.md").write_text("# ...\\n\\n" + markdown_table(rows, columns))
    plot_lines(run_dir / "bytes.png", {"fedkv": (xs, ys)}, xlabel="params", ylabel="B/param")
    print_results_dir(run_dir)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "DEFAULT_OUT",
    "add_common_args",
    "format_duration",
    "make_run_dir",
    "markdown_table",
    "plot_lines",
    "print_estimate",
    "print_results_dir",
    "progress",
    "write_csv",
    "write_json",
]

DEFAULT_OUT = "results"
T = TypeVar("T")


def add_common_args(parser: argparse.ArgumentParser, quick_help: str = "CI-sized run (< 5 min on 2 cores)") -> None:
    """Add the flags every experiment script takes: --quick, --seed, --out."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"results root; the run writes <out>/<script>/<timestamp>/ (default {DEFAULT_OUT}/)")


def make_run_dir(out: str | os.PathLike[str], script: str, timestamp: str | None = None) -> Path:
    """Create and return ``<out>/<script>/<timestamp>/`` (UTC ``YYYYmmdd-HHMMSS``); a suffix
    ``-1``, ``-2``, ... keeps two runs started in the same second apart."""
    if not script or os.sep in script or script in {".", ".."}:
        raise ValueError(f"script must be a plain name, not {script!r}")
    stamp = timestamp or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    parent = Path(out) / script
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(1000):
        path = parent / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free run directory for {stamp} under {parent}")


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def write_csv(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]],
              columns: Sequence[str] | None = None) -> Path:
    """Write rows (dicts) as CSV; columns default to the union of keys in first-seen order.
    A row missing a listed column is an error (no silent blanks), and so is an extra key when
    ``columns`` is given."""
    cols = _columns(rows, columns)
    path = Path(path)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="raise")
        writer.writeheader()
        for i, row in enumerate(rows):
            missing = [c for c in cols if c not in row]
            if missing:
                raise ValueError(f"row {i} lacks column(s) {missing}")
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
    return path


def _csv_value(v: Any) -> Any:
    if isinstance(v, float):
        return repr(v)  # round-trips exactly; 'nan'/'inf' stay visible
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return v


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    path = Path(path)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def _fmt(v: Any, floatfmt: str) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, floatfmt)
    if isinstance(v, int):
        return f"{v:,}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   headers: Mapping[str, str] | None = None, floatfmt: str = ".4g") -> str:
    """A GitHub-markdown table; floats with ``floatfmt``, ints with thousands separators."""
    cols = _columns(rows, columns)
    if not cols:
        raise ValueError("a table needs at least one column")
    headers = headers or {}
    lines = ["| " + " | ".join(headers.get(c, c) for c in cols) + " |",
             "|" + "|".join("---:" if rows and isinstance(rows[0].get(c), (int, float)) else "---" for c in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, ""), floatfmt) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot_lines(path: str | os.PathLike[str], series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, title: str = "", logx: bool = True, logy: bool = True,
               styles: Mapping[str, Mapping[str, Any]] | None = None,
               bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> Path:
    """One PNG with a line per series (label -> (xs, ys)); log axes by default. ``styles`` maps a
    label to extra ``plt.plot`` keyword arguments (marker, linestyle, ...); ``bands`` maps a
    label to (lows, highs) at its xs, drawn as error bars (e.g. a 95 % CI over seeds)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    try:
        for label, (xs, ys) in series.items():
            if len(xs) != len(ys):
                raise ValueError(f"series {label!r}: {len(xs)} x values but {len(ys)} y values")
            kw = {"marker": "o"} | dict((styles or {}).get(label, {}))
            line = ax.plot(list(xs), list(ys), label=label, **kw)[0]
            if bands and label in bands:
                lo, hi = bands[label]
                ys_ = list(ys)
                err = [[max(y - a, 0.0) for y, a in zip(ys_, lo)], [max(b - y, 0.0) for y, b in zip(ys_, hi)]]
                ax.errorbar(list(xs), ys_, yerr=err, fmt="none", ecolor=line.get_color(), capsize=3, alpha=0.8)
        if logx:
            ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if series:  # outside the axes, so it never hides a point
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "", disable: bool = False) -> Iterator[T]:
    """A tqdm bar on stderr (``TQDM_DISABLE=1`` in the environment hides it)."""
    from tqdm import tqdm

    kw = {"disable": True} if disable else {}  # an explicit disable=False would beat TQDM_DISABLE
    return iter(tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, **kw))


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"not a duration: {seconds}")
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def print_estimate(seconds: float, basis: str, label: str = "this run") -> str:
    """Print (and return) the expected duration line, with what the estimate rests on."""
    line = f"expected duration of {label}: ~{format_duration(seconds)} ({basis})"
    print(line, flush=True)
    return line


def print_results_dir(path: str | os.PathLike[str]) -> None:
    print(f"results: {Path(path).resolve()}", flush=True)
