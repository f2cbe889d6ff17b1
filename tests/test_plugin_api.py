"""The plugin API an outside package relies on: `p4bench.api` resolves every public name,
a package written against p4bench 0.1 runs unchanged with one deprecation line, `--topology`
is a run option of the topology harness, and `check-plugin` reports a distribution's
problems one line each."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

import p4bench.api as api
from p4bench.errors import PluginDeprecationWarning
from p4bench.host.manager import default_registry, reset_default

OLDSTYLE = Path(__file__).resolve().parent / "plugins" / "p4bench-oldstyle"
GOSSIP = Path(__file__).resolve().parents[1] / "examples" / "p4bench-gossip"
THREATS = Path(__file__).resolve().parents[1] / "examples" / "p4bench-threats"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture
def installed_oldstyle(install_example):
    install_example(OLDSTYLE)
    yield
    sys.modules.pop("p4bench_oldstyle", None)
    reset_default()


def _main(argv: list[str]) -> int:
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0)


def test_every_public_name_resolves_and_is_documented():
    text = DOCS.read_text()
    for name in api.__all__:
        assert getattr(api, name) is not None
        assert f"`{name}`" in text, f"docs/api.md does not list {name}"
    assert api.API_VERSION == "1.2"


def test_the_example_plugins_import_only_the_api():
    for package in (GOSSIP, THREATS):
        source = "\n".join(p.read_text() for p in package.rglob("*.py"))
        imported = {
            line.split()[1]
            for line in source.splitlines()
            if line.startswith(("from p4bench", "import p4bench"))
        }
        assert imported <= {
            "p4bench.api",
            "p4bench_threats.attack",
            "p4bench_threats.dataset",
            "p4bench_threats.defense",
        }, imported


def test_get_topology_without_registry_still_works_with_a_warning():
    from p4bench.topology import get_topology

    with pytest.warns(PluginDeprecationWarning, match="registry="):
        ring = get_topology("ring")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(get_topology("ring", registry=default_registry())) is type(ring)


def test_a_package_written_against_0_1_runs_unchanged_with_one_warning_line(
    installed_oldstyle, capsys, results_dir
):
    code = _main(
        [
            "run",
            "--method",
            "oldstyle-fedavg",
            "--topology",
            "ring",
            "--rounds",
            "2",
            "--results-dir",
            results_dir,
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["method"] == "oldstyle-fedavg" and summary["accuracy_mean"] > 0.2
    warned = [line for line in captured.err.splitlines() if "deprecated" in line]
    assert len(warned) == 1 and warned[0].startswith(
        "warning: get_topology(name, options) without registry="
    )
    assert "p4bench_oldstyle" in warned[0]


def test_check_plugin_names_the_deprecated_call_in_one_line(installed_oldstyle, capsys):
    code = _main(["check-plugin", "p4bench-oldstyle", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["checked"][0].startswith("method 'oldstyle-fedavg': ")
    # the kit's checks pass; the 0.1 call is one problem, its four internal imports the others
    (problem,) = [p for p in report["problems"] if not p.startswith("internal import at ")]
    assert (
        problem.startswith("deprecated API at ")
        and "p4bench_oldstyle" in problem
        and "registry=" in problem
    )
    imported = [p.split(": ")[1].split()[0] for p in report["problems"] if p != problem]
    assert imported == [
        "p4bench",
        "p4bench.options",
        "p4bench.topology",
        "p4bench_baselines.fedavg",
    ]
    problem_lines = [line for line in captured.out.splitlines() if line.startswith("problem: ")]
    assert problem_lines == [f"problem: {p}" for p in report["problems"]]


def test_check_plugin_of_an_unknown_distribution_is_one_line(capsys):
    assert _main(["check-plugin", "no-such-dist"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no installed distribution 'no-such-dist'" in err


def test_topology_is_a_run_option_for_methods_that_use_a_graph(capsys, results_dir):
    code = _main(
        [
            "run",
            "--method",
            "dp-dsgd",
            "--topology",
            "k-regular",
            "--topology-option",
            "k=3",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--results-dir",
            results_dir,
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    run_folder = Path(summary["results_dir"])
    config = (run_folder / "config.yaml").read_text()
    assert "topology: k-regular" in config and "k: 3" in config


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--method", "fedavg", "--topology", "ring"],
            "method 'fedavg' communicates over no topology",
        ),
        (
            ["--method", "dp-dsgd", "--topology", "ring", "-o", "topology=complete"],
            "--topology and -o topology",
        ),
        (
            ["--method", "dp-dsgd", "--topology", "no-such-graph"],
            "unknown topology 'no-such-graph'",
        ),
        (["--method", "dp-dsgd", "--topology-option", "k"], "--topology-option expects KEY=VALUE"),
    ],
)
def test_a_topology_the_method_cannot_use_is_one_line_exit_2(argv, expected, capsys, results_dir):
    assert _main(["run", *argv, "--results-dir", results_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_the_command_line_imports_no_installed_plugin_that_adds_no_command(
    installed_oldstyle, capsys
):
    """`--help` with a plugin installed: once `list` has cached that no installed plugin adds
    commands, building the app leaves the plugin (and whatever it imports) unimported."""
    from p4bench.cli import build_app

    assert _main(["list"]) == 0
    sys.modules.pop("p4bench_oldstyle", None)
    reset_default()
    build_app()
    assert "p4bench_oldstyle" not in sys.modules


def test_an_installed_plugin_that_adds_a_command_is_loaded_to_build_the_app(
    install_example, tmp_path, capsys
):
    package = tmp_path / "p4bench-hello"
    (package / "p4bench_hello").mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        '[project]\nname = "p4bench-hello"\nversion = "1.0"\n'
        '[project.entry-points.p4bench]\nhello = "p4bench_hello"\n'
    )
    (package / "p4bench_hello" / "__init__.py").write_text(
        "from p4bench.api import hookimpl\n\n@hookimpl\ndef register_commands(app):\n"
        "    app.command('hello')(lambda: print('hello from a plugin'))\n"
    )
    install_example(package)
    try:
        assert _main(["list"]) == 0  # the cache now records the command
        reset_default()
        capsys.readouterr()
        assert _main(["hello"]) == 0
        assert "hello from a plugin" in capsys.readouterr().out
    finally:
        sys.modules.pop("p4bench_hello", None)
        reset_default()
