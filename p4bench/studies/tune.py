"""`p4bench tune`: the paper's tuning protocol, on evaluation clients only.

Protocol (P4 paper, section V-A/B; `shared/reference/p4.md` section 1 and 8): a fraction
`eval_fraction` (20%) of the clients are *evaluation clients*, used only to tune; results
are reported on the other clients. For each method, every point of its grid is run with
every tuning seed, and the point with the best score is kept, where

    score(point) = mean over seeds of the mean final test accuracy of the benign
                   evaluation clients (metric `accuracy_evaluation_mean`).

Ties go to the earlier point in grid order. Which federation a tuning run trains on
(`tune_on`, `--tune-on`; `p4bench.studies.tune_federation`):

- `evaluation-clients` (default): the evaluation clients alone of a reported run with that
  seed (same partition, same splits, same evaluation clients; `clients` becomes their
  number and `federation_clients` the reported federation's), so no reported client's
  record, train or test, enters a tuning run and the chosen values spend none of the
  reported clients' privacy in the runs that share that partition. Too few evaluation
  clients for a method is refused (UsageError naming the minimum) before any run trains.
- `federation`: the whole federation, with the same clients, partition, roles and
  malicious clients as a reported run with that seed; the reported clients' *training*
  records take part, so the tuned values are not covered by the privacy accounting. Only
  their test splits are withheld.

In both modes, before round one the test split of every client that is not a benign
evaluation client is *withheld* (emptied in the run's data, see
`p4bench.studies.backends.WithheldTests`), so no model is ever evaluated on a reported client's
test data; their accuracies in tuning runs are NaN, not numbers. The tuned file, the
printed tables and every tuning run's MLflow tags (`tune_on`, `tune_federation`) say which
mode was used. (Accounting tuning on reported clients with the Renyi-DP tuning theorem of
Papernot and Steinke (2022) is the alternative, not built.)

A tuning file::

    name: tune-digits          # MLflow experiment of the tuning runs
    base: {dataset: digits, clients: 20, rounds: 10}
    seeds: [0, 1]
    grid: {lr: [0.1, 0.5, 1.0]}          # shared by every method
    tune_on: evaluation-clients          # or federation (see above)
    methods:                             # list, or method -> its own grid (merged over `grid`)
      fedavg:
      p4: {local_steps: [1, 5]}

Equal privacy (`p4bench.studies.equal_privacy`): the candidates' private runs share one neighbouring
relation (the one the tuning base names, else add-remove for the whole study) and must be
certified; otherwise tuning refuses (UsageError naming the runs) unless `allow_mixed_privacy`,
and then each point's privacy is shown.

The result is a YAML file with a `tuned` mapping (method -> chosen values) that sweep files
can `include`, plus every point's score for the record.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.studies.backends import Backend
from p4bench.studies.sweep import (
    PlannedRun,
    ProgressSink,
    SweepReport,
    SweepSpec,
    expand,
    option_key,
    run_sweep,
)
from p4bench.studies.tune_axes import parse_grid_options  # noqa: F401 - importable from here too
from p4bench.studies.tune_federation import (
    DEFAULT_TUNE_ON,
    check_tune_on,
    tuning_config,
    tuning_note,
    tuning_tags,
)

__all__ = [
    "TuneSpec",
    "TuneResult",
    "PointScore",
    "load_tune",
    "parse_tune",
    "plan_tuning",
    "run_tuning",
    "write_tuned",
    "SELECTION_METRIC",
]

SELECTION_METRIC = "accuracy_evaluation_mean"
_KEYS = ("name", "base", "seeds", "grid", "methods", "tune_on")


@dataclass(frozen=True)
class TuneSpec:
    name: str
    base: Mapping[str, Any]
    grids: Mapping[str, Mapping[str, tuple[Any, ...]]]  # method -> option -> values
    seeds: tuple[int, ...] = (0,)
    # the file's `grid`, for other methods
    shared: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    tune_on: str = (
        DEFAULT_TUNE_ON  # evaluation-clients | federation (p4bench.studies.tune_federation)
    )


@dataclass
class PointScore:
    values: dict[str, Any]
    scores: list[float] = field(default_factory=list)  # one per seed that finished
    failed: int = 0
    # privacy marks of its runs (see p4bench.studies.equal_privacy)
    marks: list[str] = field(default_factory=list)

    @property
    def privacy(self) -> str:
        return " / ".join(dict.fromkeys(self.marks)) or "-"

    @property
    def mean(self) -> float:
        return statistics.fmean(self.scores) if self.scores else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.scores) if len(self.scores) > 1 else math.nan


@dataclass
class TuneResult:
    spec: TuneSpec
    points: dict[str, list[PointScore]]  # method -> points in grid order
    best: dict[str, dict[str, Any]]  # method -> chosen values
    report: SweepReport
    privacy: Any = None  # p4bench.studies.equal_privacy.PrivacyCheck of the tuning runs
    scope: str = ""  # how tuning was kept out of the reported clients' privacy (or not): one line


def load_tune(path: str | Path) -> TuneSpec:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"tuning file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"tuning file {path} is not valid YAML: {exc}") from None
    return parse_tune(data, source=str(path))


def parse_tune(data: Any, source: str = "tuning spec") -> TuneSpec:
    if not isinstance(data, Mapping):
        raise UsageError(f"{source} must hold a mapping with keys {', '.join(_KEYS)}")
    unknown = sorted(set(map(str, data)) - set(_KEYS))
    if unknown:
        raise UsageError(
            f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(_KEYS)}"
        )
    shared = _grid(data.get("grid"), f"{source}: grid")
    methods = data.get("methods")
    if isinstance(methods, str):
        methods = [methods]
    if isinstance(methods, list):
        methods = {m: None for m in methods}
    if not isinstance(methods, Mapping) or not methods:
        raise UsageError(f"{source}: 'methods' must list the methods to tune")
    grids = {
        str(m): {**shared, **_grid(own, f"{source}: methods.{m}")} for m, own in methods.items()
    }
    for method, grid in grids.items():
        if not grid:
            raise UsageError(f"{source}: method '{method}' has nothing to tune (give a grid)")
        if "seed" in grid or "method" in grid:
            raise UsageError(f"{source}: 'seed' and 'method' cannot be tuned")
    seeds = data.get("seeds", [0])
    seeds = [seeds] if isinstance(seeds, int) else seeds
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise UsageError(f"{source}: 'seeds' must be a list of integers")
    base = data.get("base") or {}
    if not isinstance(base, Mapping):
        raise UsageError(f"{source}: 'base' must be a mapping of run options")
    name = data.get("name") or f"tune-{base.get('dataset', RunConfig.dataset)}"
    tune_on = check_tune_on(data.get("tune_on", DEFAULT_TUNE_ON))
    return TuneSpec(str(name), dict(base), grids, tuple(seeds), shared, tune_on)


def _grid(value: Any, what: str) -> dict[str, tuple[Any, ...]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(f"{what} must map run options to lists of values")
    grid = {}
    for key, values in value.items():
        option_key(key)
        grid[str(key)] = tuple(values) if isinstance(values, (list, tuple)) else (values,)
        if not grid[str(key)]:
            raise UsageError(f"{what}: '{key}' has no values")
    return grid


def _value(config: RunConfig, key: str) -> Any:
    name = option_key(key)
    return (
        config.options.get(name[len("options.") :])
        if name.startswith("options.")
        else getattr(config, name)
    )


def plan_tuning(
    spec: TuneSpec, overrides: Mapping[str, Any] | None = None
) -> list[tuple[str, PlannedRun]]:
    """(method, run) for every grid point and seed, methods in the given order, each run on
    the federation `spec.tune_on` names (`tuning_run`)."""
    planned: list[tuple[str, PlannedRun]] = []
    for method, grid in spec.grids.items():
        sweep = SweepSpec(spec.name, {**spec.base, "method": method}, {**grid, "seed": spec.seeds})
        for run in expand(sweep, overrides):
            point = " ".join(f"{key}={_value(run.config, key)}" for key in grid)
            tags = {**run.tags, "tune_method": method, "tune_point": point}
            planned.append((method, tuning_run(PlannedRun(run.config, tags), spec.tune_on)))
    return planned


def tuning_run(run: PlannedRun, tune_on: str) -> PlannedRun:
    """The tuning run for a reported `run`: on its evaluation clients alone, or on its whole
    federation (`p4bench.studies.tune_federation.tuning_config`), tagged with the mode. Refuses
    (UsageError) a federation without evaluation clients."""
    config = run.config
    if int(round(config.eval_fraction * config.clients)) < 1:
        raise UsageError(
            f"tuning needs evaluation clients, but eval_fraction={config.eval_fraction} of "
            f"{config.clients} clients leaves none"
        )
    config = tuning_config(config, tune_on)
    return PlannedRun(config, {**run.tags, **tuning_tags(config, tune_on)})


def run_tuning(
    spec: TuneSpec,
    backend: Backend | None = None,
    *,
    results_dir: str | None = None,
    tracking_uri: str | None = None,
    progress: ProgressSink | None = None,
    track: bool = True,
    allow_mixed_privacy: bool = False,
) -> TuneResult:
    """Run every tuning run (resuming finished ones) and choose each method's best point."""
    from p4bench.studies.results import tracking_uri_for

    base_dir = str(
        Path(results_dir or spec.base.get("results_dir") or RunConfig.results_dir).resolve()
    )
    uri = tracking_uri_for(tracking_uri or spec.base.get("tracking_uri"), base_dir)
    planned = plan_tuning(spec, {"results_dir": base_dir, "tracking_uri": uri})
    return tune_planned(
        spec,
        planned,
        backend,
        results_dir=base_dir,
        tracking_uri=uri,
        progress=progress,
        track=track,
        allow_mixed_privacy=allow_mixed_privacy,
    )


