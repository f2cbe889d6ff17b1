"""Sweeps: a YAML grid of run options, expanded to runs that all go to one MLflow experiment.

A sweep file::

    name: fig2                 # the MLflow experiment (and the `sweep` tag of every run)
    base: {dataset: digits, clients: 20, rounds: 30}
    axes:                      # Cartesian product; `none` = no attack / no defense
      method: [local, fedavg, p4]
      attack: [none, label-flip]
      seed: [0, 1, 2]
    variants:                  # optional: a union of sub-grids, each crossed with `axes`
      - {label: "alpha 25%", partitioner: alpha, similarity: 0.25}
      - {label: "shards N=2", partitioner: shards, options.shards_per_client: 2}
    include: tuned.yaml        # optional: per-method values written by `p4bench tune`
    per_method: {local: {epsilon: none}, p4: {options.group_size: 4}}   # optional: per-method values

Keys are run options (hyphens or underscores) or `options.<name>` for plugin options.
Every run's plugin options must be declared by a plugin it uses (`p4bench.options`), and
all runs are checked before the first starts: give a method's own options in `per_method`
(or a variant that names the method), not on an axis crossed with other methods.
Precedence for each run: defaults < base < included tuned values < per_method < axes <
variant. For `defense`, `none` means no defense and a null (`~`) the method's default.
A variant's `label` becomes the run's `variant` tag; its `reference` (text: why) declares
its runs reference rows, tag `reference` (`sweep_plan.REFERENCE`). Neither is run config.

Equal privacy (`p4bench.studies.equal_privacy`): the study uses one neighbouring relation for all its
private runs. A private run that names none gets the one the sweep names, or add-remove when
the sweep names none (said in the output); runs naming different relations are refused before
anything trains unless `allow_mixed_privacy` (`--allow-mixed-privacy`).

Resuming: a run whose config hash already has a FINISHED run in the experiment is skipped,
so running an interrupted sweep again only does the missing runs; a run that Ctrl-C
stopped goes on from its checkpoint, in the same MLflow run. The first Ctrl-C lets the
current run(s) finish their round and write a checkpoint, starts no further run and
raises `SweepInterrupted` (exit 130) unless every run is done; a second one stops at
once. A failing run is recorded (FAILED in MLflow, listed in the summary) and the others go on.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from p4bench.config import RunConfig
from p4bench.errors import ConfigError, UsageError
from p4bench.options import validate_planned
from p4bench.run.interrupts import graceful_interrupts, say
from p4bench.studies.backends import Backend, LocalBackend, RunRecord, RunTask
from p4bench.studies.sweep_plan import (
    VARIANT_TAGS,
    PlannedRun,
    SweepSpec,
    apply_option,
    describe_run,
    option_key,
    split_variant,
)  # re-exported
from p4bench.studies.sweep_privacy import study_privacy, uncertified_notice

__all__ = [
    "SweepSpec",
    "PlannedRun",
    "SweepReport",
    "SweepInterrupted",
    "load_sweep",
    "parse_sweep",
    "expand",
    "run_sweep",
    "unknown_names",
    "option_key",
    "apply_option",
    "describe_run",
]

_SPEC_KEYS = ("name", "base", "axes", "variants", "include", "per_method")


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and check a sweep file; `include` paths are relative to it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"sweep file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"sweep file {path} is not valid YAML: {exc}") from None
    return parse_sweep(data, source=str(path), folder=path.parent)


def parse_sweep(data: Any, source: str = "sweep", folder: Path | None = None) -> SweepSpec:
    """A SweepSpec from the mapping of a sweep file."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{source} must hold a mapping with keys {', '.join(_SPEC_KEYS)}")
    unknown = sorted(set(map(str, data)) - set(_SPEC_KEYS))
    if unknown:
        raise UsageError(
            f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(_SPEC_KEYS)}"
        )
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise UsageError(f"{source}: 'name' (the MLflow experiment) must be a non-empty string")
    base = _mapping(data.get("base"), f"{source}: base")
    axes = {k: _values(v) for k, v in _mapping(data.get("axes"), f"{source}: axes").items()}
    for key, values in axes.items():
        option_key(key)
        if not values:
            raise UsageError(f"{source}: axis '{key}' has no values")
    variants = data.get("variants") or []
    if not isinstance(variants, list) or not all(isinstance(v, Mapping) for v in variants):
        raise UsageError(f"{source}: 'variants' must be a list of mappings of run options")
    per_method: dict[str, dict[str, Any]] = {}
    includes = data.get("include") or []
    for include in [includes] if isinstance(includes, (str, Path)) else includes:
        target = (
            Path(include) if folder is None or Path(include).is_absolute() else folder / include
        )
        for method, tuned in load_tuned(target).items():
            per_method.setdefault(method, {}).update(tuned)
    for method, values in _mapping(data.get("per_method"), f"{source}: per_method").items():
        per_method.setdefault(str(method), {}).update(
            _mapping(values, f"{source}: per_method.{method}")
        )
    for key in [
        *base,
        *(k for v in variants for k in v if k not in VARIANT_TAGS),
        *(k for v in per_method.values() for k in v),
    ]:
        option_key(key)
    return SweepSpec(name.strip(), base, axes, tuple(variants), per_method)


