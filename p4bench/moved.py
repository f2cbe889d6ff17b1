"""Old import paths of moved modules and names keep working for one minor version, with a
`PluginDeprecationWarning` that names the new home (docs/api.md, "Deprecations").

Two forms:

- a moved **module** is listed in `MOVED_MODULES`; `install()` (run by `import p4bench`)
  puts a finder on `sys.meta_path` that answers only those names: importing the old path
  warns once and returns the new module itself (not a copy), so monkeypatching either
  name patches the same object; a moved **package** (`MOVED_PACKAGES`: the plugin folders,
  which became source roots such as `attacks/p4bench_attacks`) answers its old submodules too;
- a **name** that left a module that still exists is forwarded by that module's
  `__getattr__ = forward_moved(__name__, {"OLD_NAME": "new.module"})`.

Nothing here imports the new homes before the old name is used: `import p4bench` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "EMPTY_PACKAGES",
    "MOVED_MODULES",
    "MOVED_PACKAGES",
    "REMOVED_IN",
    "forward_moved",
    "home_of",
    "install",
]

REMOVED_IN = "0.3"

# old module -> its home since 0.2
MOVED_MODULES: dict[str, str] = {
    # one run: driver, session, checkpoints, interruption, what it prints and records
    "p4bench.runner": "p4bench.run.runner",
    "p4bench.run_session": "p4bench.run.session",
    "p4bench.run_summary": "p4bench.run.summary",
    "p4bench.run_artifacts": "p4bench.run.artifacts",
    "p4bench.run_privacy": "p4bench.run.privacy",
    "p4bench.checkpoint": "p4bench.run.checkpoint",
    "p4bench.preflight": "p4bench.run.preflight",
    "p4bench.interrupts": "p4bench.run.interrupts",
    # studies: many runs and their comparison
    "p4bench.sweep": "p4bench.studies.sweep",
    "p4bench.sweep_plan": "p4bench.studies.sweep_plan",
    "p4bench.sweep_privacy": "p4bench.studies.sweep_privacy",
    "p4bench.tune": "p4bench.studies.tune",
    "p4bench.tune_federation": "p4bench.studies.tune_federation",
    "p4bench.tune_scope": "p4bench.studies.tune_scope",
    "p4bench.reproduce": "p4bench.studies.reproduce",
    "p4bench.compare": "p4bench.studies.compare",
    "p4bench.impact": "p4bench.studies.impact",
    "p4bench.equal_privacy": "p4bench.studies.equal_privacy",
    "p4bench.backends": "p4bench.studies.backends",
    "p4bench.results": "p4bench.studies.results",
    "p4bench.ray_cluster": "p4bench.studies.ray_cluster",
    # a paper's presets, report and model live beside its methods (register_presets)
    "p4bench.presets_karras": "p4bench_p2p_fl.preset",
    "p4bench.models_karras": "p4bench_p2p_fl.models",
    "p4bench.presets_pdsl": "p4bench_pdsl.preset",
    "p4bench.presets_pdsl_report": "p4bench_pdsl.preset_report",
    "p4bench.presets_p4l": "p4bench_p4l.preset",
    "p4bench.presets_p4l_report": "p4bench_p4l.preset_report",
    # the host root keeps the contract; the rest lives in rooms (since 0.2)
    "p4bench.tracking_worker": "p4bench.tracking.worker",
    "p4bench.tracking_ops": "p4bench.tracking.ops",
    "p4bench.tracking_store": "p4bench.tracking.store",
    "p4bench.tracking_attempts": "p4bench.studies.attempts",
    "p4bench.participation": "p4bench.tracking.participation",
    "p4bench.plugin_manager": "p4bench.host.manager",
    "p4bench.plugin_loading": "p4bench.host.loading",
    "p4bench.plugin_types": "p4bench.host.types",
    "p4bench.models_builtin": "p4bench.models.builtin",
    "p4bench.dropout": "p4bench.models.dropout",
    "p4bench.stacked": "p4bench.models.stacked",
    "p4bench.features": "p4bench.data.features",
    "p4bench.state_codec": "p4bench.run.state_codec",
    "p4bench.presets": "p4bench.studies.presets",
    "p4bench.claims": "p4bench.studies.claims",
    "p4bench.devices": "p4bench.engine.devices",
}

# old package (or module) -> its home since 0.2: the plugin folders are source roots whose
# packages are their import names; a submodule of an old package resolves under the new one
MOVED_PACKAGES: dict[str, str] = {
    "p4bench.plugins.p4": "p4bench_p4",
    "p4bench.plugins.p4l": "p4bench_p4l",
    "p4bench.plugins.device": "p4bench_device",
    "p4bench.baselines.common": "p4bench.engine.method_kit",
    "p4bench.baselines.pdsl_preset_report": "p4bench_pdsl.preset_report",
    "p4bench.baselines.pdsl_preset": "p4bench_pdsl.preset",
    "p4bench.baselines.pdsl": "p4bench_pdsl.method",
    "p4bench.baselines.shapley_linear": "p4bench_pdsl.shapley_linear",
    "p4bench.baselines.shapley_rows": "p4bench_pdsl.shapley_rows",
    "p4bench.baselines.shapley": "p4bench_pdsl.shapley",
    "p4bench.baselines.p2p_fl": "p4bench_p2p_fl.method",
    "p4bench.baselines.p2p_policies": "p4bench_p2p_fl.policies",
    "p4bench.baselines.karras_models": "p4bench_p2p_fl.models",
    "p4bench.baselines.karras_preset": "p4bench_p2p_fl.preset",
    "p4bench.baselines": "p4bench_baselines",
    "p4bench.attacks": "p4bench_attacks",
    "p4bench.defenses": "p4bench_defenses",
}
# old packages that only held others: importable (empty) so that their old submodules resolve
EMPTY_PACKAGES = ("p4bench.plugins",)


def _warn(what: str, home: str, stacklevel: int) -> None:
    from p4bench.errors import PluginDeprecationWarning

    warnings.warn(
        f"{what} is deprecated since p4bench 0.2 and will be removed in {REMOVED_IN}: import it from {home}",
        PluginDeprecationWarning,
        stacklevel=stacklevel,
    )


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old module path as its new module: `sys.modules[old]` becomes the new module
    (the import system returns what `sys.modules` holds after `exec_module`)."""

    def __init__(self, home: str) -> None:
        self.home = home

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module replaces it in sys.modules

    def exec_module(self, module: ModuleType) -> None:
        # level 3 is the importing line: warnings skips the import system's own frames
        _warn(f"the module {module.__name__}", self.home, stacklevel=3)
        sys.modules[module.__name__] = importlib.import_module(self.home)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in EMPTY_PACKAGES:
            spec = importlib.machinery.ModuleSpec(fullname, _EmptyPackageLoader(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        home = home_of(fullname)
        if home is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(home))


class _EmptyPackageLoader(importlib.abc.Loader):
    """An old package that only held moved packages: nothing of its own to run."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        return None


def home_of(old: str) -> str | None:
    """Where an old module path lives now (None: it did not move)."""
    if old in MOVED_MODULES:
        return MOVED_MODULES[old]
    parts = old.split(".")
    for cut in range(len(parts), 1, -1):
        home = MOVED_PACKAGES.get(".".join(parts[:cut]))
        if home is not None:
            return ".".join([home, *parts[cut:]])
    return None


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Answer the old module paths (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def forward_moved(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` forwarding each name of `moved` (name -> its new module) there,
    with a deprecation warning naming the caller's line."""

    def __getattr__(name: str) -> Any:
        home = moved.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", home, stacklevel=3)
        return getattr(importlib.import_module(home), name)

    return __getattr__
