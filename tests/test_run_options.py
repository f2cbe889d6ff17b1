"""`p4bench run`'s options are declared once (`p4bench.cli.run_options.RunOptions`): the
command's parameters are its fields, an option that sets a RunConfig field shows that
field's one help text, and the texts of --epsilon and --delta say what the code does."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from p4bench.cli.run import run_command
from p4bench.cli.run_options import (
    CONFIG_FIELDS,
    RunOptions,
    _option_info,
    config_help,
    topology_overrides,
)
from p4bench.config import RunConfig
from p4bench.errors import UsageError


def test_the_command_parameters_are_the_options_fields():
    parameters = inspect.signature(run_command).parameters
    assert list(parameters) == [f.name for f in dataclasses.fields(RunOptions)]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    options = RunOptions(**{name: p.default for name, p in parameters.items()})
    assert options == RunOptions()  # every default is the field's


def test_one_help_text_per_option():
    config_fields = {f.name for f in dataclasses.fields(RunConfig)}
    shared = 0
    for f in dataclasses.fields(RunOptions):
        name = CONFIG_FIELDS.get(f.name, f.name)
        help_text = _option_info(f).help
        assert help_text, f.name
        if name in config_fields:
            assert help_text == config_help(name), f.name
            shared += 1
    assert shared >= 40


def test_the_delta_help_states_the_default_rule():
    from p4bench.privacy.calibration import default_delta

    text = config_help("delta")
    assert "default 1/(10 N), N the training records of the data set" in text
    for records in (1, 1797, 60_000):
        assert default_delta(records) == pytest.approx(1 / (10 * records))


def test_the_epsilon_help_states_the_default_rule():
    from p4bench.engine.method import DEFAULT_EPSILON
    from p4bench.host.manager import default_registry
    from p4bench.run.resolution import resolve_run_config

    text = config_help("epsilon")
    stated = re.search(r"default: (\S+) for DP methods", text)
    assert stated is not None and float(stated.group(1)) == DEFAULT_EPSILON
    assert "sigma is calibrated to it" in text and "else none (non-private)" in text
    registry = default_registry()
    methods = {e.name: e.cls for e in registry.entries("method")}
    assert {getattr(c, "default_epsilon", None) for c in methods.values()} <= {
        None,
        DEFAULT_EPSILON,
    }
    for name, expected, private in (("p4", DEFAULT_EPSILON, True), ("fedavg", None, False)):
        resolved = resolve_run_config(RunConfig(method=name), registry)
        assert (resolved.epsilon, resolved.private) == (expected, private), name
    given = resolve_run_config(RunConfig(method="fedavg", epsilon=2.0), registry)
    assert given.private  # given, it makes any method private


def test_overrides_are_config_fields():
    options = RunOptions(
        rounds=3, time_budget=1.5, memory_budget=2.0, no_dp=True, option=["a=1"], topology="ring"
    )
    assert options.overrides() == {
        "rounds": 3,
        "time_budget_min": 1.5,
        "memory_budget_gb": 2.0,
        "no_dp": True,
        "options": {"a": 1, "topology": "ring"},
    }
    assert RunOptions().overrides() == {}
    assert RunOptions(shards_per_client=0).overrides() == {"options": {"shards_per_client": 0}}


def test_local_peers_stand_for_the_device_runtime():
    local = RunOptions(local_peers=3, option=["x=1"]).with_local_peers()
    assert (local.runtime, local.clients, local.option) == (
        "device",
        3,
        ["x=1", "device_local_peers=3"],
    )
    with pytest.raises(UsageError, match="--local-peers runs the device runtime"):
        RunOptions(local_peers=3, runtime="simulation").with_local_peers()
    with pytest.raises(UsageError, match="both set the topology"):
        topology_overrides("ring", [], {"topology": "complete"})
