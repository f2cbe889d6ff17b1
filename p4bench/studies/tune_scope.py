"""Which reported runs one lr tuning serves in `p4bench reproduce` (`tune_scope`, `--tune-scope`).

A tuning run trains on the evaluation clients alone of a reported run's federation (same
seed, so the same partition; `p4bench.studies.tune_federation`). Whether that keeps the tuned lr out
of *every* reported run's privacy depends on which runs the lr is then used for:

- `partition` (the default): lr is tuned apart for every distinct *partition* among the
  reported runs, on that partition's evaluation clients alone, and every reported run gets
  the lr tuned on its own partition. Runs share a partition when everything that decides
  which client holds which record is equal (`partition_key`: dataset, partitioner and its
  level, clients, samples per client, eval_fraction, features, seed, the options a dataset,
  partitioner or public-data split reads, and whether the method holds public records out).
  Within a partition the run tuned at is the one at the preset's `tune_at` setting (e.g.
  epsilon 15), else its first. No reported client's record, in any reported run, enters
  the tuning runs that chose that run's lr. Cost: one tuning per partition and method, so
  the tuning runs are multiplied by the number of partitions (levels x seeds).
- `preset`: one tuning per method at the preset's `tune_at` setting with the first seed, its
  lr used at every level and seed (the older protocol, cheaper). Runs at other settings or
  seeds partition the data anew, so there the tuning clients' records may belong to
  reported clients: the report says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p4bench.errors import UsageError
from p4bench.studies.sweep import PlannedRun, option_key

__all__ = [
    "TUNE_SCOPES",
    "DEFAULT_TUNE_SCOPE",
    "check_tune_scope",
    "matches",
    "tuning_key",
    "tuning_keys",
    "partition_key",
    "evaluation_clients_line",
    "tuning_lines",
    "TuningGroup",
    "LrTuningPlan",
    "plan_lr_groups",
    "partition_shape",
    "scope_note",
    "lr_summary",
    "lr_table",
]

PARTITION = "partition"
PRESET = "preset"
TUNE_SCOPES = (PARTITION, PRESET)
DEFAULT_TUNE_SCOPE = PARTITION
# RunConfig fields that decide which client holds which record (`p4bench.run.runner.prepare`:
# load_dataset, public_data, run_partitioner, build_federated_data); options apart
_PARTITION_FIELDS = (
    "dataset",
    "partitioner",
    "similarity",
    "clients",
    "samples_per_client",
    "eval_fraction",
    "features",
    "seed",
    "federation_clients",
)


def check_tune_scope(value: Any) -> str:
    """`value` if it names a tuning scope, else UsageError."""
    if value not in TUNE_SCOPES:
        raise UsageError(f"tune scope must be one of {', '.join(TUNE_SCOPES)}, got {value!r}")
    return str(value)


def matches(config: Any, key: str, values: Sequence[Any]) -> bool:
    """Whether the config's option `key` equals one of `values` (numbers compared as numbers,
    `none` matching an unset option)."""
    name = option_key(key)
    value = (
        config.options.get(name[len("options.") :])
        if name.startswith("options.")
        else getattr(config, name)
    )
    for wanted in values:
        if value is None and str(wanted).lower() in ("none", "null"):
            return True
        try:
            if float(value) == float(wanted):
                return True
        except (TypeError, ValueError):
            if str(value) == str(wanted):
                return True
    return False


def tuning_key(config: Any, features_vary: bool) -> str:
    """The label lr is tuned under: the method, with its features where they vary."""
    return f"{config.method} ({config.features})" if features_vary else config.method


def tuning_keys(runs: Sequence[PlannedRun]) -> list[str]:
    """Every run's tuning key (`tuning_key`), in order."""
    features: dict[str, set[str]] = {}
    for run in runs:
        features.setdefault(run.config.method, set()).add(run.config.features)
    return [tuning_key(r.config, len(features[r.config.method]) > 1) for r in runs]


def _at(run: PlannedRun, where: Mapping[str, Any]) -> bool:
    return all(
        run.tags.get("variant") == value if key == "variant" else matches(run.config, key, [value])
        for key, value in where.items()
    )


