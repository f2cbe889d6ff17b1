"""Moved modules and names keep their old import paths for one minor version, each with a
`PluginDeprecationWarning` that names the importing line and the new home."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from p4bench.errors import PluginDeprecationWarning
from p4bench.moved import MOVED_MODULES, home_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_the_new_module_with_a_warning_at_the_importing_line(old):
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new  # the module itself, not a copy: patching either name patches both
    [warning] = [w for w in caught if issubclass(w.category, PluginDeprecationWarning)]
    assert f"{old} is deprecated" in str(warning.message) and MOVED_MODULES[old] in str(
        warning.message
    )


def test_the_warning_names_the_plugin_line_that_imported_the_old_path(tmp_path):
    plugin = tmp_path / "oldimports.py"
    plugin.write_text(
        "import warnings\nwarnings.simplefilter('always')\n\nfrom p4bench.runner import prepare\n"
        "from p4bench import tune\n"
    )
    done = subprocess.run(
        [sys.executable, str(plugin)], capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "PluginDeprecationWarning" in line]
    assert [line.split(": PluginDeprecationWarning")[0] for line in lines] == [
        f"{plugin}:4",
        f"{plugin}:5",
    ]
    assert (
        "import it from p4bench.run.runner" in lines[0]
        and "import it from p4bench.studies.tune" in lines[1]
    )


def test_no_moved_module_is_left_behind_and_every_new_home_exists():
    for old, new in MOVED_MODULES.items():
        assert not (ROOT / "p4bench" / f"{old.rpartition('.')[2]}.py").exists(), old
        assert importlib.util.find_spec(new) is not None, new


def test_names_that_left_a_module_are_forwarded_with_a_warning_and_others_still_fail():
    from p4bench import claims, presets
    from p4bench_p4 import claims as p4_claims
    from p4bench_p4 import presets as p4_presets

    with pytest.warns(
        PluginDeprecationWarning, match="p4bench.claims.privacy_claims is deprecated"
    ):
        assert claims.privacy_claims is p4_claims.privacy_claims
    with pytest.warns(PluginDeprecationWarning, match="import it from p4bench_p4.presets"):
        assert presets.EPSILONS == p4_presets.EPSILONS
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        claims.no_such_name  # noqa: B018


FORWARDED = [  # (module, name, its home since 0.2)
    ("p4bench.run.runner", "reported_mean", "p4bench.run.summary"),
    ("p4bench.run.runner", "DetectionScore", "p4bench.run.summary"),
    ("p4bench.tracking", "EXPERIMENT_KIND_TAG", "p4bench.tracking.ops"),
    ("p4bench.tracking", "Tracker", "p4bench.tracking.tracker"),
    ("p4bench.cli", "warn_plugin_problems", "p4bench.cli.problems"),
    ("p4bench.cli.run", "rejections_line", "p4bench.cli.summary_table"),
    ("p4bench.engine.threats", "UPDATE_PREFIX", "p4bench.engine.messages"),
    (
        "p4bench_baselines.cross_gradients",
        "noise_std_per_coordinate",
        "p4bench.privacy.concatenated",
    ),
]


@pytest.mark.parametrize(("module", "name", "home"), FORWARDED)
def test_a_name_defined_elsewhere_now_is_forwarded_from_its_old_module(module, name, home):
    with pytest.warns(PluginDeprecationWarning, match=f"import it from {home}"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(home), name)


_IMPORT_EVERY_MODULE = """
import importlib, pkgutil, warnings
from p4bench.errors import PluginDeprecationWarning
warnings.simplefilter("error", PluginDeprecationWarning)
from p4bench.moved import MOVED_MODULES, home_of
names = []
from p4bench.host.manager import BUILTIN_PLUGINS
for package in ("p4bench", *BUILTIN_PLUGINS.values()):
    names += [i.name for i in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
for name in names:
    if name not in MOVED_MODULES and not name.endswith("__main__"):
        importlib.import_module(name)
print(len(names))
"""


def test_p4bench_itself_uses_no_deprecated_path():
    """Every shipped module imports with deprecation warnings as errors: a forward is for
    outside code only, so users never see a warning caused by p4bench's own imports."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERY_MODULE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 200


def test_no_shipped_module_imports_a_moved_path_even_inside_a_function():
    import ast
    import tomllib

    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]["where"]
    found = []
    for root in roots:
        for path in (ROOT / root).glob("p4bench*/**/*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    targets = [
                        node.module,
                        *(f"{node.module}.{alias.name}" for alias in node.names),
                    ]
                else:
                    continue
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {t}"
                    for t in targets
                    if home_of(t) is not None
                ]
    assert found == []


def test_check_plugin_names_a_plugins_import_of_a_moved_module(install_example, tmp_path, capsys):
    import json
    import textwrap

    from p4bench.cli import main
    from p4bench.host.manager import reset_default

    package = tmp_path / "p4bench-oldimports"
    (package / "p4bench_oldimports").mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        '[project]\nname = "p4bench-oldimports"\nversion = "1.0"\n'
        '[project.entry-points.p4bench]\noldimports = "p4bench_oldimports"\n'
    )
    (package / "p4bench_oldimports" / "__init__.py").write_text(
        textwrap.dedent("""
        from p4bench.api import hookimpl
        from p4bench.runner import RunResult  # a 0.1 path
        from p4bench_baselines.local import LocalTraining

        class Quiet(LocalTraining):
            name = "oldimports-local"
            description = "Local training from a package that imports a 0.1 path"

        @hookimpl
        def register_methods():
            return [Quiet]
    """)
    )
    install_example(package)
    sys.modules.pop(
        "p4bench.runner", None
    )  # as in a fresh process: an old path warns where it is first imported
    try:
        with pytest.raises(SystemExit) as info:
            main(["check-plugin", "p4bench-oldimports", "--json"])
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert info.value.code == 1
        # its imports outside p4bench.api are the others (tests/test_plugin_compat.py)
        (problem,) = [p for p in report["problems"] if not p.startswith("internal import at ")]
        assert (
            "p4bench_oldimports/__init__.py:3" in problem
            and "the module p4bench.runner is deprecated" in problem
        )
    finally:
        sys.modules.pop("p4bench_oldimports", None)
        reset_default()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("p4bench.attacks.label_flip", "p4bench_attacks.label_flip"),
        ("p4bench.defenses", "p4bench_defenses"),
        ("p4bench.plugins.device.inbound", "p4bench_device.inbound"),
        ("p4bench.plugins.p4.method", "p4bench_p4.method"),
        ("p4bench.baselines.fedavg", "p4bench_baselines.fedavg"),
        ("p4bench.baselines.pdsl", "p4bench_pdsl.method"),
        ("p4bench.baselines.common", "p4bench.engine.method_kit"),
        ("p4bench.plugin_manager", "p4bench.host.manager"),
        ("p4bench.tracking_worker", "p4bench.tracking.worker"),
    ],
)
def test_an_old_path_of_a_moved_plugin_package_or_host_module_warns_and_is_the_new_module(old, new):
    for name in [n for n in sys.modules if n == old or n.startswith(old + ".")]:
        sys.modules.pop(name)
    with pytest.warns(PluginDeprecationWarning, match=f"import it from {new.replace('.', '[.]')}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