def tune_planned(
    spec: TuneSpec,
    planned: Sequence[tuple[str, PlannedRun]],
    backend: Backend | None = None,
    *,
    results_dir: str,
    tracking_uri: str,
    progress: ProgressSink | None = None,
    track: bool = True,
    allow_mixed_privacy: bool = False,
) -> TuneResult:
    """Run given tuning runs, (key, run) with `spec.grids[key]` naming the tuned options of
    each key (a method, or any label of a group of runs tuned together), as tuning runs
    into the experiment `spec.name`; score every point on the evaluation clients and keep
    each key's best. Refuses (UsageError, naming the runs) candidates under unequal privacy
    unless `allow_mixed_privacy`."""
    from p4bench.studies.equal_privacy import check_privacy
    from p4bench.studies.sweep_privacy import record_privacy
    from p4bench.studies.tune_federation import check_tuning_federation

    check_tuning_federation(
        [run.config for _, run in planned]
    )  # too few evaluation clients: before any training
    sweep = SweepSpec(spec.name, spec.base)
    report = run_sweep(
        sweep,
        backend,
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        tuning=True,
        progress=progress,
        track=track,
        planned=[run for _, run in planned],
        allow_mixed_privacy=allow_mixed_privacy,
    )
    statuses = [record_privacy(run, record) for (_, run), record in zip(planned, report.records)]
    verdict = check_privacy(
        [s for s in statuses if s is not None],
        allow_mixed=allow_mixed_privacy,
        what=f"tuning '{spec.name}'",
    )
    points, best = score_points(spec, planned, report.records, statuses)
    scope = tuning_note(spec.tune_on, [run.config for _, run in planned], what=_tuned_what(spec))
    return TuneResult(spec, points, best, report, verdict, scope)