def partition_key(config: Any, registry: Any = None) -> str:
    """What decides a run's partition, as a string: runs with the same key hold the same
    records at the same clients (same evaluation clients too). Conservative: options are
    kept unless only a non-data plugin (method, attack, defense, model, runtime, accountant)
    declares them; an unknown plugin keeps them all."""
    from p4bench.data.public import PUBLIC_DATA_OPTIONS
    from p4bench.host.manager import default_registry
    from p4bench.options import declared_options, run_plugins

    registry = registry or default_registry()
    options = dict(config.options)
    public = None
    try:
        used = run_plugins(config, registry)
        method = registry.get("method", config.method)
        public = [
            bool(getattr(method, "needs_public_data", False)),
            bool(getattr(method, "needs_public_labels", False)),
        ]
        data_side = {o.name for o in PUBLIC_DATA_OPTIONS}
        others: set[str] = set()
        for kind, _, cls in used:
            (data_side if kind in ("dataset", "partitioner") else others).update(
                o.name for o in declared_options(cls)
            )
        options = {k: v for k, v in options.items() if k in data_side or k not in others}
    except Exception:  # noqa: BLE001 - an unknown plugin: keep every option and the method itself
        public = [config.method]
    data = {name: getattr(config, name) for name in _PARTITION_FIELDS}
    return json.dumps({**data, "options": options, "public": public}, sort_keys=True, default=str)


@dataclass(frozen=True)
class TuningGroup:
    """The reported runs one tuning serves: its `name` (the tuning key in `preset` scope,
    "key @ partition" in `partition` scope), the tuning key, the partition's label ("" in
    `preset` scope) and key, and the reported run tuned at."""

    name: str
    key: str
    partition: str
    partition_key: str
    run: PlannedRun


@dataclass
class LrTuningPlan:
    scope: str
    tune_on: str
    groups: list[TuningGroup]
    planned: list[
        tuple[str, PlannedRun]
    ]  # (group name, tuning run), every lr of the grid per group
    assignment: list[str]  # the group of every reported run, in the order given
    runs: list[PlannedRun] = field(default_factory=list)  # the reported runs

    def apply(self, lrs: Mapping[str, float]) -> list[PlannedRun]:
        """The reported runs, each with its group's lr (groups without one keep theirs)."""
        return [
            PlannedRun(run.config.replace(lr=float(lrs[name])), run.tags) if name in lrs else run
            for name, run in zip(self.assignment, self.runs)
        ]

    def partitions(self) -> tuple[int, int, int]:
        """(partitions, settings, seeds) among the groups (partitions counted once whatever
        the method)."""
        keys = {json.dumps({**json.loads(g.partition_key), "public": None}) for g in self.groups}
        settings = {json.dumps({**json.loads(k), "seed": None}) for k in keys}
        seeds = {json.loads(k)["seed"] for k in keys}
        return len(keys), len(settings), len(seeds)


def _label(runs: Sequence[PlannedRun]) -> str:
    variants = list(dict.fromkeys(r.tags["variant"] for r in runs if "variant" in r.tags))
    seed = runs[0].config.seed
    return f"{' / '.join(variants)}, seed {seed}" if variants else f"seed {seed}"


