"""Per-round curves of a run: a results JSON (``federation.results``) -> PNGs and a CSV.

    python -m federation.tools.plot RESULTS.json [--out DIR]

Writes, into DIR (default: a folder beside the JSON named after it without ``.json``):

- ``rounds.csv``: one row per round, nested dicts flattened (``seconds.train``,
  ``server_seconds.wait``, ``serving.tokens_per_s``), lists as JSON, null as an empty cell;
- ``metric.png``: the eval metric per round, and train/eval loss when present;
- ``epsilon.png``: every round key ``epsilon_*`` with a finite value (a new ε observer shows
  up without a change here); log y axis when the values span more than two decades;
- ``bytes.png``: mean upload per client and the aggregate sent back;
- ``seconds.png``: the server's round phase by phase (``server_seconds``, stacked: they sum to
  ``seconds["round"]``), or the ``seconds`` phases as lines for files without it.

A plot with nothing finite to show is skipped with a note. Exit status 0; 2 for input that is
not a readable fedkv results file (one line on stderr, no traceback); 1 for a file with no
rounds. Nothing is written unless the whole file checks out.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn: importing this stays cheap
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

CSV_NAME = "rounds.csv"
NUMBER_FIELDS = ("population", "sampled", "num_clients", "train_loss", "eval_loss", "eval_metric",
                 "eval_clients", "upload_bytes_mean", "aggregate_bytes", "clipped_fraction",
                 "saturated_fraction", "weight_capped", "noise_shares_added", "delta",
                 "saturation_delta", "delta_total", "kv_blocks_on_disk", "key_epoch")
"""Round fields that must be a number or null (besides ``round`` and every ``epsilon_*``)."""
PHASE_FIELDS = ("seconds", "server_seconds")
"""Round fields that must map phase names to numbers (or null)."""
OBJECT_FIELDS = ("node_seconds", "serving", "upload_bytes", "node_sources")
"""Round fields that must be objects (their contents go to the CSV as they are)."""
SECONDS_TOTALS = ("round", "train_phase", "evaluate_phase", "nodes_busy", "transport")
"""``seconds`` keys that add up other keys: left out of the per-phase lines."""


class ResultsError(ValueError):
    """The input is not a readable fedkv results file (exit status 2)."""


class NoRounds(ResultsError):
    """A valid results file without rounds (exit status 1): nothing to plot."""


# --- reading and checking ---------------------------------------------------------------------

def load_results(path: Path) -> dict[str, Any]:
    """The results dict of ``path``, checked; ResultsError says what is wrong with it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ResultsError(f"{path}: is a directory, expected a results .json file") from None
    except UnicodeDecodeError:
        raise ResultsError(f"{path}: not JSON (not UTF-8 text)") from None
    except OSError as e:
        raise ResultsError(f"{path}: cannot read: {e.strerror or e}") from None
    results = _parse_json(path, text)
    try:
        check_results(results)
    except ResultsError as e:
        raise type(e)(f"{path}: {e}") from None
    return results


