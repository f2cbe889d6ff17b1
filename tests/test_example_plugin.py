"""The example third-party package is discovered through its entry point and runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from p4bench.host.manager import Registry, create_plugin_manager, reset_default

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "p4bench-fedprox"


@pytest.fixture
def installed_example(install_example):
    """Make the example importable and give it real distribution metadata with its
    entry point (what `pip install` writes), without touching the environment."""
    install_example(EXAMPLE)
    yield
    sys.modules.pop("p4bench_fedprox", None)
    reset_default()


def test_entry_point_plugin_is_discovered(installed_example):
    registry = Registry(create_plugin_manager())
    entry = next(e for e in registry.entries("method") if e.name == "fedprox")
    assert (entry.distribution, entry.version) == ("p4bench-fedprox", "0.1.0")


def test_entry_point_plugin_runs_through_the_cli(installed_example, capsys, results_dir):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "fedprox",
                "-o",
                "mu=0.1",
                "--clients",
                "6",
                "--rounds",
                "3",
                "--results-dir",
                results_dir,
                "--json",
            ]
        )
    assert (info.value.code or 0) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["method"] == "fedprox" and summary["accuracy_mean"] > 0.5


def test_example_validates_its_option(installed_example, capsys):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "--method", "fedprox", "-o", "mu=-1"])
    assert info.value.code == 2 and "options.mu" in capsys.readouterr().err
