"""Plugin lookup, tiny run configs and instrumented runs for the conformance checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.hookspecs import hookimpl
from p4bench.testing.probes import Recorder, count_mechanism, probe_defense, spy_on

__all__ = [
    "BASE_CONFIG",
    "Instrumented",
    "StopAfterStep",
    "compare_outcomes",
    "make_config",
    "resolve_plugin",
    "run_config",
]

# Small enough that a check of every runtime takes seconds: 4 clients, 2 rounds of 2
# steps on the bundled digits data; every client reported; the fast rdp accountant.
BASE_CONFIG: dict[str, Any] = dict(
    clients=4, rounds=2, local_steps=2, eval_fraction=0.0, seed=0, accountant="rdp"
)

_HOOKS = {
    "method": "register_methods",
    "attack": "register_attacks",
    "defense": "register_defenses",
}


class _Provides:
    """A plugin object registering one class under test."""

    def __init__(self, kind: str, cls: type) -> None:
        self.kind, self.cls = kind, cls

    def _mine(self, kind: str) -> list[type]:
        return [self.cls] if kind == self.kind else []

    @hookimpl
    def register_methods(self) -> list[type]:
        return self._mine("method")

    @hookimpl
    def register_attacks(self) -> list[type]:
        return self._mine("attack")

    @hookimpl
    def register_defenses(self) -> list[type]:
        return self._mine("defense")


def resolve_plugin(
    kind: str, plugin: str | type, plugin_manager: Any = None
) -> tuple[str, type, Any]:
    """(name, class, plugin manager) for a registered name or a class; a class that is
    not registered yet is registered in a plugin manager of its own."""
    from p4bench.host.manager import Registry, create_plugin_manager

    pm = plugin_manager or create_plugin_manager()
    registry = Registry(pm)
    if isinstance(plugin, str):
        return plugin, registry.get(kind, plugin), pm
    name = getattr(plugin, "name", None)
    if not isinstance(name, str) or not name:
        raise UsageError(f"{kind} class {plugin!r} has no string attribute 'name'")
    try:
        existing = registry.get(kind, name)
    except UsageError:
        existing = None
    if existing is plugin:
        return name, plugin, pm
    if existing is not None:
        raise UsageError(
            f"{kind} name '{name}' is registered by {existing.__module__}.{existing.__qualname__}; "
            "give the class under test a name of its own"
        )
    if plugin_manager is not None:
        pm.register(_Provides(kind, plugin))
    else:
        pm = create_plugin_manager(extra_plugins=(_Provides(kind, plugin),))
    return name, plugin, pm


def make_config(overrides: Mapping[str, Any], **fixed: Any) -> RunConfig:
    """`BASE_CONFIG` < `overrides` < `fixed` (ConfigError on bad values)."""
    return RunConfig(**{**BASE_CONFIG, **dict(overrides), **fixed})


def private(config: RunConfig, epsilon: float) -> RunConfig:
    """`config` with DP on: its own epsilon or noise multiplier, else `epsilon`."""
    if config.epsilon is not None or config.noise_multiplier is not None:
        return config.replace(no_dp=False)
    return config.replace(no_dp=False, epsilon=float(epsilon))


def non_private(config: RunConfig) -> RunConfig:
    return config.replace(no_dp=True, epsilon=None, noise_multiplier=None)


@dataclass
class Instrumented:
    """A run and what its probes observed."""

    result: Any  # p4bench.run.runner.RunResult
    recorder: Recorder
    method: Any = None
    ledger: Any = None
    initial: dict[str, torch.Tensor] = field(default_factory=dict)


def run_config(config: RunConfig, pm: Any, *, instrument: bool = False) -> Instrumented:
    """Run `config` untracked. With `instrument`, spy on the method, count the DP
    mechanism's noise and releases and count what reaches the defense (wrapping the
    run's own, or a plain weighted mean where the run has none)."""
    from p4bench.run.runner import run

    recorder = Recorder(config.clients)
    seen: dict[str, Any] = {}

    def prepared(prep: Any) -> None:
        job = prep.job
        seen["method"], seen["ledger"] = job.method, prep.ledger
        if instrument:
            spy_on(job.method, recorder)
            job.wrap_mechanism = _chain(job.wrap_mechanism, count_mechanism(recorder))
            job.defense = probe_defense(job.config, job.defense, recorder)

    result = run(config, plugin_manager=pm, track=False, on_prepared=prepared)
    method = seen.get("method")
    initial = method.initial_params() if method is not None else {}
    return Instrumented(result, recorder, method, seen.get("ledger"), initial)