def score_points(
    spec: TuneSpec,
    planned: Sequence[tuple[str, PlannedRun]],
    records: Sequence[Any],
    statuses: Sequence[Any],
) -> tuple[dict[str, list[PointScore]], dict[str, dict[str, Any]]]:
    """Every key's points (its `spec.grids` options' values) with their scores and privacy
    marks, in plan order, and each key's best point."""
    points: dict[str, list[PointScore]] = {}
    index: dict[tuple[str, tuple[Any, ...]], PointScore] = {}
    for (method, run), record, status in zip(planned, records, statuses):
        grid = spec.grids[method]
        values = {key: _value(run.config, key) for key in grid}
        key = (method, tuple(repr(values[k]) for k in grid))
        if key not in index:
            index[key] = PointScore(values)
            points.setdefault(method, []).append(index[key])
        if status is not None:
            index[key].marks.append(status.mark)
        score = record.evaluation_accuracy
        if record.status in ("finished", "skipped") and score is not None and not math.isnan(score):
            index[key].scores.append(float(score))
        else:
            index[key].failed += 1
    best: dict[str, dict[str, Any]] = {}
    for method, scored in points.items():
        candidates = [p for p in scored if p.scores]
        if candidates:
            best[method] = dict(
                max(candidates, key=lambda p: p.mean).values
            )  # max keeps the first of ties
    return points, best


def _tuned_what(spec: TuneSpec) -> str:
    keys = sorted({key for grid in spec.grids.values() for key in grid})
    return ", ".join(keys) if keys else "values"


def write_tuned(result: TuneResult, path: str | Path) -> Path:
    """The tuned config: `tuned` (what sweeps include) and every point's score."""
    spec = result.spec
    document = {
        "tuned": result.best,
        "selection": {
            "metric": SELECTION_METRIC,
            "rule": "max over grid points of the mean over seeds of the benign evaluation clients' mean final "
            "test accuracy; reported clients' test splits were withheld from every tuning run",
            "tune_on": spec.tune_on,
            "federation": result.scope,
            "experiment": spec.name,
            "seeds": list(spec.seeds),
            "base": dict(spec.base),
            **(
                {"privacy": result.privacy.note()}
                if result.privacy is not None and result.privacy.runs
                else {}
            ),
        },
        "scores": {
            method: [
                {
                    **p.values,
                    "mean": _round(p.mean),
                    "std": _round(p.std),
                    "n": len(p.scores),
                    **({"failed": p.failed} if p.failed else {}),
                    **({"privacy": p.privacy} if p.marks else {}),
                }
                for p in scored
            ]
            for method, scored in result.points.items()
        },
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# written by `p4bench tune`; include it in a sweep file with `include: "
        + path.name
        + "`\n"
    )
    path.write_text(header + yaml.safe_dump(document, sort_keys=False))
    return path


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 6)
