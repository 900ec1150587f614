"""federation.tools.plot: a real results file (RunResults.write) -> rounds.csv and PNG curves; bad
input -> one line and exit status 2 (1 for a run without rounds), nothing written."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from federation.tools import plot
from federation.results import RoundRecord, RunResults
from tests.hang_guard import HANG_GUARD_S

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[3]


def _round(r: int, *, dp: bool = True) -> RoundRecord:
    """A round as the strategy fills it (distributed DP, CKKS, the lm task)."""
    rec = RoundRecord(
        round=r, population=5, admitted=[1, 2, 3, 4, 5], sampled=5, num_clients=5 - (r == 2),
        dropped=[{"node": 4, "phase": "train", "reason": "timeout"}] if r == 2 else [],
        train_loss=math.nan if dp else 3.0 - 0.2 * r, eval_loss=2.9 - 0.25 * r,
        eval_metric=18.0 - 2.5 * r, metric="perplexity", eval_clients=5,
        upload_bytes={str(n): 40_000 + n for n in range(1, 6)}, upload_bytes_mean=40_003.0,
        aggregate_bytes=40_100 + r,
        seconds={"train": 1.5 + r / 10, "encrypt": 0.04, "sign": 0.001, "decrypt": 0.03,
                 "writeback": 0.02, "aggregate": 0.05, "verify": 0.002, "provision": 0.3,
                 "train_phase": 2.0, "evaluate_phase": 1.0, "round": 3.5 + r / 10,
                 "nodes_busy": 2.5, "transport": 0.4},
        server_seconds={"admit": 0.3, "send": 0.01, "wait": 2.0 + r / 10, "receive": 0.02,
                        "verify": 0.002, "parse": 0.001, "deserialize": 0.01, "add": 0.03,
                        "reject": 0.0, "noise": 0.0, "serialize": 0.005, "account": 0.001,
                        "eval_send": 0.01, "eval_wait": 1.0, "eval_receive": 0.01,
                        "eval_account": 0.001, "other": 0.1},
        node_seconds={"train": {"train": 7.5, "handler": 9.0}, "evaluate": {"eval": 2.0}},
        serving={"sessions": 4, "turns": 12, "prefix_hit_rate": 0.5 + r / 10,
                 "tier_hit_rates": {"hot": 0.6, "warm": 0.2, "cold": math.nan},
                 "tokens_per_s": 900.0 + r, "ppl": 20.0 - r},
        clipped_fraction=math.nan, saturated_fraction=math.nan,
        epsilon_client=[1.5, 40.0, 6800.0][r - 1] if dp else math.nan,
        epsilon_server=[3.0, 90.0, 9000.0][r - 1] if dp else math.nan,
        delta=1e-5 if dp else math.nan, saturation_delta=1e-9 if dp else math.nan,
        delta_total=1e-5 + 2e-9 if dp else math.nan, key_epoch=0,
    )
    return rec


def _write(tmp_path: Path, rounds: list[RoundRecord], status: str = "completed") -> Path:
    run = RunResults(config={"task": "lm", "num-server-rounds": 3}, mode="simulation", run_id=3,
                     status=status, rounds=rounds)
    return run.write(tmp_path / "results")


def _edit(path: Path, change) -> Path:
    """Rewrite the results file at ``path`` after ``change(dict)``."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def run_file(tmp_path: Path) -> Path:
    return _write(tmp_path, [_round(r) for r in (1, 2, 3)])


def test_plot_run_writes_real_pngs_and_csv_beside_the_json(run_file: Path) -> None:
    from matplotlib.image import imread

    written = plot.plot_run(run_file)
    out = run_file.with_suffix("")
    assert out.name.startswith("run-3-") and out.parent == run_file.parent
    names = ["rounds.csv", "metric.png", "epsilon.png", "bytes.png", "seconds.png"]
    assert written == [out / n for n in names]
    for png in written[1:]:
        assert png.read_bytes()[:8] == PNG_MAGIC, png
        pixels = imread(png)
        assert pixels.shape[0] >= 200 and pixels.shape[1] >= 400, (png, pixels.shape)
        assert pixels[..., :3].std() > 0.05, f"{png} is blank"