def plan_lr_groups(
    tune_at: Mapping[str, Any],
    runs: Sequence[PlannedRun],
    experiment: str,
    grid: Sequence[float],
    rounds: int | None = None,
    tune_on: str = "evaluation-clients",
    scope: str = DEFAULT_TUNE_SCOPE,
    registry: Any = None,
) -> LrTuningPlan:
    """Group the reported `runs` (`scope`), choose each group's run to tune at (the first
    that matches `tune_at`, else its first) and plan its tuning runs: every lr of `grid`,
    `rounds` if given, into `experiment`, on the federation `tune_on` names
    (`p4bench.studies.tune.tuning_run`). In `preset` scope every run of a key is in one group,
    tuned with the runs' first seed."""
    from p4bench.studies.tune import tuning_run

    check_tune_scope(scope)
    keys = tuning_keys(runs)
    parts = [partition_key(run.config, registry) if scope == PARTITION else "" for run in runs]
    members: dict[tuple[str, str], list[PlannedRun]] = {}
    for key, part, run in zip(keys, parts, runs):
        members.setdefault((key, part), []).append(run)
    seed = min(r.config.seed for r in runs) if runs else 0
    groups: dict[tuple[str, str], TuningGroup] = {}
    names: set[str] = set()
    for (key, part), grouped in members.items():
        chosen = next((r for r in grouped if _at(r, tune_at)), grouped[0])
        label = base = _label(grouped) if scope == PARTITION else ""
        suffix = 2
        while (
            f"{key} @ {label}" if label else key
        ) in names:  # two partitions that look alike: told apart
            label, suffix = f"{base} (#{suffix})", suffix + 1
        name = f"{key} @ {label}" if label else key
        names.add(name)
        if scope == PRESET:
            chosen = PlannedRun(chosen.config.replace(seed=seed), chosen.tags)
        groups[(key, part)] = TuningGroup(
            name, key, label, part or partition_key(chosen.config, registry), chosen
        )
    planned = []
    for group in groups.values():
        for lr in grid:
            config = group.run.config.replace(
                lr=float(lr), experiment=experiment, **({"rounds": rounds} if rounds else {})
            )
            tags = {
                "sweep": experiment,
                "tune_method": group.key,
                "tune_point": f"lr={float(lr):g}",
                **({"tune_partition": group.partition} if group.partition else {}),
                **({"variant": group.run.tags["variant"]} if "variant" in group.run.tags else {}),
            }
            planned.append((group.name, tuning_run(PlannedRun(config, tags), tune_on)))
    assignment = [groups[(key, part)].name for key, part in zip(keys, parts)]
    return LrTuningPlan(scope, tune_on, list(groups.values()), planned, assignment, list(runs))


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def partition_shape(plan: LrTuningPlan) -> str:
    """How many partitions the groups tune, e.g. "6 partitions: 3 settings x 2 seeds"."""
    count, settings, seeds = plan.partitions()
    shape = (
        f": {_plural(settings, 'setting')} x {_plural(seeds, 'seed')}"
        if settings * seeds == count
        else ""
    )
    return _plural(count, "partition") + shape


def scope_note(plan: LrTuningPlan, what: str = "lr") -> str | None:
    """The line saying which reported runs each tuning served and what that means for their
    privacy, in `partition` scope on the evaluation clients (None otherwise: the
    `p4bench.studies.tune_federation.tuning_note` line says it)."""
    from p4bench.studies.tune_federation import EVALUATION_CLIENTS

    if plan.scope != PARTITION or plan.tune_on != EVALUATION_CLIENTS:
        return None
    sizes = sorted(
        {
            (c.clients, (c.federation_clients or c.clients) - c.clients)
            for c in (run.config for _, run in plan.planned)
        }
    )
    if len(sizes) == 1:
        whom = (
            f"each partition's {sizes[0][0]} evaluation clients alone, "
            f"disjoint from its {sizes[0][1]} reported clients"
        )
    else:
        whom = (
            "each partition's evaluation clients alone, disjoint from its reported clients ("
            + ", ".join(f"{k} evaluation and {m} reported" for k, m in sizes)
            + ")"
        )
    return (
        f"{what} tuned per partition ({partition_shape(plan)}) on {whom}: no reported "
        f"client's record enters the tuning of its run's {what} (--tune-scope {PARTITION})"
    )


def lr_summary(plan: LrTuningPlan, lrs: Mapping[str, float]) -> str:
    """Per tuning key the lrs its groups chose, e.g. "p4 0.1 (4 partitions), 1 (2); local 1"."""
    chosen: dict[str, dict[float, int]] = {}
    for group in plan.groups:
        if group.name in lrs:
            counts = chosen.setdefault(group.key, {})
            counts[lrs[group.name]] = counts.get(lrs[group.name], 0) + 1
    if plan.scope != PARTITION:
        return ", ".join(
            f"{key} {' / '.join(f'{lr:g}' for lr in counts)}" for key, counts in chosen.items()
        )
    parts = []
    for key, counts in chosen.items():
        values = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        parts.append(
            f"{key} "
            + ", ".join(
                f"{lr:g} ({n} partition{'s' if n != 1 else ''})" if i == 0 else f"{lr:g} ({n})"
                for i, (lr, n) in enumerate(values)
            )
        )
    return "; ".join(parts)


