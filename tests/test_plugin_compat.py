"""Packages written against p4bench 0.1 keep working for one minor version, one deprecation
line per thing to change (`p4bench.host.legacy`), and `p4bench check-plugin` names what
such a package does outside `p4bench.api`: internal imports and options read without being
declared (`p4bench.testing.plugin_source`)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from p4bench.host.manager import reset_default
from p4bench.moved import REMOVED_IN

ROOT = Path(__file__).resolve().parents[1]
DITTO = ROOT / "tests" / "plugins" / "p4bench-ditto"
EXAMPLES = [ROOT / "examples" / name for name in ("p4bench-gossip", "p4bench-threats")]
EXAMPLES.append(ROOT / "examples" / "p4bench-fedprox")


def _main(argv: list[str]) -> int:
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0)


@pytest.fixture
def installed_ditto(install_example):
    install_example(DITTO)
    yield
    sys.modules.pop("p4bench_ditto", None)
    reset_default()


def _package(folder: Path, name: str, source: str) -> Path:
    """A one-module plugin package `name` (distribution p4bench-<name>) under `folder`."""
    package = folder / f"p4bench-{name}"
    (package / f"p4bench_{name}").mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        f'[project]\nname = "p4bench-{name}"\nversion = "0.1.0"\n'
        f'[project.entry-points.p4bench]\n{name} = "p4bench_{name}"\n'
    )
    (package / f"p4bench_{name}" / "__init__.py").write_text(textwrap.dedent(source))
    return package


def _deprecations(err: str) -> list[str]:
    return [line for line in err.splitlines() if "is deprecated since" in line]


def test_the_01_plugin_runs_with_its_own_option_and_topology_one_line_each(
    installed_ditto, verify_full, capsys, results_dir, monkeypatch
):
    """Verified as a user's run is: its replay validates the options again, and the line
    still shows once."""
    import p4bench_ditto

    seen = []
    validate = p4bench_ditto.Ditto.validate_options

    def spy(self):
        validate(self)
        seen.append((self.ditto_lambda, self.topology.name))

    monkeypatch.setattr(p4bench_ditto.Ditto, "validate_options", spy)
    code = _main(
        [
            "run",
            "--method",
            "ditto",
            "-o",
            "ditto_lambda=0.5",
            "--topology",
            "star-hub",
            "--clients",
            "4",
            "--rounds",
            "1",
            "--results-dir",
            results_dir,
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["method"] == "ditto"
    assert seen and set(seen) == {(0.5, "star-hub")}
    warned = _deprecations(captured.err)
    (option,) = [line for line in warned if "ditto_lambda" in line]
    (graph,) = [line for line in warned if "--topology star-hub" in line]
    assert len(warned) == 2
    for line in (option, graph):
        assert line.startswith("warning: method 'ditto' of p4bench-ditto 0.1.0 ")
        assert f"removed in {REMOVED_IN}" in line and "p4bench_ditto" in line
    assert "Ditto.options" in option and "p4bench.api.Option" in option
    assert "topology_options(" in graph


def test_unknown_options_of_plugins_that_declare_theirs_still_exit_2(installed_ditto, capsys):
    """Only a run's 0.1 plugin takes undeclared keys: built-in fedavg declares its options."""
    assert _main(["run", "--method", "fedavg", "-o", "ditto_lambda=0.5"]) == 2
    err = capsys.readouterr().err
    assert "unknown option" in err and not _deprecations(err)
    assert _main(["run", "--method", "fedavg", "--topology", "star-hub"]) == 2
    assert "communicates over no topology" in capsys.readouterr().err


def test_a_01_topology_declaring_option_help_is_built_as_then(
    install_example, tmp_path, capsys, results_dir
):
    package = _package(
        tmp_path / "src",
        "hubgraph",
        """
        import numpy as np

        from p4bench import hookimpl
        from p4bench.topology import Topology


        class Hub(Topology):
            name = "hub"
            description = "a star around a chosen hub (p4bench 0.1)"
            option_help = {"hub": "the hub client"}

            def edges(self, num_clients, round_index, rng):
                hub = self._option("hub", 0, int, lambda h: 0 <= h < num_clients, "a client")
                adjacency = np.zeros((num_clients, num_clients), dtype=bool)
                adjacency[hub, :] = adjacency[:, hub] = True
                adjacency[hub, hub] = False
                return adjacency


        @hookimpl
        def register_topologies():
            return [Hub]
        """,
    )
    install_example(package)
    from p4bench.api import PluginDeprecationWarning, default_registry, get_topology

    with pytest.warns(PluginDeprecationWarning, match="topology 'hub' declaring its options in "):
        graph = get_topology("hub", {"hub": 2}, registry=default_registry())
    assert graph.edges(4, 0, None)[2].tolist() == [True, True, False, True]
    args = ["run", "--method", "dp-dsgd", "--topology", "hub", "--clients", "4", "--rounds", "1"]
    code = _main([*args, "--topology-option", "hub=2", "--results-dir", results_dir])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (line,) = _deprecations(captured.err)
    assert "option_help" in line and "Hub.options" in line and f"removed in {REMOVED_IN}" in line
    assert _main([*args, "--topology-option", "hubb=2"]) == 2  # unknown keys: refused, as in 0.1
    err = capsys.readouterr().err
    assert "options.topology_options.hubb" in err and "valid: hub" in err
    sys.modules.pop("p4bench_hubgraph", None)