def test_csv_has_one_flat_row_per_round_with_the_json_values(run_file: Path) -> None:
    plot.plot_run(run_file)
    data = json.loads(run_file.read_text())
    rows = _csv(run_file.with_suffix("") / "rounds.csv")
    assert len(rows) == 3
    for col in ("round", "eval_metric", "metric", "epsilon_client", "epsilon_server",
                "upload_bytes_mean", "aggregate_bytes", "seconds.train", "seconds.round",
                "server_seconds.wait", "serving.tokens_per_s", "serving.tier_hit_rates.hot",
                "node_seconds.train.handler", "upload_bytes.3", "dropped"):
        assert col in rows[0], col
    assert "seconds" not in rows[0] and "serving" not in rows[0]  # flattened, not a JSON blob
    for row, rnd in zip(rows, data["rounds"]):
        assert int(row["round"]) == rnd["round"]
        assert float(row["epsilon_client"]) == rnd["epsilon_client"]
        assert float(row["server_seconds.wait"]) == rnd["server_seconds"]["wait"]
        assert float(row["serving.tokens_per_s"]) == rnd["serving"]["tokens_per_s"]
        assert row["metric"] == "perplexity"
    assert json.loads(rows[1]["dropped"]) == [{"node": 4, "phase": "train", "reason": "timeout"}]


def test_null_values_are_empty_cells(run_file: Path) -> None:
    data = json.loads(run_file.read_text())
    assert data["rounds"][0]["train_loss"] is None  # null under DP
    assert data["rounds"][0]["serving"]["tier_hit_rates"]["cold"] is None
    plot.plot_run(run_file)
    rows = _csv(run_file.with_suffix("") / "rounds.csv")
    assert [r["train_loss"] for r in rows] == ["", "", ""]
    assert [r["serving.tier_hit_rates.cold"] for r in rows] == ["", "", ""]
    assert rows[0]["eval_loss"] != ""


def test_a_new_epsilon_observer_gets_a_column_and_a_curve(run_file: Path, tmp_path: Path) -> None:
    def add_observer(d: dict) -> None:
        for i, rnd in enumerate(d["rounds"]):
            rnd["epsilon_server_view"] = [None, 12.5, 30.0][i]
            rnd["epsilon_unused"] = None  # no finite value: no curve
    _edit(run_file, add_observer)
    written = plot.plot_run(run_file, tmp_path / "out")
    rows = _csv(written[0])
    assert [r["epsilon_server_view"] for r in rows] == ["", "12.5", "30.0"]
    table = plot.rounds_table(json.loads(run_file.read_text()))
    curves = plot.epsilon_series(table)
    assert set(curves) == {"epsilon_client", "epsilon_server", "epsilon_server_view"}
    assert curves["epsilon_server_view"][1:] == [12.5, 30.0] and math.isnan(curves["epsilon_server_view"][0])
    fig = plot.epsilon_figure(table)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["epsilon_client", "epsilon_server", "epsilon_server_view"]
    assert fig.axes[0].get_yscale() == "log"  # 1.5 .. 9000 spans more than two decades


def test_epsilon_axis_is_linear_within_two_decades(run_file: Path) -> None:
    table = plot.rounds_table(json.loads(run_file.read_text()))
    for row, eps in zip(table, (2.0, 5.0, 8.0)):
        row["epsilon_client"], row["epsilon_server"] = eps, eps * 2
    assert plot.epsilon_figure(table).axes[0].get_yscale() == "linear"


