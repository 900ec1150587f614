"""experiments.kv_capacity: the active-capacity measurement and its CLI."""

import json

import pytest

from cache import ConfigError
from experiments.kv_capacity import active_capacity_tokens, main


def test_cli_prints_one_json_object_last_with_counts_and_ratios(capsys):
    out = main(["--json", "--geometry", "tiny", "--pool-mib", "2", "--session-tokens", "64"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == out and printed["geometry"] == "tiny"
    got, ratio = printed["active_capacity_tokens"], printed["ratio_vs_fp32"]
    assert set(got) == {"fp32", "fp16", "int8", "int4"} and got["fp32"] > 0
    assert ratio["fp32"] == 1.0 and ratio["fp16"] == round(got["fp16"] / got["fp32"], 3)
    assert got["fp16"] > got["fp32"]  # half the bytes per token, nothing else changes
    assert all(n % 65 == 0 for n in got.values())  # whole sessions of 64 + 1 decoded token


def test_capacity_is_zero_when_not_even_one_prompt_fits():
    assert active_capacity_tokens("fp32", 1 << 20, num_layers=2, num_heads=2, head_dim=64,
                                  session_tokens=4096) == 0


def test_a_bad_dtype_is_a_clear_error():
    with pytest.raises(ConfigError, match="kv_dtype"):
        active_capacity_tokens("int3", 1 << 20, num_layers=2, num_heads=2, head_dim=64)
