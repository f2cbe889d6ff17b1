"""Everything an installed distribution registers, checked at small size
(`p4bench check-plugin DIST`).

For each plugin of the distribution: its loading and registration problems (as `list`
reports them), then the conformance kit (methods: every check in the simulation and
reference runtimes with DP on and off, the post-processing replay included; attacks and
defenses: against FedAvg; topologies: built with their defaults and drawn for 8 clients;
datasets: loaded from the data folder, when their files are there, and their arrays
checked). Other kinds are listed as not checked. The package's source is read too
(`p4bench.testing.plugin_source`): every import outside `p4bench.api` and every option a
plugin reads without declaring it is a finding. A deprecated plugin API call met on the way (a
`PluginDeprecationWarning`) is a finding too: the package works today and breaks when the
deprecated call is removed.

Each finding is one line: `<kind> '<name>': <check>: <message>`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p4bench.errors import PluginDeprecationWarning, UsageError

__all__ = ["DistributionReport", "check_distribution"]

QUICK_RUNTIMES = ("simulation", "reference")


@dataclass
class DistributionReport:
    """What `check_distribution` found: one line per problem, and what was checked."""

    distribution: str
    version: str
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(
        default_factory=list
    )  # "<kind> '<name>': <n> checks passed" / "not checked"

    @property
    def passed(self) -> bool:
        return not self.problems


def _installed_distributions(registry: Any) -> dict[str, str]:
    """Distribution -> version of every installed (non-built-in) plugin source, broken ones too."""
    from p4bench.host.manager import KINDS

    found = {p.distribution: p.version for p in registry.problems}
    for kind in KINDS:
        for entry in registry.entries(kind):
            found.setdefault(entry.distribution, entry.version)
    return found


def _topology_check(name: str, cls: type) -> list[str]:
    import numpy as np

    topology = cls(None)
    edges = np.asarray(topology.edges(8, 0, np.random.default_rng(0)))
    if edges.shape != (8, 8) or edges.dtype != bool:
        return [
            f"build: edges(8, ...) must be an (8, 8) bool matrix, got shape {edges.shape} and dtype {edges.dtype}"
        ]
    if edges.diagonal().any():
        return ["build: a client sends to itself (the diagonal of edges() is set)"]
    return []


def _dataset_check(name: str, cls: type) -> tuple[list[str], str]:
    """Problems of the loaded arrays, and what was checked ("" when the files are missing)."""
    import numpy as np

    from p4bench.data.base import load_dataset
    from p4bench.data.paths import data_dir

    instance = cls()
    if not instance.is_present(data_dir()):
        return [], f"files not in {data_dir()} (p4bench data download {name}): not loaded"
    arrays = load_dataset(instance, data_dir())
    problems = []
    for split in ("train", "test"):
        x, y = getattr(arrays, f"x_{split}"), getattr(arrays, f"y_{split}")
        if len(x) != len(y) or not len(y):
            problems.append(f"load: {split} has {len(x)} feature rows and {len(y)} labels")
        elif x.dtype != np.float32 or y.dtype != np.int64:
            problems.append(
                f"load: {split} features must be float32 and labels int64, got {x.dtype} and {y.dtype}"
            )
        elif y.min() < 0 or y.max() >= arrays.num_classes:
            problems.append(f"load: {split} labels outside [0, {arrays.num_classes}) (class_names)")
        elif not np.isfinite(x).all():
            problems.append(f"load: {split} features are not all finite")
    return problems, f"loaded {len(arrays.y_train)} + {len(arrays.y_test)} records"


def _conformance(kind: str, name: str, plugin_manager: Any) -> tuple[list[str], int]:
    """Failures as `check: message` lines, and how many checks passed."""
    from p4bench.testing import check_attack, check_defense, check_method

    runs: dict[str, Callable[[], Any]] = {
        "method": lambda: check_method(
            name, runtimes=QUICK_RUNTIMES, plugin_manager=plugin_manager, raise_on_failure=False
        ),
        "attack": lambda: check_attack(
            name,
            methods=("fedavg",),
            runtimes=QUICK_RUNTIMES,
            plugin_manager=plugin_manager,
            raise_on_failure=False,
        ),
        "defense": lambda: check_defense(
            name,
            methods=("fedavg",),
            runtimes=QUICK_RUNTIMES,
            plugin_manager=plugin_manager,
            raise_on_failure=False,
        ),
    }
    report = runs[kind]()
    failures = [f"{r.name}: {' '.join(r.message.split())}" for r in report.failures]
    return failures, sum(1 for r in report.results if r.passed)


def check_distribution(distribution: str, plugin_manager: Any = None) -> DistributionReport:
    """Check every plugin `distribution` registers; `UsageError` if it registers none."""
    from p4bench.host.loading import import_deprecations
    from p4bench.host.manager import KINDS, Registry, create_plugin_manager
    from p4bench.testing.plugin_source import source_findings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginDeprecationWarning)
        pm = plugin_manager or create_plugin_manager()
        registry = Registry(pm)
        installed = _installed_distributions(registry)
        if distribution not in installed:
            names = ", ".join(sorted(d for d in installed if d != "p4bench")) or "none"
            raise UsageError(
                f"no installed distribution '{distribution}' registers p4bench plugins; "
                f"installed plugin distributions: {names}"
            )
        report = DistributionReport(distribution, installed[distribution])
        report.problems += [
            p.line().split(": ", 1)[1] for p in registry.problems if p.distribution == distribution
        ]
        report.problems += source_findings(distribution, pm, registry)  # imports, options read
        for kind in KINDS:
            for entry in registry.entries(kind):
                if entry.distribution != distribution:
                    continue
                label = f"{kind} '{entry.name}'"
                try:
                    if kind in ("method", "attack", "defense"):
                        failures, passed = _conformance(kind, entry.name, pm)
                    elif kind == "topology":
                        failures, passed = _topology_check(entry.name, entry.cls), 1
                    elif kind == "dataset":
                        failures, loaded = _dataset_check(entry.name, entry.cls)
                        report.problems += [f"{label}: {line}" for line in failures]
                        report.checked.append(f"{label}: {loaded}")
                        continue
                    else:
                        report.checked.append(
                            f"{label}: registered (no conformance check for {kind}s)"
                        )
                        continue
                except Exception as exc:  # noqa: BLE001 - a plugin that crashes the kit is a finding
                    failures, passed = (
                        [f"build: {type(exc).__name__}: {' '.join(str(exc).split())}"],
                        0,
                    )
                report.problems += [f"{label}: {line}" for line in failures]
                report.checked.append(f"{label}: {passed} check(s) passed, {len(failures)} failed")
    seen: set[str] = set()
    met = [
        (w.filename, w.lineno, str(w.message))
        for w in caught
        if issubclass(w.category, PluginDeprecationWarning)
    ]
    for filename, lineno, message in [
        *import_deprecations(distribution),
        *met,
    ]:  # imported before, or now
        line = f"deprecated API at {filename}:{lineno}: {message}"
        if line not in seen:
            seen.add(line)
            report.problems.append(line)
    return report