def test_epsilon_title_gives_the_runs_delta_total_not_target_delta(tmp_path: Path) -> None:
    """Issue 31 item 6: the title said δ = 1e-05 (``delta``, the target) where the run's δ is
    ``delta_total`` (δ + (1 + e^ε)·δ_sat, the results' own figure): the last round's, the
    largest so far; ``delta`` only for results that predate ``delta_total``."""
    rounds = [_round(r) for r in (1, 2, 3)]
    for rec, total in zip(rounds, (1.2e-5, 2.5e-5, 3.7e-5)):
        rec.delta_total = total
    table = plot.rounds_table(json.loads(_write(tmp_path, rounds).read_text()))
    title = plot.epsilon_figure(table).axes[0].get_title()
    assert "δ = 3.7e-05" in title and "1e-05" not in title, title
    for row in table:
        row.pop("delta_total")
    assert "δ = 1e-05" in plot.epsilon_figure(table).axes[0].get_title()


def test_a_run_without_dp_skips_the_epsilon_plot_with_a_note(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path, [_round(r, dp=False) for r in (1, 2, 3)])
    assert plot.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    out = path.with_suffix("")
    assert lines[0].startswith("skipped epsilon.png: no epsilon_* field has a finite value")
    assert lines[1:-1] == [str(out / n) for n in ("rounds.csv", "metric.png", "bytes.png", "seconds.png")]
    assert lines[-1] == f"wrote 3 plots and rounds.csv to {out}"
    assert not (out / "epsilon.png").exists()
    assert [r["train_loss"] != "" for r in _csv(out / "rounds.csv")] == [True] * 3


