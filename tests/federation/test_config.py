from __future__ import annotations

import math

import pytest

from federation.config import ConfigError, RunConfig, known_keys, results_dir_of


def test_defaults_match_pyproject() -> None:
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    cfg = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    assert RunConfig.from_run_config(cfg) == RunConfig()
    assert set(cfg) == set(RunConfig().as_dict()) == set(known_keys())


def test_coercion_from_cli_strings() -> None:
    cfg = RunConfig.from_run_config({"he": "false", "num-server-rounds": "5", "lr": "0.05", "dp-sgd": "true",
                                     "task": "digits"})
    assert cfg.he is False and cfg.num_server_rounds == 5 and cfg.lr == 0.05 and cfg.dp_sgd is True


def test_coercion_normalises_types() -> None:
    cfg = RunConfig.from_run_config({"num-server-rounds": 3.0, "lr": 1, "he": 1, "rotate-every": "2",
                                     "dp-mode": "none", "clip-norm": 1})
    assert type(cfg.num_server_rounds) is int and cfg.num_server_rounds == 3
    assert type(cfg.lr) is float and cfg.lr == 1.0
    assert cfg.he is True and cfg.rotate_every == 2 and type(cfg.clip_norm) is float
    assert RunConfig(local_epochs=4.0).local_epochs == 4  # direct construction is checked too
    assert RunConfig.from_run_config(cfg.as_dict()) == cfg


def test_key_rotation_and_kits_need_he() -> None:
    with pytest.raises(ConfigError, match="rotate-every rotates the CKKS key"):
        RunConfig.from_run_config({"he": False, "dp-mode": "none", "rotate-every": 2})
    with pytest.raises(ConfigError, match="server-kit provisions the CKKS key"):
        RunConfig.from_run_config({"he": False, "dp-mode": "none", "server-kit": "/srv/kit"})


def test_new_keys_defaults() -> None:
    cfg = RunConfig()
    assert cfg.server_kit == "" and cfg.rotate_every == 0
    assert RunConfig.from_run_config({"server-kit": "/srv/kit", "rotate-every": 3}).server_kit == "/srv/kit"


FLOAT_KEYS = ["packing-range", "max-weight", "noise-multiplier", "clip-norm", "target-delta",
              "fraction-train", "lr", "alpha", "round-timeout"]


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf"])
def test_every_float_rejects_nan_and_inf(key, value) -> None:
    with pytest.raises(ConfigError, match=f"{key}=.* must be a finite number"):
        RunConfig.from_run_config({key: value})


@pytest.mark.parametrize(
    "override, match",
    [
        ({"dp-mode": "central"}, "dp-mode"),
        ({"task": "cifar"}, "task"),
        ({"fraction-train": 0.0}, "fraction-train"),
        ({"fraction-train": 1.5}, "fraction-train"),
        ({"dp-mode": "local", "clip-norm": 0.0}, "clip-norm"),
        ({"he": "maybe"}, "he="),
        ({"he": 2}, "he=2 is not a boolean"),
        ({"he": 1.0}, "he=1.0 is not a boolean"),
        ({"dp-mode": "flower-central", "he": True}, "flower-central"),
        ({"packing": 1}, "packing must be one of"),
        ({"packing": "zip"}, "packing must be one of"),
        ({"he": True, "clip-norm": 0.0, "dp-mode": "none"}, "clip-norm must be > 0"),
        ({"he": False, "clip-norm": 0.0, "dp-mode": "none"}, "nodes refuse a mean beyond the bound"),
        ({"clip-norm": -1.0}, "clip-norm must be > 0"),
        ({"max-clients": 1, "min-clients": 2}, "max-clients"),
        ({"max-weight": 0.0}, "max-weight"),
        ({"ckks-preset": "tiny"}, "ckks-preset"),
        ({"packing-range": -1.0}, "packing-range"),
        ({"packing-bits": 25}, "packing-bits"),
        ({"num-server-rounds": 2.5}, "num-server-rounds=2.5 is not an integer"),
        ({"num-server-rounds": "2.5"}, "num-server-rounds='2.5' is not an integer"),
        ({"num-server-rounds": True}, "num-server-rounds=True is a boolean"),
        ({"num-server-rounds": 0}, "num-server-rounds must be >= 1"),
        ({"local-epochs": 0}, "local-epochs must be >= 1"),
        ({"min-clients": 0}, "min-clients must be >= 1"),
        ({"round-timeout": 0.0}, "round-timeout must be > 0"),
        ({"round-timeout": -5}, "round-timeout must be > 0"),
        ({"noise-multiplier": -0.1}, "noise-multiplier must be >= 0"),
        ({"target-delta": 1.0}, "target-delta"),
        ({"lr": -0.1}, "lr must be >= 0"),
        ({"lr": "fast"}, "lr='fast' is not a number"),
        ({"lr": False}, "lr=False is a boolean"),
        ({"alpha": 0.0}, "alpha"),
        ({"seed": -1}, "seed must be in"),
        ({"seed": 2**32}, "seed must be in"),
        ({"kv-dtype": "int2"}, "kv-dtype"),
        ({"results-dir": ""}, "results-dir"),
        ({"results-dir": 5}, "results-dir=5 is not a string"),
        ({"server-kit": "kits/server"}, "server-kit must be an absolute path"),
        ({"rotate-every": -1}, "rotate-every must be >= 0"),
        ({"rotate-every": 1.5}, "rotate-every=1.5 is not an integer"),
        ({"max-rejected-rounds": 0}, "max-rejected-rounds must be >= 1"),
        ({"dp-sgd": True, "task": "lm", "dp-sgd-batch": -1}, "dp-sgd-batch must be >= 0"),
        ({"dp-sgd-clip": 0.0}, "dp-sgd-clip must be > 0"),
        ({"dp-sgd-epsilon": -1.0}, "dp-sgd-epsilon must be >= 0"),
    ],
)
def test_bad_values_are_rejected(override, match) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_run_config(override)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError, match="^bad run config: "):
        RunConfig(num_server_rounds=0)


