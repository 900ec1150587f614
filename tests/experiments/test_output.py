"""experiments.output: run directories, CSV, markdown, plots, flags, progress, estimate line."""

from __future__ import annotations

import argparse
import csv
import math

import pytest

from experiments import output


def test_run_dir_is_out_script_timestamp_and_never_reused(tmp_path):
    a = output.make_run_dir(tmp_path, "demo", timestamp="20260101-000000")
    b = output.make_run_dir(tmp_path, "demo", timestamp="20260101-000000")
    assert a == tmp_path / "demo" / "20260101-000000" and a.is_dir()
    assert b == tmp_path / "demo" / "20260101-000000-1" and b.is_dir()
    c = output.make_run_dir(tmp_path / "new" / "root", "demo")  # parents created, real UTC stamp
    assert c.parent == tmp_path / "new" / "root" / "demo"
    assert len(c.name) == len("20260101-000000") and c.name[8] == "-"


@pytest.mark.parametrize("bad", ["", "a/b", "..", "."])
def test_run_dir_rejects_a_path_as_script_name(tmp_path, bad):
    with pytest.raises(ValueError):
        output.make_run_dir(tmp_path, bad)


def test_csv_round_trips_every_value(tmp_path):
    rows = [{"mode": "a", "n": 3, "x": 0.1 + 0.2, "tags": [1, 2]}, {"mode": "b|c", "n": 10**7, "x": 1e-12, "tags": []}]
    path = output.write_csv(tmp_path / "p.csv", rows)
    with path.open() as fh:
        got = list(csv.DictReader(fh))
    assert list(got[0]) == ["mode", "n", "x", "tags"]
    assert float(got[0]["x"]) == 0.1 + 0.2  # exact, not rounded
    assert int(got[1]["n"]) == 10**7 and got[1]["mode"] == "b|c" and got[0]["tags"] == "[1, 2]"


def test_csv_column_order_and_missing_or_extra_keys(tmp_path):
    output.write_csv(tmp_path / "o.csv", [{"b": 1, "a": 2}], columns=["a", "b"])
    assert (tmp_path / "o.csv").read_text().splitlines()[0] == "a,b"
    with pytest.raises(ValueError, match="lacks"):
        output.write_csv(tmp_path / "m.csv", [{"a": 1}, {"b": 2}], columns=["a"])
    with pytest.raises(ValueError):
        output.write_csv(tmp_path / "e.csv", [{"a": 1, "zzz": 2}], columns=["a"])


def test_markdown_table():
    text = output.markdown_table([{"name": "x|y", "n": 12345, "v": 0.000123456}, {"name": "z", "n": 1, "v": math.nan}],
                                 headers={"v": "value"}, floatfmt=".3g")
    lines = text.strip().splitlines()
    assert lines[0] == "| name | n | value |"
    assert lines[1] == "|---|---:|---:|"
    assert lines[2] == "| x\\|y | 12,345 | 0.000123 |"
    assert lines[3] == "| z | 1 | nan |"
    with pytest.raises(ValueError):
        output.markdown_table([])


def test_plot_lines_writes_a_png(tmp_path):
    path = output.plot_lines(tmp_path / "f.png", {"a": ([1e4, 1e5], [4.0, 4.0]), "b": ([1e4], [2.7])},
                             xlabel="x", ylabel="y", title="t", styles={"b": {"linestyle": "--"}})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="x values"):
        output.plot_lines(tmp_path / "g.png", {"a": ([1, 2], [1])}, xlabel="x", ylabel="y")
    assert not (tmp_path / "g.png").exists()


def test_common_args():
    p = argparse.ArgumentParser()
    output.add_common_args(p)
    a = p.parse_args([])
    assert (a.quick, a.seed, a.out) == (False, 0, "results")
    a = p.parse_args(["--quick", "--seed", "7", "--out", "/tmp/x"])
    assert (a.quick, a.seed, a.out) == (True, 7, "/tmp/x")


def test_progress_yields_everything(capsys):
    assert list(output.progress(range(5), total=5, desc="t")) == [0, 1, 2, 3, 4]
    assert list(output.progress(iter("ab"), disable=True)) == ["a", "b"]


def test_durations_and_estimate_line(capsys, tmp_path):
    assert output.format_duration(12.4) == "12 s"
    assert output.format_duration(600) == "10.0 min"
    assert output.format_duration(7200) == "2.0 h"
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            output.format_duration(bad)
    line = output.print_estimate(130, "calibrated just now", label="the full run")
    assert line == "expected duration of the full run: ~2.2 min (calibrated just now)"
    output.print_results_dir(tmp_path)
    out = capsys.readouterr().out
    assert line in out and f"results: {tmp_path.resolve()}" in out


def test_write_json(tmp_path):
    path = output.write_json(tmp_path / "m.json", {"a": 1, "p": tmp_path})
    assert '"a": 1' in path.read_text() and str(tmp_path) in path.read_text()
