"""Declared plugin options: conversion, the run-wide check, studies, `describe`, where the
tables live (docs/options.md, not the README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.errors import ConfigError
from p4bench.host.manager import KINDS, Registry, create_plugin_manager, default_registry
from p4bench.options import (
    Option,
    UnknownOptionError,
    option_params,
    resolve_options,
    validate_run_options,
)

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = ["--clients", "4", "--rounds", "1"]


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


@pytest.fixture
def no_data(monkeypatch):
    """Fail the test if a run gets as far as loading its dataset."""
    import p4bench.data.pipeline

    monkeypatch.setattr(
        p4bench.data.pipeline,
        "load_dataset",
        lambda *a, **k: pytest.fail("options must fail before data"),
    )


# -- resolve_options ---------------------------------------------------------------------

DECLARED = (
    Option("size", int, 4, "a size", low=1),
    Option("rate", float, 0.5, "a rate", low=0, high=1, low_open=True),
    Option("flag", bool, False, "a flag"),
    Option("mode", str, "a", "a mode", choices=("a", "b")),
    Option("extra", dict, None, "a mapping"),
)


def test_values_are_converted_and_defaults_filled():
    given = {
        "size": "8",
        "rate": "1e-3",
        "flag": "true",
        "mode": "b",
        "extra": {"k": 1},
        "other": 3,
    }
    assert resolve_options(DECLARED, given) == {
        "size": 8,
        "rate": 0.001,
        "flag": True,
        "mode": "b",
        "extra": {"k": 1},
    }
    assert resolve_options(DECLARED, {}) == {
        "size": 4,
        "rate": 0.5,
        "flag": False,
        "mode": "a",
        "extra": None,
    }
    assert (
        resolve_options(DECLARED, {"size": 6.0, "flag": "off", "rate": 1, "size_": None})["size"]
        == 6
    )
    assert resolve_options(DECLARED, {"size": None})["size"] == 4  # null selects the default


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("size", "abc", "an integer >= 1"),
        ("size", 2.5, "an integer"),
        ("size", 0, ">= 1"),
        ("size", True, "integer"),
        ("rate", 0, "in (0, 1]"),
        ("rate", "fast", "a number"),
        ("flag", "maybe", "true or false"),
        ("mode", "c", "one of a, b"),
        ("extra", [1], "a mapping"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_expected(key, value, expected):
    with pytest.raises(ConfigError) as info:
        resolve_options(DECLARED, {key: value})
    message = str(info.value)
    assert f"options.{key}" in message and repr(value) in message and expected in message


def test_strict_refuses_unknown_keys_with_a_suggestion():
    with pytest.raises(
        UnknownOptionError, match="options.sise: unknown option of thing; did you mean size"
    ):
        resolve_options(DECLARED, {"sise": 3}, strict=True, owner="thing")


def test_every_registered_default_resolves():
    registry = Registry(create_plugin_manager(autoload=False))
    for kind in KINDS:
        for entry in registry.entries(kind):
            declared = getattr(entry.cls, "options", ())
            names = [o.name for o in declared]
            assert len(names) == len(set(names)), f"{kind} {entry.name} declares an option twice"
            values = resolve_options(declared, {})
            for option in declared:
                assert option.help, f"{kind} {entry.name}: option {option.name} has no help"
                if option.default is not None:  # a declared default passes its own checks
                    assert option.resolve(option.default, option.name) == values[option.name]


def test_run_check_resolves_every_used_plugin_and_the_topology():
    config = RunConfig(
        method="dp-dsgd",
        attack="gaussian",
        defense="m-krum",
        clients=8,
        options={"topology": "k-regular", "topology_options": {"k": "4"}, "krum_m": "3"},
    )
    resolved = validate_run_options(config, default_registry())
    assert set(resolved) == {
        "method",
        "attack",
        "defense",
        "dataset",
        "partitioner",
        "model",
        "runtime",
        "accountant",
        "topology",
    }
    assert resolved["defense"]["krum_m"] == 3 and resolved["attack"]["gaussian_std"] == 1.0
    assert resolved["topology"] == {"k": 4, "max_tries": 100, "resample": False}
    params = option_params(resolved)
    assert params["option.krum_m"] == "3" and params["option.topology"] == "k-regular"
    assert (
        params["option.topology_options.k"] == "4"
        and params["option.attack_timing"] == "after-grouping"
    )
    with pytest.raises(
        UnknownOptionError, match="options.topology_options.degree: unknown option of topology"
    ):
        validate_run_options(
            config.replace(options={"topology": "k-regular", "topology_options": {"degree": 3}}),
            default_registry(),
        )


def test_a_default_defense_brings_its_options():
    resolved = validate_run_options(
        RunConfig(method="p4", options={"krum_m": 2}), default_registry()
    )
    assert resolved["defense"]["krum_m"] == 2 and resolved["method"]["beta"] == 0.5
    with pytest.raises(UnknownOptionError, match="krum_m"):
        validate_run_options(
            RunConfig(method="p4", defense="none", options={"krum_m": 2}), default_registry()
        )


# -- the CLI -------------------------------------------------------------------------------


def test_unknown_key_exits_2_with_one_line_and_a_suggestion(capsys, no_data, results_dir):
    code, _, err = invoke(
        ["run", "--method", "p4", "-o", "group_sise=4", *TINY, "--results-dir", results_dir], capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        "options.group_sise" in err
        and "did you mean group_size?" in err
        and "defense p4-secure" in err
    )


def test_bad_value_exits_2_naming_key_value_and_type(capsys, no_data, results_dir):
    args = ["run", "--method", "p4", "-o", "group_size=abc", *TINY, "--results-dir", results_dir]
    code, _, err = invoke(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "options.group_size" in err and "'abc'" in err and "integer" in err


def test_an_option_of_another_method_exits_2(capsys, no_data, results_dir):
    args = ["run", "--method", "fedavg", "-o", "group_size=4", *TINY, "--results-dir", results_dir]
    code, _, err = invoke(args, capsys)
    assert (
        code == 2
        and "options.group_size" in err
        and "an option of method p4" in err
        and "lr_scaling" in err
    )


def test_a_sweep_with_a_bad_value_fails_before_its_first_run(tmp_path, capsys, monkeypatch):
    import p4bench.run.runner

    monkeypatch.setattr(p4bench.run.runner, "run", lambda *a, **k: pytest.fail("no run may start"))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        "name: bad-option\nbase: {method: p4, clients: 4, rounds: 1}\n"
        "axes: {options.group_size: [2, abc]}\n"
    )
    code, _, err = invoke(["sweep", str(sweep), "--results-dir", str(tmp_path / "runs")], capsys)
    assert code == 2 and "options.group_size" in err and "'abc'" in err and "in the run" in err


def test_describe_shows_kind_capabilities_and_options(capsys):
    code, out, _ = invoke(["describe", "p4"], capsys)
    assert code == 0 and "(method)" in out and "p4-secure" in out and "group_size" in out
    code, out, _ = invoke(["describe", "m-krum", "--json"], capsys)
    info = json.loads(out)[0]
    assert code == 0 and info["kind"] == "defense" and info["distribution"] == "p4bench"
    assert (
        "p4" in info["capabilities"]["usable_with"]
        and "local" not in info["capabilities"]["usable_with"]
    )
    assert {
        "name": "krum_m",
        "type": "int",
        "default": "-",
        "allowed": ">= 1",
        "help": "m, the updates kept; default: n - f",
        "paper": "",
    } in info["options"]
    code, out, _ = invoke(
        ["describe", "pdsl", "--json"], capsys
    )  # a default that is the paper's says where
    paper = {option["name"]: option["paper"] for option in json.loads(out)[0]["options"]}
    assert paper["shapley"] == "Alg. 2" and paper["val_size"] == "|Q| = 2,000" and paper["R"] == ""
    code, out, _ = invoke(["describe", "pdsl"], capsys)
    assert "(paper:" in out and "paper's own value" in out


def test_describe_of_an_unknown_name_exits_2_listing_names(capsys):
    code, _, err = invoke(["describe", "m-krun"], capsys)
    assert (
        code == 2
        and len(err.strip().splitlines()) == 1
        and "did you mean m-krum?" in err
        and "fedavg" in err
    )


# -- the README ----------------------------------------------------------------------------


def test_the_option_tables_live_in_the_docs_not_the_readme():
    """The generated tables are docs/options.md's (tests/test_docs.py keeps it current); the
    README links there instead of repeating them."""
    text = README.read_text()
    assert "<!-- options:begin -->" not in text and "docs/options.md" in text


def test_list_name_describes_one_plugin(capsys):
    code, out, _ = invoke(["list", "shards"], capsys)
    assert code == 0 and "(partitioner)" in out and "shards_per_client" in out


def test_resolved_options_become_mlflow_params(small_config):
    from p4bench.run.runner import prepare
    from p4bench.tracking.tracker import flat_params

    prepared = prepare(small_config(method="p4", options={"group_size": "2"}), default_registry())
    assert prepared.info.plugin_options["method"]["group_size"] == 2
    params = flat_params(prepared.config, prepared.info.plugin_options)
    assert params["options.group_size"] == '"2"'  # as given
    assert (
        params["option.group_size"] == "2"
        and params["option.beta"] == "0.5"
        and params["option.krum_m"] == "none"
    )
