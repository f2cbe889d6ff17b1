"""Tuning a `p4bench reproduce` preset's local step size `lr` before its runs: the grids
(`TUNE_GRID`, `QUICK_TUNE_GRID`), the tuning runs per tuning group
(`p4bench.studies.tune_scope`), running them (`p4bench.studies.tune`) and giving each
reported run the lr chosen for its group."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from p4bench.studies.presets import Preset
from p4bench.studies.sweep import PlannedRun, SweepSpec
from p4bench.studies.tune_scope import DEFAULT_TUNE_SCOPE, plan_lr_groups, tuning_keys

__all__ = ["QUICK_TUNE_GRID", "TUNE_GRID", "apply_tuned_lr", "plan_lr_tuning", "tune_preset_lr"]

TUNE_GRID = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # lr candidates, on the evaluation clients
QUICK_TUNE_GRID = (0.1, 1.0)


def plan_lr_tuning(
    preset: Preset,
    runs: Sequence[PlannedRun],
    experiment: str,
    grid: Sequence[float],
    rounds: int | None = None,
    tune_on: str = "evaluation-clients",
    scope: str = DEFAULT_TUNE_SCOPE,
) -> list[tuple[str, PlannedRun]]:
    """(group, tuning run) for every lr of `grid` and every tuning group (`scope`,
    `p4bench.studies.tune_scope.plan_lr_groups`) of the runs, at the preset's `tune_at`."""
    return plan_lr_groups(preset.tune_at, runs, experiment, grid, rounds, tune_on, scope).planned


def apply_tuned_lr(runs: Sequence[PlannedRun], lrs: Mapping[str, float]) -> list[PlannedRun]:
    """The runs with each tuning key's lr (keys without one keep theirs)."""
    return [
        PlannedRun(run.config.replace(lr=float(lrs[key])), run.tags) if key in lrs else run
        for key, run in zip(tuning_keys(runs), runs)
    ]


def tune_preset_lr(
    preset: Preset,
    spec: SweepSpec,
    plan: Any,
    grid: Sequence[float],
    backend: Any,
    base_dir: str,
    uri: str,
    rounds: int | None,
    progress: Any,
    allow_mixed: bool,
    say: Callable[[str], None],
    notices: list[str],
) -> tuple[Any, dict[str, float]]:
    """Run the tuning runs of `plan` (a `p4bench.studies.tune_scope.LrTuningPlan`, p4bench.studies.tune);
    (TuneResult, tuning group -> chosen lr)."""
    from p4bench.studies.tune import TuneSpec, tune_planned
    from p4bench.studies.tune_scope import PARTITION, partition_shape, scope_note

    experiment = f"{spec.name}-tune"
    keys = list(dict.fromkeys(group.key for group in plan.groups))
    scale = f"{rounds} rounds" if rounds else "the runs' rounds"
    alone = plan.tune_on == "evaluation-clients"
    if plan.scope == PARTITION:
        where = (
            f"each partition's {'evaluation clients alone' if alone else 'whole federation'} "
            f"({partition_shape(plan)}"
        )
    else:
        at = (
            ", ".join(f"{k}={v}" for k, v in preset.tune_at.items())
            or "each method's first setting"
        )
        where = (
            f"the {'evaluation clients alone' if alone else 'whole federation'} "
            f"({at}, seed {plan.groups[0].run.config.seed}"
        )
    notices.append(
        f"tuning lr over {', '.join(f'{v:g}' for v in grid)} for {', '.join(keys)} on {where}, {scale}; "
        f"{len(plan.planned)} tuning runs, experiment '{experiment}')"
    )
    say(notices[-1])
    seeds_used = tuple(sorted({group.run.config.seed for group in plan.groups}))
    tune_spec = TuneSpec(
        experiment,
        dict(spec.base),
        {group.name: {"lr": tuple(grid)} for group in plan.groups},
        seeds_used,
        tune_on=plan.tune_on,
    )
    result = tune_planned(
        tune_spec,
        plan.planned,
        backend,
        results_dir=base_dir,
        tracking_uri=uri,
        progress=progress,
        allow_mixed_privacy=allow_mixed,
    )
    if plan.scope == PARTITION:
        result.scope = scope_note(plan) or result.scope
    elif alone:
        result.scope += (
            f"; --tune-scope {PARTITION} tunes every partition on its own evaluation clients"
        )
    lrs = {name: float(values["lr"]) for name, values in result.best.items()}
    for group in plan.groups:
        if group.name not in lrs:
            notices.append(
                f"no tuning run of {group.name} finished: its runs keep lr={group.run.config.lr:g}"
            )
            say(notices[-1])
    return result, lrs