def test_good_combinations_pass() -> None:
    RunConfig.from_run_config({"task": "digits", "dp-sgd": True, "dp-mode": "none"})
    RunConfig.from_run_config({"task": "digits", "dp-sgd": True, "dp-mode": "distributed"})
    RunConfig.from_run_config({"dp-mode": "flower-central", "he": False})
    RunConfig.from_run_config({"dp-mode": "none", "he": False, "clip-norm": 0.5})


def test_unknown_keys_are_named_with_close_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config({"num-server-round": 3, "noise_multiplier": 0.5, "colour": "red"})
    problems = info.value.problems
    assert len(problems) == 3
    assert "unknown key 'num-server-round'" in problems[0] and "num-server-rounds" in problems[0]
    assert "unknown key 'noise_multiplier'" in problems[1] and "noise-multiplier" in problems[1]
    assert "unknown key 'colour'" in problems[2] and "pyproject.toml" in problems[2]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config({"num-server-rounds": 2.5, "lr": math.nan, "task": "cifar",
                                   "fraction-train": 0, "he": "maybe", "roundtimeout": 3})
    text = str(info.value)
    for part in ("unknown key 'roundtimeout'", "round-timeout", "num-server-rounds=2.5",
                 "lr=nan", "task must be one of", "fraction-train", "he='maybe'"):
        assert part in text, part
    assert len(info.value.problems) == 6


def test_a_bad_value_does_not_cause_follow_up_complaints() -> None:
    # task does not parse: the dp-sgd/task combination is not judged on a guess
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config({"task": 3, "dp-sgd": True})
    assert info.value.problems == ["task must be one of ('digits', 'lm', 'chat'), not 3"]


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"results-dir": "/tmp/out"}, "/tmp/out"),
        ({"results-dir": "rel/out", "lr": "fast"}, "rel/out"),
        ({}, "results"),
        ({"results-dir": ""}, "results"),
        ({"results-dir": "   "}, "results"),
        ({"results-dir": 5}, "results"),
        ({"results-dir": None}, "results"),
        ({"results-dir": "a\0b"}, "results"),
        (None, "results"),
    ],
)
def test_results_dir_of_a_raw_config(raw, expected) -> None:
    assert results_dir_of(raw) == expected  # type: ignore[arg-type]


def test_default_job_is_the_readme_main_job() -> None:
    cfg = RunConfig()
    assert (cfg.task, cfg.he, cfg.dp_mode, cfg.packing) == ("lm", True, "distributed", "packed")


def test_ckks_presets_match_crypto() -> None:
    from crypto import PRESETS

    from federation.config import CKKS_PRESETS

    assert set(CKKS_PRESETS) == set(PRESETS) | {"auto"}  # "auto": crypto.preset_for picks one


# -- node config (federation.node_host.spec_from_context) ------------------------------------------
def _context(node_config: dict) -> object:
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={"task": "digits"})


def test_node_spec_from_a_good_node_config() -> None:
    from federation.node_host import spec_from_context

    spec = spec_from_context(_context({"partition-id": 1, "num-partitions": 3}))
    assert (spec.partition_id, spec.num_partitions, spec.task) == (1, 3, "digits")
    spec = spec_from_context(_context({"partition-id": "0", "num-partitions": 2.0}))
    assert (spec.partition_id, spec.num_partitions) == (0, 2)


@pytest.mark.parametrize(
    "node_config, match",
    [
        ({}, "partition-id is missing; num-partitions is missing"),
        ({"num-partitions": 2}, "partition-id is missing"),
        ({"partition-id": 0}, "num-partitions is missing"),
        ({"partition-id": "zero", "num-partitions": 2}, "partition-id='zero' is not an integer"),
        ({"partition-id": 0.5, "num-partitions": 2}, "partition-id=0.5 is not an integer"),
        ({"partition-id": True, "num-partitions": 2}, "partition-id=True is not an integer"),
        ({"partition-id": 2, "num-partitions": 2}, r"partition-id=2 must be in \[0, num-partitions=2\)"),
        ({"partition-id": -1, "num-partitions": 2}, "partition-id=-1 must be in"),
        ({"partition-id": 0, "num-partitions": 0}, "num-partitions=0 must be >= 1"),
    ],
)
def test_node_config_errors_say_how_to_pass_the_partition(node_config, match) -> None:
    from federation.config import NodeConfigError
    from federation.node_host import spec_from_context

    with pytest.raises(NodeConfigError, match=match) as info:
        spec_from_context(_context(node_config))
    assert isinstance(info.value, ConfigError) and not isinstance(info.value, KeyError)
    assert str(info.value).startswith("bad node config: ")
    assert '--node-config "partition-id=0 num-partitions=N"' in str(info.value)


def test_literal_choices_mirror_their_sources():
    """The run config names the cache's K/V formats and the chat bases literally (it imports
    no torch); each list must be its source's."""
    from cache.config import KV_DTYPES
    from node.tasks.tasks import CHAT_MODELS

    import federation.config as fc

    assert fc.KV_DTYPES == KV_DTYPES
    assert tuple(fc.CHAT_MODELS) == tuple(CHAT_MODELS)