def test_main_prints_every_path_and_a_summary(run_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "plots"
    assert plot.main([str(run_file), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"wrote 4 plots and rounds.csv to {out}"
    assert lines[:-1] == [str(out / n) for n in ("rounds.csv", "metric.png", "epsilon.png", "bytes.png", "seconds.png")]
    assert all(Path(p).stat().st_size > 1000 for p in lines[1:-1])


def test_seconds_are_the_server_phases_else_the_older_seconds(run_file: Path) -> None:
    table = plot.rounds_table(json.loads(run_file.read_text()))
    group, curves = plot.seconds_series(table)
    assert group == "server_seconds"
    assert "wait" in curves and "reject" not in curves  # 0 in every round: no bar
    assert curves["wait"] == [2.1, 2.2, 2.3]
    older = [{k: v for k, v in row.items() if not k.startswith("server_seconds.")} for row in table]
    group, curves = plot.seconds_series(older)
    assert group == "seconds"
    assert "train" in curves and "round" not in curves and "train_phase" not in curves
    assert plot.seconds_figure(older) is not None


def test_metric_plot_has_the_metric_and_the_losses_present(tmp_path: Path) -> None:
    table = plot.rounds_table(json.loads(_write(tmp_path, [_round(r) for r in (1, 2)]).read_text()))
    fig = plot.metric_figure(table)
    top, bottom = fig.axes
    assert top.get_ylabel() == "perplexity"
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == ["eval_loss"]  # train_loss null under DP


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, federation.tools.plot; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_python_dash_m_runs(run_file: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "federation.tools.plot", str(run_file), "--out", str(tmp_path / "m")],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"wrote 4 plots and rounds.csv to {tmp_path / 'm'}"


# --- bad input: one line on stderr, exit 2 (1 without rounds), nothing written ---------------

def _bad(path: Path, capsys, expect_rc: int = 2) -> str:
    out = path.parent / "plots-out"
    rc = plot.main([str(path), "--out", str(out)])
    err = capsys.readouterr()
    assert rc == expect_rc, err
    assert err.out == ""
    assert len(err.err.strip().splitlines()) == 1 and "Traceback" not in err.err, err.err
    assert not out.exists()
    return err.err.strip()


def test_missing_file(tmp_path: Path, capsys) -> None:
    msg = _bad(tmp_path / "nope.json", capsys)
    assert msg == f"error: {tmp_path / 'nope.json'}: no such file"


def test_not_json(tmp_path: Path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text("round 1/3: 5/5 clients | train_loss nan\n")
    assert _bad(path, capsys).startswith(f"error: {path}: not JSON: Expecting value at line 1")


def test_binary_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(PNG_MAGIC + b"\xff\xfe\x00")
    assert _bad(path, capsys) == f"error: {path}: not JSON (not UTF-8 text)"


def test_empty_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text("")
    assert _bad(path, capsys) == f"error: {path}: empty file, expected a results JSON"


@pytest.mark.parametrize("cut", [0.5, 0.9, -3])
def test_truncated_json(run_file: Path, capsys, cut: float) -> None:
    """Cut anywhere -- here at half, 90 % (which fell inside a float's exponent), 3 bytes short."""
    text = run_file.read_text()
    run_file.write_text(text[: int(len(text) * cut)] if cut > 0 else text[:cut])
    assert _bad(run_file, capsys).startswith(f"error: {run_file}: truncated JSON")


@pytest.mark.parametrize("doc, got", [
    ([1, 2], "got a JSON array"),
    ({"schema": 5, "status": "completed"}, "got an object with keys ['schema', 'status']"),
    ({"rounds": {"1": {}}}, "got an object with keys ['rounds']"),
])
def test_not_a_results_file(tmp_path: Path, capsys, doc, got: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    msg = _bad(path, capsys)
    assert msg.startswith(f"error: {path}: not a fedkv results file: expected an object with a 'rounds' list")
    assert msg.endswith(got)


def test_zero_rounds_exit_1_and_write_nothing(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path, [], status="stopped: no nodes enrolled")
    assert _bad(path, capsys, expect_rc=1) == f"{path}: no rounds to plot (status: stopped: no nodes enrolled)"
    assert not path.with_suffix("").exists()


R1 = "rounds[0] (round 1): field"


@pytest.mark.parametrize("key, value, message", [
    ("seconds", "1.5", f"{R1} 'seconds' should be an object, got string \"1.5\""),
    ("server_seconds.wait", "2s", f"{R1} 'server_seconds.wait' should be a number or null, got string \"2s\""),
    ("epsilon_client", [1.5], f"{R1} 'epsilon_client' should be a number or null, got array [1.5]"),
    ("upload_bytes_mean", True, f"{R1} 'upload_bytes_mean' should be a number or null, got boolean true"),
    ("serving", [1], f"{R1} 'serving' should be an object, got array [1]"),
    ("metric", 3, f"{R1} 'metric' should be a string, got number 3"),
    ("round", "1", "rounds[0]: field 'round' should be an integer, got string \"1\""),
])
def test_wrongly_typed_field_names_round_and_field(run_file: Path, capsys, key: str, value, message: str) -> None:
    def spoil(d: dict) -> None:
        *outer, last = key.split(".")
        target = d["rounds"][0]
        for k in outer:
            target = target[k]
        target[last] = value
    _edit(run_file, spoil)
    assert _bad(run_file, capsys) == f"error: {run_file}: {message}"


def test_wrong_field_in_a_later_round_names_that_round(run_file: Path, capsys) -> None:
    _edit(run_file, lambda d: d["rounds"][2].__setitem__("seconds", "x"))
    assert "rounds[2] (round 3): field 'seconds'" in _bad(run_file, capsys)


def test_a_round_that_is_not_an_object(run_file: Path, capsys) -> None:
    _edit(run_file, lambda d: d["rounds"].__setitem__(1, "round 2"))
    assert _bad(run_file, capsys) == f"error: {run_file}: rounds[1]: expected an object, got a JSON string"


def test_plot_run_raises_results_error(tmp_path: Path) -> None:
    with pytest.raises(plot.ResultsError, match="no such file"):
        plot.plot_run(tmp_path / "nope.json")


@pytest.mark.parametrize("tail", ['{"delta": 1e', '{"delta": 1e-', '{"a": nu', '{"a": tr', '{"a": 1.'])
def test_a_file_cut_inside_a_value_is_truncated_not_malformed(tmp_path: Path, capsys, tail: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(tail)
    assert _bad(path, capsys).startswith(f"error: {path}: truncated JSON")


def test_a_wrong_token_mid_file_is_still_not_json(tmp_path: Path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"a": 1 "b": 2}')
    assert _bad(path, capsys).startswith(f"error: {path}: not JSON")
