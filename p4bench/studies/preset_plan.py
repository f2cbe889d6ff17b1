"""The runs of a `p4bench reproduce` preset: its sweep at the chosen dataset and scale, the
runs left after `only`, the plugins nobody registered yet (skipped with a notice, or refused
with `strict`), and no defense where no attack runs (`PresetPlan`, `plan_preset`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p4bench.errors import UnknownNameError, UsageError
from p4bench.studies.presets import FULL, PRESETS, QUICK, Preset, data_settings
from p4bench.studies.sweep import PlannedRun, SweepSpec, expand, unknown_names
from p4bench.studies.tune_scope import matches

__all__ = ["PresetPlan", "plan_preset"]


def _dataset_choice(
    preset: Preset, requested: str | None, registry: Any, notices: list[str], check: bool
) -> str:
    from p4bench.data.paths import data_dir

    dataset = requested or preset.datasets[0]
    cls = registry.get("dataset", dataset)  # unknown names fail with the registered list
    root = data_dir()
    if check and not cls().is_present(root):
        notices.append(
            f"dataset '{dataset}' is not present in {root} (fetch it with `p4bench data download {dataset}`); "
            "falling back to digits"
        )
        return "digits"
    if requested and requested not in preset.datasets:
        notices.append(
            f"the paper ran '{preset.name}' on {', '.join(preset.datasets)}; running it on '{dataset}'"
        )
    return dataset


def plan_preset(
    name: str,
    dataset: str | None = None,
    quick: bool = False,
    *,
    strict: bool = False,
    registry: Any = None,
    overrides: Mapping[str, Any] | None = None,
    only: Mapping[str, Sequence[Any]] | None = None,
    check_data: bool = True,
) -> PresetPlan:
    """The runs of a preset: its sweep, the runs to do, notices, the dataset used and the
    plugins skipped because nobody registered them. `only` keeps the runs whose option
    takes one of the listed values (e.g. {"method": ["local", "p4"]})."""
    from p4bench.host.manager import default_registry

    if name not in PRESETS:
        raise UsageError(f"unknown preset '{name}'; presets: {', '.join(PRESETS)}")
    registry = registry or default_registry()
    preset = PRESETS[name]
    notices: list[str] = []
    chosen = _dataset_choice(preset, dataset, registry, notices, check_data)
    settings = data_settings(chosen, quick)
    scale = QUICK if quick else FULL
    base = {
        "dataset": chosen,
        "clients": settings["clients"],
        "samples_per_client": settings["samples_per_client"],
        "rounds": scale["rounds"],
        "neighbouring": preset.neighbouring,
        # a paper scored on a global test set: measure both, its metric the table's (`Preset.metric`)
        **({"eval_set": "both"} if preset.eval_set == "global" else {}),
        **preset.base,
    }
    if (
        preset.settings is not None
    ):  # the preset's own data settings and scale (karras: K = 40, Table II)
        base.update(preset.settings(chosen, quick))
    experiment = f"reproduce-{name}-{chosen}{'-quick' if quick else ''}"
    per_method = (
        preset.per_method_for(quick) if preset.per_method_for is not None else preset.per_method
    )
    spec = SweepSpec(
        experiment,
        base,
        {"seed": base.pop("seeds", scale["seeds"])},  # the preset's own (settings), if any
        tuple(preset.variants(chosen, quick)),
        per_method,
    )
    spec = spec.with_base(**dict(overrides or {}))
    runs, skipped = [], []
    planned = expand(spec)
    kept = [
        run
        for run in planned
        if all(matches(run.config, key, values) for key, values in (only or {}).items())
    ]
    if only:
        wanted = "; ".join(f"{k} in {{{', '.join(map(str, v))}}}" for k, v in only.items())
        notices.append(
            f"restricted to {wanted}: {len(planned) - len(kept)} of {len(planned)} runs left out"
        )
    for run in kept:
        missing = unknown_names(run.config, registry)
        if missing and strict:
            kind, missing_name = missing[0]
            raise UnknownNameError(kind, missing_name, registry.names(kind))
        for kind, missing_name in missing:
            label = f"{kind} '{missing_name}'"
            if label not in skipped:
                skipped.append(label)
        if not missing:
            runs.append(_undefended_without_attack(run))
    if skipped:
        notices.append(
            f"not registered yet, their runs are skipped: {', '.join(skipped)} (use --strict to fail instead)"
        )
    return PresetPlan(spec, runs, notices, chosen, skipped)


def _undefended_without_attack(run: PlannedRun) -> PlannedRun:
    """No attack, no defense: a method's default defense (P4's secure aggregation) would
    only discard honest updates."""
    if run.config.attack is None and run.config.defense is None:
        return PlannedRun(run.config.replace(defense="none"), run.tags)
    return run


@dataclass
class PresetPlan:
    spec: SweepSpec
    runs: list[PlannedRun]
    notices: list[str]
    dataset: str
    skipped: list[str]