def load_tuned(path: str | Path) -> dict[str, dict[str, Any]]:
    """The per-method values of a file written by `p4bench tune` (key `tuned`)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"included tuned config not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    tuned = data.get("tuned") if isinstance(data, Mapping) else None
    if not isinstance(tuned, Mapping):
        raise UsageError(
            f"{path} has no 'tuned' mapping of method -> options (written by p4bench tune)"
        )
    return {str(m): dict(_mapping(v, f"{path}: tuned.{m}")) for m, v in tuned.items()}


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(f"{what} must be a mapping, got {value!r}")
    return dict(value)


def _values(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _combinations(grid: Mapping[str, Any]) -> list[list[tuple[str, Any]]]:
    items = [[(key, v) for v in _values(values)] for key, values in grid.items()]
    return [list(combo) for combo in itertools.product(*items)]


def expand(
    spec: SweepSpec, overrides: Mapping[str, Any] | None = None, registry: Any = None
) -> list[PlannedRun]:
    """Every run of the sweep in a stable order (variants, then axes), duplicates removed.

    `overrides` (results_dir, tracking_uri, ...) apply to every run after everything else.
    Private runs that name no neighbouring relation get the study's one
    (`p4bench.studies.equal_privacy.settle_relation`).
    """
    from p4bench.studies.equal_privacy import settle_relation

    combos: list[tuple[RunConfig, dict[str, str]]] = []
    for variant in spec.variants or ({},):
        grid, variant_tags = split_variant(variant)
        for variant_combo in _combinations(grid):
            for axes_combo in _combinations(spec.axes):
                config = _config(spec, axes_combo, variant_combo, overrides or {})
                tags = {"sweep": spec.name, **variant_tags}
                combos.append((config, tags))
    configs, _, _ = settle_relation([c for c, _ in combos], registry)
    planned: list[PlannedRun] = []
    seen: set[str] = set()
    for config, (_, tags) in zip(configs, combos):
        key = config.config_hash()
        if key in seen:
            continue
        seen.add(key)
        planned.append(PlannedRun(config, tags))
    return planned


def _config(
    spec: SweepSpec,
    axes_combo: Iterable[tuple[str, Any]],
    variant_combo: Iterable[tuple[str, Any]],
    overrides: Mapping[str, Any],
) -> RunConfig:
    probe: dict[str, Any] = {}
    for key, value in [*spec.base.items(), *axes_combo, *variant_combo]:
        apply_option(probe, key, value)
    method = probe.get("method", RunConfig.method)
    values: dict[str, Any] = {}
    layers = [
        spec.base.items(),
        spec.per_method.get(str(method), {}).items(),
        axes_combo,
        variant_combo,
        overrides.items(),
    ]
    for key, value in itertools.chain(*layers):
        apply_option(values, key, value)
    values["experiment"] = spec.name
    try:
        return RunConfig(**values)
    except ConfigError as exc:
        described = ", ".join(f"{k}={v}" for k, v in [*axes_combo, *variant_combo]) or "base"
        raise ConfigError(
            exc.field, f"{str(exc).split(': ', 1)[-1]} (in the run {described})"
        ) from None


def unknown_names(config: RunConfig, registry: Any) -> list[tuple[str, str]]:
    """(kind, name) of every plugin the config names that is not registered."""
    wanted = [
        ("method", config.method),
        ("dataset", config.dataset),
        ("partitioner", config.partitioner),
        ("model", config.model),
        ("runtime", config.runtime),
        ("accountant", config.accountant),
    ]
    if config.attack:
        wanted.append(("attack", config.attack))
    if config.defense not in (None, "none"):
        wanted.append(("defense", config.defense))
    return [(kind, name) for kind, name in wanted if name not in registry.names(kind)]


def _incompatibility(config: RunConfig, registry: Any) -> str | None:
    method = registry.get("method", config.method)
    defense = config.defense if config.defense is not None else method.default_defense
    for kind, name in (("attack", config.attack), ("defense", defense)):
        if name in (None, "none"):
            continue
        reason = registry.get(kind, name).incompatibility(method.capabilities)
        if reason:
            return f"{kind} '{name}' cannot be used with method '{config.method}': {reason}"
    return None


class ProgressSink(Protocol):
    """What receives a sweep's progress: `Progress` or anything with its methods."""

    def start(self, total: int, skipped: int) -> None: ...

    def advance(self, record: RunRecord, planned: PlannedRun) -> None: ...

    def stop(self) -> None: ...


