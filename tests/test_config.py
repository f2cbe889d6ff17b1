import dataclasses

import pytest

from p4bench.config import RunConfig, resolve_config
from p4bench.errors import ConfigError, UsageError


def test_defaults_then_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("clients: 12\nrounds: 7\nlocal-steps: 3\noptions: {mu: 0.1, a: 1}\n")
    config = resolve_config(path, {"rounds": 9, "seed": None, "options": {"a": 2}})
    assert (config.clients, config.rounds, config.local_steps) == (12, 9, 3)
    assert config.seed == RunConfig().seed
    assert dict(config.options) == {"mu": 0.1, "a": 2}


def test_config_is_immutable_and_hash_ignores_logging_location():
    config = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clients = 3  # type: ignore[misc]
    assert config.config_hash() == config.replace(results_dir="elsewhere").config_hash()
    assert config.config_hash() != config.replace(seed=1).config_hash()


@pytest.mark.parametrize(
    "changes, field, fragment",
    [
        ({"clients": 1}, "clients", "[2, 1_000_000]"),
        ({"client_rate": 0.0}, "client_rate", "(0, 1]"),
        ({"lr": "fast"}, "lr", "must be a number"),
        ({"rounds": 2.5}, "rounds", "must be an integer"),
        ({"method": ""}, "method", "non-empty"),
    ],
)
def test_invalid_values_name_the_field_and_range(changes, field, fragment):
    with pytest.raises(ConfigError) as info:
        RunConfig(**changes)
    assert info.value.field == field
    assert field in str(info.value) and fragment in str(info.value)


def test_unknown_key_in_file_lists_valid_options(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("clientz: 3\n")
    with pytest.raises(ConfigError, match="valid options: method"):
        resolve_config(path)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        resolve_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(UsageError, match="mapping"):
        resolve_config(bad)


def test_none_strings_mean_no_attack_or_defense():
    config = RunConfig(attack="none", defense="None")
    assert config.attack is None and config.defense == "none"  # explicit: no default defense