def _parse_json(path: Path, text: str) -> Any:
    """Tell an empty or cut-off file (a run still writing, a partial copy) from non-JSON."""
    if not text.strip():
        raise ResultsError(f"{path}: empty file, expected a results JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        cut = _ends_mid_value(text[e.pos:].strip()) or e.msg.startswith("Unterminated string")
        what = "truncated JSON (ends before the document does)" if cut else "not JSON"
        raise ResultsError(f"{path}: {what}: {e.msg} at line {e.lineno} column {e.colno}") from None


def _ends_mid_value(rest: str) -> bool:
    """Whether what the decoder stopped at is nothing, or the start of a literal or the tail of
    a number ("1e" of "1e-05", "nu" of "null"): the file was cut there, not written wrong."""
    return not rest or any(w.startswith(rest) for w in ("null", "true", "false")) \
        or re.fullmatch(r"[-+.eE0-9]+", rest) is not None


def check_results(results: Any) -> None:
    """Raise ResultsError unless ``results`` looks like ``RunResults.to_dict()``; NoRounds if
    it has no rounds. Missing round fields are fine (older schemas lack some)."""
    if not isinstance(results, dict) or not isinstance(results.get("rounds"), list):
        got = (f"an object with keys {sorted(results)[:8]}" if isinstance(results, dict)
               else f"a JSON {_json_type(results)}")
        raise ResultsError(f"not a fedkv results file: expected an object with a 'rounds' list, got {got}")
    if not results["rounds"]:
        raise NoRounds(f"no rounds to plot (status: {results.get('status', 'unknown')})")
    for i, rnd in enumerate(results["rounds"]):
        _check_round(i, rnd)


def _check_round(i: int, rnd: Any) -> None:
    """Every field the plots and the CSV read has the type ``RoundRecord`` gives it."""
    where = f"rounds[{i}]"
    if not isinstance(rnd, dict):
        raise ResultsError(f"{where}: expected an object, got a JSON {_json_type(rnd)}")
    if not _is_int(rnd.get("round")):
        raise ResultsError(f"{where}: field 'round' should be an integer, got {_shown(rnd.get('round'))}")
    where = f"{where} (round {rnd['round']})"
    for key in (*NUMBER_FIELDS, *(k for k in rnd if k.startswith("epsilon_"))):
        if not _is_number(rnd.get(key)):
            raise ResultsError(f"{where}: field '{key}' should be a number or null, got {_shown(rnd[key])}")
    if rnd.get("metric") is not None and not isinstance(rnd["metric"], str):
        raise ResultsError(f"{where}: field 'metric' should be a string, got {_shown(rnd['metric'])}")
    for key in (*PHASE_FIELDS, *OBJECT_FIELDS):
        if rnd.get(key) is not None and not isinstance(rnd[key], dict):
            raise ResultsError(f"{where}: field '{key}' should be an object, got {_shown(rnd[key])}")
    for key in PHASE_FIELDS:
        for phase, value in (rnd.get(key) or {}).items():
            if not _is_number(value):
                raise ResultsError(f"{where}: field '{key}.{phase}' should be a number or null, got {_shown(value)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _json_type(v: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _shown(v: Any) -> str:
    """A wrong value for an error message: its JSON type and a short excerpt."""
    text = json.dumps(v)
    return f"{_json_type(v)} {text if len(text) <= 40 else text[:37] + '...'}"


# --- the table ------------------------------------------------------------------------------

def rounds_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat dict per round (dotted keys for nested dicts): the CSV's rows, and the one
    place the plots read values from. Columns are in order of first appearance."""
    return [_flatten(rnd) for rnd in results["rounds"]]


def _flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """``rows`` as CSV: every column any round has; null and absent are empty cells."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([_cell(row.get(c)) for c in columns] for row in rows)
    return path


def _cell(v: Any) -> str:
    """Floats keep full precision (repr round-trips); lists, empty dicts and booleans as JSON."""
    if v is None:
        return ""
    if isinstance(v, (bool, list, dict)):
        return json.dumps(v)
    return repr(v) if isinstance(v, float) else str(v)


# --- series ---------------------------------------------------------------------------------

def series(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    """The column ``key`` as floats, NaN for null or absent (a gap in the curve)."""
    return [math.nan if r.get(key) is None else float(r[key]) * scale for r in rows]


def _finite(values: list[float]) -> bool:
    return any(math.isfinite(v) for v in values)


def epsilon_series(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Every top-level ``epsilon_*`` column with a finite value: one curve per ε observer."""
    keys = dict.fromkeys(k for r in rows for k in r if k.startswith("epsilon_") and "." not in k)
    found = {k: series(rows, k) for k in keys}
    return {k: v for k, v in found.items() if _finite(v)}


def seconds_series(rows: list[dict[str, Any]]) -> tuple[str, dict[str, list[float]]]:
    """("server_seconds", its phases) when the file has them, else ("seconds", the phase
    keys without totals); phases that are null or 0 in every round are left out."""
    for group, skip in (("server_seconds", ()), ("seconds", SECONDS_TOTALS)):
        prefix = f"{group}."
        keys = dict.fromkeys(k for r in rows for k in r if k.startswith(prefix) and k[len(prefix):] not in skip)
        found = {k[len(prefix):]: series(rows, k) for k in keys}
        found = {k: v for k, v in found.items() if any(math.isfinite(x) and x != 0 for x in v)}
        if found:
            return group, found
    return "seconds", {}


# --- figures --------------------------------------------------------------------------------

def _figure(nrows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure on the Agg canvas without pyplot: no display, no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[-1].set_xlabel("round")
    return fig, list(axes)


def _lines(ax: Axes, x: list[int], curves: dict[str, list[float]]) -> None:
    """One curve per series; markers differ so that curves lying on each other stay visible."""
    for i, (label, ys) in enumerate(curves.items()):
        ax.plot(x, ys, marker="os^Dv<>ph"[i % 9], markersize=8 - 1.5 * (i % 3), label=label)
    ax.legend(fontsize="small")


def metric_figure(rows: list[dict[str, Any]]) -> Figure | None:
    """The eval metric; the losses below it (their scale differs from perplexity's)."""
    x, metric = _rounds(rows), series(rows, "eval_metric")
    losses = {k: series(rows, k) for k in ("train_loss", "eval_loss")}
    losses = {k: v for k, v in losses.items() if _finite(v)}
    if not _finite(metric) and not losses:
        return None
    name = next((r["metric"] for r in rows if r.get("metric")), "metric")
    fig, axes = _figure(2 if losses else 1)
    _lines(axes[0], x, {f"eval {name}": metric})
    axes[0].set(ylabel=name, title=f"eval {name} per round")
    if losses:
        _lines(axes[1], x, losses)
        axes[1].set(ylabel="loss", title="loss per round (train_loss is null under DP)")
    return fig


def epsilon_figure(rows: list[dict[str, Any]]) -> Figure | None:
    """One ε curve per observer; log scale when they span more than two decades."""
    curves = epsilon_series(rows)
    if not curves:
        return None
    fig, (ax,) = _figure()
    _lines(ax, _rounds(rows), curves)
    values = [v for ys in curves.values() for v in ys if math.isfinite(v)]
    if min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    delta = run_delta(rows)
    ax.set(ylabel="ε", title="ε so far per round" + (f" (δ = {delta:g})" if delta is not None else ""))
    return fig


def run_delta(rows: list[dict[str, Any]]) -> float | None:
    """The run's δ: the last round's ``delta_total`` (δ + (1 + e^ε)·δ_sat, the largest so far),
    not the target ``delta``, which only results that predate ``delta_total`` fall back to."""
    for key in ("delta_total", "delta"):
        found = [v for v in (r.get(key) for r in rows) if v is not None and _is_number(v) and math.isfinite(v)]
        if found:
            return found[-1]
    return None


def bytes_figure(rows: list[dict[str, Any]]) -> Figure | None:
    """What a client sends and what the server sends back, per round."""
    curves = {"upload per client (mean)": series(rows, "upload_bytes_mean", 1 / 1024),
              "aggregate (per copy)": series(rows, "aggregate_bytes", 1 / 1024)}
    curves = {k: v for k, v in curves.items() if _finite(v)}
    if not curves:
        return None
    fig, (ax,) = _figure()
    _lines(ax, _rounds(rows), curves)
    top = max(v for ys in curves.values() for v in ys if math.isfinite(v))
    ax.set(ylabel="KiB", title="bytes per round", ylim=(0, 1.15 * top if top > 0 else 1))
    return fig


def seconds_figure(rows: list[dict[str, Any]]) -> Figure | None:
    """Where a round's time goes: the server's phases stacked (they sum to the round), or the
    older ``seconds`` phases as lines (they overlap, so no stacking)."""
    group, curves = seconds_series(rows)
    if not curves:
        return None
    fig, (ax,) = _figure()
    x = _rounds(rows)
    if group == "server_seconds":
        _stacked(ax, x, curves)
        total = series(rows, "seconds.round")
        if _finite(total):
            ax.plot(x, total, "k_", markersize=20, label="seconds.round")
        ax.legend(fontsize="x-small", ncols=2, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        _lines(ax, x, curves)
    ax.set(ylabel="seconds", title=f"{group} per phase per round")
    return fig


def _stacked(ax: Axes, x: list[int], curves: dict[str, list[float]]) -> None:
    from matplotlib import colormaps

    colors = colormaps["tab20"].colors
    bottom = [0.0] * len(x)
    for i, (phase, ys) in enumerate(curves.items()):
        heights = [0.0 if math.isnan(v) else v for v in ys]
        ax.bar(x, heights, bottom=bottom, label=phase, color=colors[i % len(colors)])
        bottom = [b + h for b, h in zip(bottom, heights)]


def _rounds(rows: list[dict[str, Any]]) -> list[int]:
    return [r["round"] for r in rows]


PLOTS: dict[str, tuple[Callable[[list[dict[str, Any]]], Figure | None], str]] = {
    "metric.png": (metric_figure, "no finite eval metric or loss"),
    "epsilon.png": (epsilon_figure, "no epsilon_* field has a finite value (a run without DP)"),
    "bytes.png": (bytes_figure, "no finite byte counts"),
    "seconds.png": (seconds_figure, "no phase times"),
}
"""File name -> (figure builder, why it is skipped when the builder has nothing to draw)."""


# --- writing --------------------------------------------------------------------------------

def default_out_dir(results_path: Path) -> Path:
    """Beside the JSON, named after it: run-3-20261201-120000.json -> run-3-20261201-120000/."""
    path = Path(results_path)
    return path.with_suffix("") if path.suffix else path.with_name(path.name + "-plots")


def write_plots(results: dict[str, Any], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Write the CSV and every plot that has data; returns (paths written, skip notes)."""
    rows = rounds_table(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, notes = [write_csv(rows, out_dir / CSV_NAME)], []
    for name, (build, why) in PLOTS.items():
        fig = build(rows)
        if fig is None:
            notes.append(f"skipped {name}: {why}")
            continue
        fig.savefig(out_dir / name, dpi=100)
        written.append(out_dir / name)
    return written, notes


def plot_run(results_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Check ``results_path`` and write rounds.csv and the PNGs into ``out_dir`` (default
    ``default_out_dir``); returns the paths written, CSV first. Raises ResultsError."""
    results = load_results(Path(results_path))
    target = Path(out_dir) if out_dir is not None else default_out_dir(Path(results_path))
    return write_plots(results, target)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m federation.tools.plot",
        description="Per-round curves of a fedkv run (metric, ε per observer, bytes, seconds per "
        "phase) as PNGs, and the rounds as rounds.csv.",
    )
    parser.add_argument("results", type=Path, help="the run's results JSON (FEDKV_RESULTS <path>)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the files (default: beside the JSON, named after it)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # a bench extra until it is a base dependency
        print("error: federation.tools.plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    out_dir = args.out if args.out is not None else default_out_dir(args.results)
    try:
        written, notes = write_plots(load_results(args.results), out_dir)
    except NoRounds as e:
        print(str(e), file=sys.stderr)
        return 1
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write to {out_dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    for line in [*notes, *map(str, written)]:
        print(line)
    print(f"wrote {len(written) - 1} plots and {CSV_NAME} to {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