def tune_preset_axes(
    preset: Preset,
    plan: Any,
    lr_result: Any,
    lrs: Mapping[str, float],
    budget: int,
    run_stage_sweep: Callable[[Any, list[tuple[str, PlannedRun]], str], Any],
    fixed: Sequence[str] = (),
) -> tuple[Any, Any]:
    """After lr: widen its edges and tune the preset's other axes
    (`p4bench.studies.tune_axes`) within `budget` runs per tuning group.
    `run_stage_sweep(spec, planned, label)` runs one stage's tuning runs and returns its
    `TuneResult`. Returns the merged TuneResult of every stage and the `StagedTuning`."""
    from p4bench.studies.equal_privacy import check_privacy
    from p4bench.studies.sweep_privacy import record_privacy
    from p4bench.studies.tune import TuneSpec, score_points, tuning_run
    from p4bench.studies.tune_axes import config_value, tuning_config_at
    from p4bench.studies.tune_stages import merged_report, tune_axes_staged

    groups = {group.name: group for group in plan.groups}
    experiment, seeds, base = lr_result.spec.name, lr_result.spec.seeds, lr_result.spec.base
    rounds = plan.planned[0][1].config.rounds if plan.planned else None
    named: list[tuple[str, PlannedRun]] = list(plan.planned)
    reports = [lr_result.report]
    lr_scores = {
        name: {float(p.values["lr"]): p.mean for p in points}
        for name, points in lr_result.points.items()
    }

    def run_stage(
        points: Mapping[str, list[dict[str, Any]]], label: str
    ) -> dict[str, list[tuple[dict[str, Any], float]]]:
        planned = []
        for name, tried in points.items():
            group = groups[name]
            for values in tried:
                config = tuning_config_at(group.run, values, experiment, rounds)
                tags = {
                    "sweep": experiment,
                    "tune_method": group.key,
                    "tune_point": " ".join(f"{k}={_text(v)}" for k, v in values.items()),
                    **({"tune_partition": group.partition} if group.partition else {}),
                    **(
                        {"variant": group.run.tags["variant"]}
                        if "variant" in group.run.tags
                        else {}
                    ),
                }
                planned.append((name, tuning_run(PlannedRun(config, tags), plan.tune_on)))
        grids = {name: {k: () for k in tried[0]} for name, tried in points.items() if tried}
        result = run_stage_sweep(
            TuneSpec(experiment, base, grids, seeds, tune_on=plan.tune_on), planned, label
        )
        named.extend(planned)
        reports.append(result.report)
        return {
            name: [(dict(p.values), p.mean) for p in scored]
            for name, scored in result.points.items()
        }

    staged = tune_axes_staged(
        plan.groups, lr_scores, lrs, preset.tune_axes, _tuning_options(), budget, run_stage, fixed
    )
    grids: dict[str, dict[str, tuple[Any, ...]]] = {}
    for name, run in named:
        for key in staged.chosen.get(name, {"lr": None}):
            values = grids.setdefault(name, {}).setdefault(key, ())
            value = config_value(run.config, key)
            if value not in values:
                grids[name][key] = (*values, value)
    spec = TuneSpec(experiment, base, grids, seeds, tune_on=plan.tune_on)
    report = merged_report(experiment, lr_result.report.tracking_uri, reports)
    statuses = [record_privacy(run, record) for (_, run), record in zip(named, report.records)]
    privacy = check_privacy(
        [s for s in statuses if s is not None], allow_mixed=True, what=f"tuning '{experiment}'"
    )
    points, _ = score_points(spec, named, report.records, statuses)
    merged = type(lr_result)(spec, points, dict(staged.chosen), report, privacy, lr_result.scope)
    return merged, staged


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _tuning_options() -> Callable[[str], Sequence[str] | None]:
    """method name -> the run options its training reads (`Method.tuning_options`)."""
    from p4bench.host.manager import default_registry

    registry = default_registry()

    def options(method: str) -> Sequence[str] | None:
        try:
            return getattr(registry.get("method", method), "tuning_options", None)
        except Exception:  # noqa: BLE001 - an unknown method: every axis
            return None

    return options


