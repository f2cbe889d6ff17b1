"""Robust discovery: a broken installed plugin is one warning line, never a dead CLI.

Each broken distribution is installed for real into tmp_path (a `*.dist-info` folder
with METADATA and entry_points.txt, plus its module on sys.path), as `pip install` would.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from p4bench.host.manager import Registry, create_plugin_manager, reset_default

HEADER = "from p4bench import hookimpl\nfrom p4bench_baselines.fedavg import FedAvg\n"

# case -> (distribution, module source, a name that must exit 2 when used, or None)
BROKEN = {
    "import-error": ("broken-import", "raise RuntimeError('boom at import')\n", None),
    "hook-returns-class": (
        "broken-class",
        "class Solo(FedAvg):\n    name = 'solo'\n\n@hookimpl\ndef register_methods():\n    return Solo\n",
        None,
    ),
    "none-entry": ("broken-none", "@hookimpl\ndef register_methods():\n    return [None]\n", None),
    "not-a-method": (
        "broken-kind",
        "class Plain:\n    name = 'plain'\n\n@hookimpl\ndef register_methods():\n    return [Plain]\n",
        "plain",
    ),
    "shadows-builtin": (
        "broken-shadow",
        "class Shadow(FedAvg):\n    name = 'fedavg'\n\n@hookimpl\ndef register_methods():\n    return [Shadow]\n",
        None,  # the built-in keeps `fedavg`: using it works (checked below)
    ),
}
TWIN = "class Twin(FedAvg):\n    name = 'twin'\n\n@hookimpl\ndef register_methods():\n    return [Twin]\n"


@pytest.fixture
def install(tmp_path, monkeypatch):
    """`install(distribution, source, version)`: a real installed distribution whose
    module (named after it) is registered in the `p4bench` entry-point group."""
    site = tmp_path / "site"
    site.mkdir()
    modules: list[str] = []

    def make(distribution: str, source: str, version: str = "1.0") -> str:
        module = distribution.replace("-", "_") + "_plugin"
        (site / f"{module}.py").write_text(HEADER + textwrap.dedent(source))
        dist_info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
        )
        (dist_info / "entry_points.txt").write_text(f"[p4bench]\n{distribution} = {module}\n")
        modules.append(module)
        return module

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reset_default()
    yield make
    for module in modules:
        sys.modules.pop(module, None)
    reset_default()


def invoke(args, capsys):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def naming(text: str, distribution: str) -> list[str]:
    return [line for line in text.splitlines() if distribution in line]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_plugin_is_one_warning_line(case, install, capsys, results_dir):
    distribution, source, bad_name = BROKEN[case]
    install(distribution, source)

    code, out, err = invoke(["list"], capsys)
    assert code == 0 and "fedavg" in out
    assert naming(err, distribution) == [naming(err, distribution)[0]]
    assert naming(err, distribution)[0].startswith(f"warning: plugin {distribution} 1.0: ")

    code, out, err = invoke(
        ["list", "--json"], capsys
    )  # a fresh process would warn again; this one does not
    problems = json.loads(out)["problems"]
    assert code == 0 and [p["distribution"] for p in problems] == [distribution] and err == ""

    reset_default()  # as a new process: a run that does not use the broken plugin says nothing of it
    code, out, err = invoke(
        [
            "run",
            "--method",
            "fedavg",
            "--clients",
            "4",
            "--rounds",
            "1",
            "--results-dir",
            results_dir,
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    assert naming(err, distribution) == []
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["plugins"]["method"]["distribution"] == "p4bench"  # never the shadowing class

    if bad_name is not None:
        code, _, err = invoke(["run", "--method", bad_name, "--results-dir", results_dir], capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and distribution in errors[0]


def test_a_name_claimed_by_two_installed_plugins_is_refused_only_when_used(
    install, capsys, results_dir
):
    install("twin-a", TWIN)
    install("twin-b", TWIN)
    code, out, err = invoke(["list"], capsys)
    warnings = [line for line in err.splitlines() if "twin-" in line]
    assert code == 0 and len(warnings) == 1 and "twin-a" in warnings[0] and "twin-b" in warnings[0]

    code, _, err = invoke(
        [
            "run",
            "--method",
            "fedavg",
            "--clients",
            "4",
            "--rounds",
            "1",
            "--results-dir",
            results_dir,
        ],
        capsys,
    )
    assert code == 0, err

    code, _, err = invoke(["run", "--method", "twin", "--results-dir", results_dir], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "twin-a" in errors[0] and "twin-b" in errors[0]


def test_a_misspelt_hook_is_one_warning_line_of_list(install, capsys):
    # issue 45: a plugin's `register_method` (for `register_methods`) was never called, and nothing said so
    install(
        "p4bench-misspelt",
        "class Lost(FedAvg):\n    name = 'lost'\n\n@hookimpl\ndef register_method():\n    return [Lost]\n",
    )
    code, out, err = invoke(["list"], capsys)
    (line,) = naming(err, "p4bench-misspelt")
    assert code == 0 and "fedavg" in out
    assert line == (
        "warning: plugin p4bench-misspelt 1.0: module p4bench_misspelt_plugin implements unknown hook "
        "'register_method' (did you mean 'register_methods'?): it is never called"
    )
    assert "unknown hook 'register_method'" in out  # and in the table's list of problems


def test_registry_records_problems_and_keeps_the_good_parts(install):
    install(
        "half-good",
        """
        class Good(FedAvg):
            name = 'good'

        @hookimpl
        def register_methods():
            return [Good, None, 'oops']

        @hookimpl
        def register_attacks():
            raise ValueError('attacks are broken\\nsecond line')

        @hookimpl
        def register_commands(app):
            raise RuntimeError('no commands today')
    """,
        version="2.0",
    )
    registry = Registry(create_plugin_manager())
    assert registry.entry("method", "good").distribution == "half-good"
    problems = registry.problems
    assert {(p.distribution, p.version, p.kind) for p in problems} == {
        ("half-good", "2.0", k) for k in ("method", "attack")
    }
    assert len(problems) == 3 and all("\n" not in p.line() for p in problems)

    from p4bench.cli import build_app
    from p4bench.host.manager import default_registry

    reset_default()
    app = build_app()  # a failing register_commands is a problem too; the app is still built
    assert "list" in [c.name for c in app.registered_commands]
    (message,) = [p.message for p in default_registry().problems if p.kind == "command"]
    assert message.startswith("register_commands raised RuntimeError: no commands today (at ")
    assert message.endswith("half_good_plugin.py:17)")  # where in the plugin it was raised


def test_a_method_of_a_package_that_failed_to_load_names_the_package(install, capsys, results_dir):
    install("p4bench-typo", "import numpy as np\nfrom p4bench.api import hookimpl, NoSuchName\n")
    code, _, err = invoke(["run", "--method", "typo-method", "--results-dir", results_dir], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1
    assert (
        "unknown method 'typo-method'" in errors[0]
        and "p4bench-typo 1.0: cannot be loaded" in errors[0]
    )
    assert "NoSuchName" in errors[0]


def test_built_in_problems_still_fail_loudly():
    from p4bench import hookimpl

    class ReturnsAClass:
        @hookimpl
        def register_methods(self):
            from p4bench_baselines.fedavg import FedAvg

            return FedAvg

    with pytest.raises(TypeError, match="not a list"):
        Registry(create_plugin_manager(extra_plugins=(ReturnsAClass(),), autoload=False))


def test_runs_record_each_plugins_distribution_and_version(install, capsys, results_dir):
    install(
        "p4bench-tiny",
        "class Tiny(FedAvg):\n    name = 'tiny'\n\n@hookimpl\ndef register_methods():\n    return [Tiny]\n",
        version="2.3.4",
    )
    code, out, err = invoke(
        [
            "run",
            "--method",
            "tiny",
            "--clients",
            "4",
            "--rounds",
            "1",
            "--epsilon",
            "8",
            "--results-dir",
            results_dir,
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    plugins = summary["plugins"]
    assert plugins["method"] == {"name": "tiny", "distribution": "p4bench-tiny", "version": "2.3.4"}
    assert {"dataset", "partitioner", "model", "runtime", "accountant"} <= set(plugins)
    assert plugins["dataset"]["distribution"] == "p4bench"
    assert json.loads(open(f"{summary['results_dir']}/summary.json").read())["plugins"] == plugins

    from mlflow.tracking import MlflowClient

    assert summary["tracked"], summary.get("tracking_error")
    tags = MlflowClient(tracking_uri=summary["tracking_uri"]).get_run(summary["run_id"]).data.tags
    assert tags["plugin.method"] == "p4bench-tiny 2.3.4"
    assert tags["plugin.dataset"].startswith("p4bench ") and "plugin.accountant" in tags
