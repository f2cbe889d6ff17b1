"""pytest plugin: a `conformance` fixture running the p4bench conformance kit.

Enable it in a conftest.py (``pytest_plugins = ["p4bench.testing.pytest_plugin"]``)
or with ``pytest -p p4bench.testing.pytest_plugin``; then::

    def test_my_method_conforms(conformance):
        conformance.method(MyMethod, options={"mix": 0.3})

Each call raises `ConformanceError` (an AssertionError, so pytest shows every failed
check) and returns the report. Runs are untracked and never autoload other installed
plugins unless the test asks for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p4bench.testing.methods import check_method
from p4bench.testing.report import ConformanceReport
from p4bench.testing.threats import check_attack, check_defense

__all__ = ["Conformance", "conformance"]


class Conformance:
    """The kit's entry points with shared defaults (`RunConfig` fields)."""

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults

    def method(self, method: Any, **kwargs: Any) -> ConformanceReport:
        return check_method(method, **{**self.defaults, **kwargs})

    def attack(self, attack: Any, **kwargs: Any) -> ConformanceReport:
        return check_attack(attack, **{**self.defaults, **kwargs})

    def defense(self, defense: Any, **kwargs: Any) -> ConformanceReport:
        return check_defense(defense, **{**self.defaults, **kwargs})


@pytest.fixture
def conformance(tmp_path: Path) -> Conformance:
    """A `Conformance` whose runs keep any local results under the test's tmp_path."""
    return Conformance(results_dir=str(tmp_path / "runs"))