def test_check_plugin_names_internal_imports_and_undeclared_options(installed_ditto, capsys):
    code = _main(["check-plugin", "p4bench-ditto", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    problems = json.loads(captured.out.strip().splitlines()[-1])["problems"]
    source = DITTO / "p4bench_ditto" / "__init__.py"
    lines = source.read_text().splitlines()
    imports = "\n".join(p for p in problems if p.startswith("internal import at "))
    for module in ("p4bench.engine.training", "p4bench.data", "p4bench.topology"):
        line = next(n for n, text in enumerate(lines, 1) if text.startswith(f"from {module} "))
        assert f"internal import at {source}:{line}: {module} " in imports
    undeclared = [p for p in problems if p.startswith("undeclared option at ")]
    read_at = next(n for n, text in enumerate(lines, 1) if '"ditto_lambda"' in text)
    assert any(
        p.startswith(
            f"undeclared option at {source}:{read_at}: method 'ditto' reads 'ditto_lambda'"
        )
        for p in undeclared
    )
    assert {p.split("reads '")[1].split("'")[0] for p in undeclared} == {
        "ditto_lambda",
        "topology",
        "topology_options",
    }


def test_check_plugin_reports_an_engine_import_and_an_undeclared_read(
    install_example, tmp_path, capsys
):
    package = _package(
        tmp_path / "src",
        "leaky",
        """
        import numpy as np

        from p4bench.api import Option, Topology, hookimpl, resolve_options
        from p4bench.engine.method_kit import power_law_weights


        class Line(Topology):
            name = "line"
            description = "a path 0 - 1 - ... - M-1"
            options = (Option("wrap", bool, False, "close the path into a ring"),)

            def edges(self, num_clients, round_index, rng):
                values = resolve_options(self.options, {})
                hops = values.get("hops")  # never declared
                adjacency = np.eye(num_clients, k=1, dtype=bool) | np.eye(num_clients, k=-1, dtype=bool)
                if self.option_values["wrap"]:
                    adjacency[0, -1] = adjacency[-1, 0] = num_clients > 2
                return adjacency if hops is None else adjacency


        @hookimpl
        def register_topologies():
            return [Line]
        """,
    )
    install_example(package)
    code = _main(["check-plugin", "p4bench-leaky", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    problems = json.loads(captured.out.strip().splitlines()[-1])["problems"]
    source = package / "p4bench_leaky" / "__init__.py"
    lines = source.read_text().splitlines()
    imported = next(n for n, text in enumerate(lines, 1) if "p4bench.engine" in text)
    read = next(n for n, text in enumerate(lines, 1) if '"hops"' in text)
    assert [p for p in problems if p.startswith("internal import")] == [
        f"internal import at {source}:{imported}: p4bench.engine.method_kit (import only "
        "p4bench.api; anything else may change in any release; p4bench.api has none of its names)"
    ]
    assert [p for p in problems if p.startswith("undeclared option")] == [
        f"undeclared option at {source}:{read}: topology 'line' reads 'hops' without declaring it "
        "(declare it in Line.options with p4bench.api.Option; undeclared options are refused "
        f"from {REMOVED_IN})"
    ]
    sys.modules.pop("p4bench_leaky", None)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_example_packages_import_only_the_api_and_read_only_declared_options(
    install_example, example
):
    """What check-plugin reads in the examples' source: no finding (the kit's runs are
    `tests/test_example_*.py`'s)."""
    from p4bench.host.manager import Registry, create_plugin_manager
    from p4bench.testing.plugin_source import source_findings

    install_example(example)
    pm = create_plugin_manager()
    assert source_findings(example.name, pm, Registry(pm)) == []
    for module in [m for m in sys.modules if m.startswith(example.name.replace("-", "_"))]:
        sys.modules.pop(module)