def lr_table(
    plan: LrTuningPlan, lrs: Mapping[str, float]
) -> tuple[list[str], list[list[str]]] | None:
    """(header, rows): the lr every partition's runs used, a row per partition, a column per
    tuning key ("-": not tuned there); None where every key chose one lr everywhere."""
    by_key: dict[str, set[float]] = {}
    for group in plan.groups:
        if group.name in lrs:
            by_key.setdefault(group.key, set()).add(lrs[group.name])
    if plan.scope != PARTITION or all(len(v) <= 1 for v in by_key.values()):
        return None
    keys = list(dict.fromkeys(g.key for g in plan.groups))
    cells: dict[str, dict[str, str]] = {}
    for group in plan.groups:
        cells.setdefault(group.partition, {})[group.key] = (
            f"{lrs[group.name]:g}" if group.name in lrs else "-"
        )
    return ["partition", *keys], [
        [label, *(row.get(key, "") for key in keys)] for label, row in cells.items()
    ]


def evaluation_clients_line(result: Any) -> str | None:
    """What tuning on the evaluation clients alone spent of *their* privacy: in how many
    tuning runs each partition's evaluation clients trained, and the largest epsilon they
    spent in one of them (a tuning run's epsilon is theirs: they are its only clients).
    Each figure is one run's, not composed over the runs; the reported runs on the same
    partition train them once more (their summary's `epsilon_evaluation_clients`). None
    where tuning used the whole federation, or no tuning run is private."""
    from p4bench.studies.tune_federation import DEFAULT_TUNE_ON, EVALUATION_CLIENTS

    if result is None or getattr(result.spec, "tune_on", DEFAULT_TUNE_ON) != EVALUATION_CLIENTS:
        return None
    done = [
        (planned, record)
        for planned, record in zip(result.report.planned, result.report.records)
        if record.status in ("finished", "skipped")
    ]
    if not any(record.summary.get("private") for _, record in done):
        return None
    counts: dict[str, int] = {}
    for planned, _ in done:
        key = partition_key(planned.config)
        counts[key] = counts.get(key, 0) + 1
    spent = [
        next(
            (
                v
                for v in (
                    record.summary.get("epsilon_evaluation_clients"),
                    record.summary.get("epsilon"),
                )
                if v is not None
            ),
            None,
        )
        for _, record in done
        if record.summary.get("private")
    ]
    numbers = [float(v) for v in spent if isinstance(v, (int, float)) and v == v]
    fewest, most = min(counts.values()), max(counts.values())
    runs = f"{most}" if fewest == most else f"{fewest} to {most}"
    partitions = f"{len(counts)} partition{'s' if len(counts) != 1 else ''}"
    epsilon = (
        f"; epsilon up to {max(numbers):.3g} in one tuning run"
        if numbers
        else "; their epsilon in the tuning runs is not known here"
    )
    return (
        f"evaluation clients' own privacy: each partition's evaluation clients trained in {runs} tuning "
        f"run{'s' if most != 1 else ''} ({partitions}){epsilon} (one run's figure, not composed over the runs), "
        "and again in every reported run on their partition (its epsilon_evaluation_clients)"
    )


def tuning_lines(result: Any) -> list[str]:
    """For a report: how tuning was kept out of the reported clients' privacy (or not),
    the tuning runs' own privacy and what tuning spent of the evaluation clients'; `result`
    a `p4bench.studies.tune.TuneResult`, or None (no tuning)."""
    if result is None:
        return []
    from p4bench.studies.tune_federation import tuning_privacy_line

    own = tuning_privacy_line(result.privacy)
    return [line for line in (result.scope, own, evaluation_clients_line(result)) if line]
