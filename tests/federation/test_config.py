from __future__ import annotations

import pytest

from federation.config import RunConfig


def test_defaults_match_pyproject() -> None:
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    cfg = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    assert RunConfig.from_run_config(cfg) == RunConfig()
    assert set(cfg) == set(RunConfig().as_dict())


def test_coercion_from_cli_strings() -> None:
    cfg = RunConfig.from_run_config({"he": "false", "num-server-rounds": "5", "lr": "0.05", "dp-sgd": "true"})
    assert cfg.he is False and cfg.num_server_rounds == 5 and cfg.lr == 0.05 and cfg.dp_sgd is True


@pytest.mark.parametrize(
    "override, match",
    [
        ({"dp-mode": "central"}, "dp-mode"),
        ({"task": "cifar"}, "task"),
        ({"fraction-train": 0.0}, "fraction-train"),
        ({"dp-mode": "local", "clip-norm": 0.0}, "clip-norm"),
        ({"he": "maybe"}, "he="),
        ({"dp-mode": "flower-central", "he": True}, "flower-central"),
        ({"packing": 1}, "packing must be one of"),
        ({"packing": "zip"}, "packing must be one of"),
        ({"he": True, "clip-norm": 0.0, "dp-mode": "none"}, "clip-norm must be > 0 when he=true"),
        ({"max-clients": 1, "min-clients": 2}, "max-clients"),
        ({"max-weight": 0.0}, "max-weight"),
        ({"ckks-preset": "tiny"}, "ckks-preset"),
        ({"packing-range": -1.0}, "packing-range"),
    ],
)
def test_bad_values_are_rejected(override, match) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig.from_run_config(override)


def test_default_job_is_the_readme_main_job() -> None:
    cfg = RunConfig()
    assert (cfg.task, cfg.he, cfg.dp_mode, cfg.packing) == ("lm", True, "distributed", "packed")


def test_ckks_presets_match_crypto() -> None:
    from crypto import PRESETS

    from federation.config import CKKS_PRESETS

    assert set(CKKS_PRESETS) == set(PRESETS)