def apply_tuned_values(plan: Any, values: Mapping[str, Mapping[str, Any]]) -> list[PlannedRun]:
    """The reported runs of `plan`, each with its tuning group's chosen values."""
    from p4bench.studies.tune_axes import with_values

    return [
        PlannedRun(with_values(run.config, values[name]), run.tags) if name in values else run
        for name, run in zip(plan.assignment, plan.runs)
    ]


def tune_preset(
    preset: Preset,
    spec: SweepSpec,
    located: list[PlannedRun],
    *,
    quick: bool,
    grid: Sequence[float] | None,
    budget: int | None,
    rounds: int | None,
    tune_on: str,
    scope: str,
    fixed: Sequence[str],
    backend: Any,
    base_dir: str,
    uri: str,
    progress: Any,
    allow_mixed: bool,
    say: Callable[[str], None],
    notices: list[str],
) -> tuple[Any, Any, dict[str, float], Any, list[PlannedRun]]:
    """reproduce's tuning: lr over its grid, then (full runs, `budget` > lr's grid) the
    preset's other axes. (merged TuneResult, LrTuningPlan, group -> lr, StagedTuning or
    None, the reported runs with their tuned values)."""
    from p4bench.errors import UsageError
    from p4bench.studies.tune import tune_planned

    lr_grid = tuple(
        grid
        or (preset.quick_tune_grid or QUICK_TUNE_GRID if quick else preset.tune_grid or TUNE_GRID)
    )
    budget = budget if budget is not None else (len(lr_grid) if quick else preset.tune_budget)
    if budget < len(lr_grid):
        raise UsageError(f"--tune-budget {budget} is below lr's grid of {len(lr_grid)} runs")
    plan = plan_lr_groups(
        preset.tune_at, located, f"{spec.name}-tune", lr_grid, rounds, tune_on, scope
    )
    lr_args = (backend, base_dir, uri, rounds, progress, allow_mixed, say, notices)
    tuning, lrs = tune_preset_lr(preset, spec, plan, lr_grid, *lr_args)
    if not preset.tune_axes or budget <= len(lr_grid):
        if preset.tune_axes:
            notices.append(
                f"only lr tuned (budget {budget} runs per group); the paper also tunes "
                + ", ".join(preset.tune_axes)
            )
            say(notices[-1])
        return tuning, plan, lrs, None, plan.apply(lrs)

    def run_stage_sweep(stage: Any, planned: list[tuple[str, PlannedRun]], label: str) -> Any:
        say(f"tuning {label}: {len(planned)} run{'s' if len(planned) != 1 else ''}")
        return tune_planned(
            stage,
            planned,
            backend,
            results_dir=base_dir,
            tracking_uri=uri,
            progress=progress,
            allow_mixed_privacy=allow_mixed,
        )

    tuning, staged = tune_preset_axes(preset, plan, tuning, lrs, budget, run_stage_sweep, fixed)
    notices.append(
        f"tuned beyond lr by coordinate search ({', '.join(preset.tune_axes)}, in that order, "
        f"not their product grid), at most {budget} runs per tuning group"
    )
    say(notices[-1])
    for outcome in staged.edges():
        notices.append(f"on the grid's edge: {outcome.line()}")
        say(notices[-1])
    lrs = {name: float(values["lr"]) for name, values in staged.chosen.items()}
    return tuning, plan, lrs, staged, apply_tuned_values(plan, staged.chosen)
