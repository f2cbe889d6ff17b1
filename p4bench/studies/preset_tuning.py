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
