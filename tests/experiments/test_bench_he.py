"""experiments.bench_he in a tiny run: one JSON object as the last line with every key the issue
asks for, finite figures, and the size/error targets (which do not depend on timing). Never
asserts a timing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
MODES = {"plaintext", "tenseal_default", "fedkv_none", "fedkv_8bit", "fedkv"}
PHASES = {"encrypt_per_client", "aggregate", "decrypt", "end_to_end", "total_cpu"}


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_he", "--params", "20000", "--repeats", "1", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_json_has_every_key(result):
    assert result["params"] == 20000 and result["clients"] == 10
    assert set(result["bytes_per_param"]) == {"fp32", "tenseal_default", "fedkv_none", "fedkv_8bit", "fedkv"}
    assert result["bytes_per_param"]["fp32"] == 4.0
    assert set(result["seconds"]) == MODES
    for mode in MODES:
        assert set(result["seconds"][mode]) == PHASES
    assert set(result["max_abs_error"]) == MODES
    assert result["quantization_step"] == pytest.approx(2.0 / 15)  # 10 clients: 4 headroom + 4 value bits
    assert result["quantization_step_8bit"] == pytest.approx(2.0 / 255)
    assert set(result["speedup_vs_tenseal_default"]) >= {"end_to_end", "total_cpu"}
    for section in ("seconds", "max_abs_error", "bytes_per_param"):
        for path, value in _numbers(result[section]):
            assert math.isfinite(value) and value >= 0, (section, path, value)


def test_size_and_error_targets(result):
    bpp = result["bytes_per_param"]
    # tiny vectors leave most of the last ciphertext empty, hence the looser size bounds here
    assert bpp["fedkv"] <= 4.0 and bpp["fedkv"] < bpp["fedkv_8bit"]
    assert bpp["fedkv_none"] <= 16.5
    assert bpp["tenseal_default"] > 10 * bpp["fedkv"]
    assert result["max_abs_error"]["fedkv"] <= result["fedkv_error_bound_steps"] * result["quantization_step"]
    assert result["max_abs_error"]["fedkv_none"] <= 1e-6
    assert result["saturated"]["fedkv"] == 0 and result["saturated"]["fedkv_8bit"] == 0


def _numbers(x, path=""):
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