def _chain(first: Any, second: Any) -> Any:
    if first is None:
        return second
    return lambda mechanism: second(first(mechanism))


def compare_outcomes(
    label: str, expected: Any, got: Any, atol: float, accuracy_atol: float
) -> list[str]:
    """Differences between two runs' outcomes (empty when they agree)."""
    a, b = expected.outcome, got.outcome
    problems: list[str] = []
    if sorted(a.final_params) != sorted(b.final_params):
        return [
            f"{label}: deployed parameter names {sorted(b.final_params)} != {sorted(a.final_params)}"
        ]
    for key in sorted(a.final_params):
        x, y = (
            a.final_params[key].cpu().double(),
            b.final_params[key].cpu().double(),
        )  # runs on different devices
        if x.shape != y.shape:
            problems.append(
                f"{label}: deployed '{key}' has shape {tuple(y.shape)}, expected {tuple(x.shape)}"
            )
            continue
        diff = (x - y).abs().nan_to_num(nan=float("inf")) * ~(x.isnan() & y.isnan())
        tolerance = atol + 1e-4 * x.abs().nan_to_num(0.0)
        bad = (
            (diff > tolerance).flatten(start_dim=1).any(dim=1) if x.dim() > 1 else diff > tolerance
        )
        if bool(bad.any()):
            problems.append(
                f"{label}: deployed '{key}' differs by up to {float(diff.max()):.3g} "
                f"(clients {bad.nonzero().squeeze(1).tolist()})"
            )
    problems += _compare_accuracy(label, "accuracy", a.accuracy, b.accuracy, accuracy_atol)
    if sorted(a.extra_accuracy) != sorted(b.extra_accuracy):
        problems.append(
            f"{label}: extra models {sorted(b.extra_accuracy)} != {sorted(a.extra_accuracy)}"
        )
    for name in sorted(set(a.extra_accuracy) & set(b.extra_accuracy)):
        problems += _compare_accuracy(
            label,
            f"accuracy of '{name}'",
            a.extra_accuracy[name],
            b.extra_accuracy[name],
            accuracy_atol,
        )
    if int(a.bytes_sent) != int(b.bytes_sent):
        problems.append(
            f"{label}: {int(b.bytes_sent)} bytes sent, expected {int(a.bytes_sent)} (the same frames)"
        )
    if len(a.reports) != len(b.reports):
        problems.append(f"{label}: {len(b.reports)} rounds reported, expected {len(a.reports)}")
    return problems


def _compare_accuracy(
    label: str, what: str, x: np.ndarray, y: np.ndarray, tolerance: float
) -> list[str]:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape:
        return [f"{label}: {what} of {y.shape} clients, expected {x.shape}"]
    diff = np.abs(x - y)
    bad = np.flatnonzero(~(diff <= tolerance))
    if len(bad):
        return [
            f"{label}: {what} differs by up to "
            f"{float(np.nanmax(diff)) if np.isfinite(diff).any() else float('nan'):.3g} "
            f"(clients {bad.tolist()})"
        ]
    return []


def runtime_config(config: RunConfig, runtime: str) -> RunConfig:
    """`config` on `runtime`; the device runtime runs local peers on 127.0.0.1 with the
    simulator's seeded streams (a simulation on devices), so results are comparable;
    `accelerator` is the simulation on the emulated `emu` device (run it under
    `accelerator_scope()`), or on CUDA where CUDA is available."""
    if runtime == "accelerator":
        from p4bench.testing.emulated_device import accelerator_device

        return config.replace(
            runtime="simulation", device=accelerator_device(), noise_generator="philox"
        )
    if runtime != "device":
        return config.replace(runtime=runtime)
    options = {**dict(config.options), "device_local_peers": config.clients}
    return config.replace(
        runtime="device", noise_source="seeded", device_simulation=True, options=options
    )


def names(values: Sequence[str] | str) -> tuple[str, ...]:
    return (values,) if isinstance(values, str) else tuple(values)


class StopAfterStep:
    """An observer that asks a run to stop in round `step`, as the first Ctrl-C does
    (`p4bench.run.interrupts`): the run ends after that round with a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def round_finished(self, run: Any, report: Any) -> None:
        if report.step == self.step:
            from p4bench.run import interrupts

            interrupts.request_stop()