class Progress:
    """Receives a sweep's progress (the CLI draws a bar); all methods optional."""

    def start(self, total: int, skipped: int) -> None: ...

    def advance(self, record: RunRecord, planned: PlannedRun) -> None: ...

    def stop(self) -> None: ...


@dataclass
class SweepReport:
    """The outcome of a sweep: one record per planned run, in plan order."""

    name: str
    tracking_uri: str
    planned: list[PlannedRun]
    records: list[RunRecord]
    notices: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.records)

    @property
    def failures(self) -> list[tuple[PlannedRun, RunRecord]]:
        return [(p, r) for p, r in zip(self.planned, self.records) if r.status == "failed"]

    @property
    def untracked(self) -> list[tuple[PlannedRun, RunRecord]]:
        """Runs that finished but did not reach MLflow (kept locally; a resume runs them again)."""
        return [
            (p, r)
            for p, r in zip(self.planned, self.records)
            if r.status == "finished" and r.summary.get("tracked") is False
        ]

    @property
    def trained(self) -> int:
        """Runs executed now (finished or failed), i.e. not skipped."""
        return self.count("finished") + self.count("failed")


def run_sweep(
    spec: SweepSpec,
    backend: Backend | None = None,
    *,
    results_dir: str | None = None,
    tracking_uri: str | None = None,
    tuning: bool = False,
    registry: Any = None,
    progress: ProgressSink | None = None,
    track: bool = True,
    planned: Sequence[PlannedRun] | None = None,
    allow_mixed_privacy: bool = False,
) -> SweepReport:
    """Plan, skip what already finished, execute the rest on `backend`, report.

    Unknown plugin names fail before anything runs (UnknownNameError), and so do plugin
    options no plugin of a run declares or with bad values (ConfigError), and private
    runs under different neighbouring relations (UsageError, unless `allow_mixed_privacy`);
    runs whose attack or defense cannot be used with their method are listed as
    incompatible and not run.
    """
    from p4bench.host.manager import DISABLE_AUTOLOAD_ENV, default_registry
    from p4bench.studies.results import ensure_experiment, finished_runs, tracking_uri_for

    registry = registry or default_registry()
    backend = backend or LocalBackend()
    progress = progress or Progress()
    base_dir = str(
        Path(
            results_dir
            or spec.base.get("results_dir")
            or spec.base.get("results-dir")
            or RunConfig.results_dir
        ).resolve()
    )
    uri = tracking_uri_for(
        tracking_uri or spec.base.get("tracking_uri") or spec.base.get("tracking-uri"), base_dir
    )
    if planned is None:
        planned = expand(spec, {"results_dir": base_dir, "tracking_uri": uri}, registry)
    planned = list(planned)
    for run in planned:
        for kind, name in unknown_names(run.config, registry):
            registry.get(kind, name)  # raises UnknownNameError with the registered names
    validate_planned(
        planned, registry, describe_run
    )  # every run's plugin options, before the first starts
    notices: list[str] = study_privacy(
        spec,
        planned,
        registry,
        allow_mixed=allow_mixed_privacy,
        what=f"{'tuning' if tuning else 'sweep'} '{spec.name}'",
    )
    done: dict[tuple[str, bool], dict[str, Any]] = {}
    if track:
        try:
            ensure_experiment(uri, spec.name)
            done = finished_runs(uri, spec.name)
        except Exception as exc:  # noqa: BLE001 - an unreachable store must not stop the sweep
            notices.append(
                f"MLflow store {uri} not usable ({type(exc).__name__}: {str(exc)[:200]}); "
                "finished runs cannot be skipped, results are kept locally"
            )
    if getattr(backend, "address", None) and uri.startswith("sqlite:"):
        notices.append(
            f"Ray workers on other machines log to their own copy of {uri}; give a shared MLflow server "
            "(--tracking-uri http://...) or a path on a shared filesystem"
        )
    autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    records: list[RunRecord | None] = [None] * len(planned)
    tasks: list[RunTask] = []
    positions: list[int] = []
    for index, run in enumerate(planned):
        previous = done.get((run.config_hash, tuning))
        if previous is not None:
            records[index] = _skipped(run, previous)
            continue
        reason = _incompatibility(run.config, registry)
        if reason:
            records[index] = RunRecord(
                run.config_hash, "incompatible", error=reason, tags=dict(run.tags)
            )
            continue
        tasks.append(
            RunTask(
                run.config.to_dict(), dict(run.tags), tuning=tuning, track=track, autoload=autoload
            )
        )
        positions.append(index)
    progress.start(len(planned), len(planned) - len(tasks))
    with graceful_interrupts(always=True, notice=say):
        try:

            def on_done(task_index: int, record: RunRecord) -> None:
                index = positions[task_index]
                records[index] = record
                progress.advance(record, planned[index])

            backend.map(tasks, on_done)
        finally:
            progress.stop()
    lost = [i for i, r in enumerate(records) if r is None]
    for index in lost:  # a backend that returned without an answer for some run
        records[index] = RunRecord(
            planned[index].config_hash, "failed", error="no result came back"
        )
    report = SweepReport(spec.name, uri, planned, records, notices)  # type: ignore[arg-type]
    if report.count("interrupted"):
        raise SweepInterrupted(report)
    uncertified = uncertified_notice(planned, records)  # type: ignore[arg-type]
    if uncertified:
        notices.append(uncertified)
    return report


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a sweep before all its runs were done (a sweep whose runs all
    finished returns normally, whenever the Ctrl-C came). The runs that were training
    kept checkpoints: running the sweep again skips the finished runs and resumes those.
    Its message is the one line the command line prints (exit 130)."""

    def __init__(self, report: SweepReport) -> None:
        self.report = report
        done = sum(report.count(s) for s in ("finished", "skipped", "incompatible"))
        resumable = sum(
            1 for r in report.records if r.status == "interrupted" and r.error != "not started"
        )
        self.text = (
            f"sweep '{report.name}' interrupted: {done} of {len(report.records)} runs done"
            + (f", {resumable} stopped with a checkpoint" if resumable else "")
            + "; run the same sweep again to go on (finished runs are skipped, checkpoints resumed)"
        )
        super().__init__(self.text)


def _skipped(run: PlannedRun, row: Mapping[str, Any]) -> RunRecord:
    from p4bench.studies.attempts import finished_summary

    summary, evaluation = finished_summary(run.config, row)
    return RunRecord(
        run.config_hash,
        "skipped",
        summary=summary,
        evaluation_accuracy=evaluation,
        mlflow_run_id=row.get("run_id"),
        tags=dict(run.tags),
    )
