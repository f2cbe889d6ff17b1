"""`p4bench reproduce NAME`: presets that rebuild the P4 paper's experiments and check its claims.

Presets (paper settings from `shared/reference/p4.md` section 8 and the extended paper):

- heterogeneity: every method, alpha similarity 25/50/75% and shards N = 2/4/8, epsilon 15.
- privacy: epsilon 3..20, P4 (ScatterNet features) against non-private local training.
- ablation: P4 with grouping, ScatterNet or the proxy switched off, one at a time.
- defense: the four attacks at 30% malicious clients, against every defense.
- malicious: 10..50% malicious clients, P4 with its secure aggregation against the ideal defense.
- karras: Karras et al.'s P2P FL paper (`p4bench_p2p_fl.preset`): CBDS undersampling from the
  partitioner alone, FedDF vs FedAvg under random-label clients, P2P-FL personal averaging at
  alpha 0.01, Table III printed beside ours as reference values, a plot of accuracy vs N_K;
  every run non-private (the paper uses no DP). A preset may bring its own data settings and
  scale (`Preset.settings`), per-method values (`per_method_for`), lr grids and lines printed
  after the table (`Preset.report`).
- p4l: P4L (`p4bench_p4l.preset`) on digits: synergy size x IID/non-IID, Byzantine % x the
  paper's four attacks, Paillier vs plaintext on matched seeds; claims R10 (HE within 1 point)
  and R13 (Byzantine % the least influential factor), R1 from the participation curves.
- pdsl: PDSL (`p4bench_pdsl.preset`, `p4bench_pdsl.preset_report`) on digits at Dirichlet
  mu 0.25: Table I's epsilon x topology (complete/bipartite/ring) x M (10/20) grid, PDSL vs
  DP-CGA, Muffliato and DP-DPSGD at one certified epsilon per cell (the paper's per-round
  epsilon printed beside as reference only); claims: PDSL first in every cell, and for PDSL
  complete >= bipartite > ring; Table I beside ours (not comparable), a plot per cell.

Each preset is a sweep (one MLflow experiment `reproduce-<preset>-<dataset>[-quick]`, so it
resumes like any sweep), followed by a table aggregated over seeds and one line per claim
of the paper: yes, no or inconclusive (the paired difference over seeds with its 95% interval,
`p4bench.studies.intervals`), not checked or not tested (with the reason).

Plugins a preset names but nobody has registered yet (baselines or defenses still being
written, say `proxyfl` or `ideal`) are *skipped with a visible notice*, and the claims that
need them say "not checked"; `strict=True` (`--strict`) turns that into the standard
UnknownNameError instead. A dataset whose files are missing falls back to `digits` with a
notice (`p4bench data download NAME` fetches it). `quick` keeps the grid's shape but runs 3
rounds, one seed and shorter epsilon / fraction lists: a smoke run, not a reproduction.

Equal privacy and tuning (the paper's protocol):

- One neighbouring relation for every private run of a preset, named in its base
  (`Preset.neighbouring`, add-remove for all five presets: P4's own default is replace-one,
  and the same epsilon under another relation is another guarantee) and one target epsilon;
  the table is refused (exit 2, naming the runs) if any private run is uncertified or under
  another relation, unless `allow_mixed_privacy`. The output states which methods are private.
- The local step size `lr` of every method is tuned on the evaluation clients alone before
  the runs (`p4bench.studies.tune`, `p4bench.studies.tune_federation`: a federation of the tuning run's
  evaluation clients, disjoint from its reported clients; `tune_on="federation"`,
  `--tune-on federation`, tunes on the whole federation instead, reported clients'
  training records included, and says so): grid `TUNE_GRID` (`QUICK_TUNE_GRID` with
  `quick`) with the preset's rounds (fewer with `tune_rounds`). By default
  (`tune_scope="partition"`, `p4bench.studies.tune_scope`) lr is tuned apart for every partition
  among the runs (level x seed) and method (and feature set), on that partition's
  evaluation clients, and each run uses the lr of its own partition: no reported client's
  record enters the tuning of its run's lr. `tune_scope="preset"` tunes once per method at
  the preset's tuning setting (`Preset.tune_at`, e.g. alpha 50%) with the first seed and
  uses that lr at every level and seed (cheaper; the report says that other partitions'
  reported clients may hold the tuning records). Tuning runs go to the experiment
  `<experiment>-tune` and resume like any sweep. `tune=False` (`--no-tune`), or an
  explicit `lr` override, skips it. In full runs, lr's edges are then widened and the
  paper's other axes (`Preset.tune_axes`, e.g. P4's K, s, C, l) tuned one at a time within
  `tune_budget` runs per tuning group (`p4bench.studies.tune_axes`); options set with
  `--set` are never tuned.
- A run without an attack has no defense (P4's default secure aggregation would discard
  honest updates when nobody attacks): the heterogeneity, privacy and ablation comparisons
  and the defense preset's no-attack baseline run P4 with defense none.
- Local and centralized training are non-private (nothing leaves a client; the paper's local
  baseline is "the non-DP version of local training"; centralized is a pooled reference,
  not a rival in any claim), as in `bench/compare_digits.py`; the table's `privacy` column
  and the privacy line say so.
- With `quick` no claim that rests on training runs is a verdict: yes / no / inconclusive
  become "not tested (quick smoke run)"; a claim computed without training
  (`ClaimCheck.training` false, e.g. karras's CBDS undersampling) keeps its verdict.

Other choices the paper leaves open (visible in every run's parameters): all methods get the
same input features (ScatterNet, "HC") in the heterogeneity comparison. Shard-based runs use the
client count nearest to the dataset's M for which M*N/L is an integer, and R rounded down
to a multiple of N, as the shards partitioner needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from p4bench.errors import UsageError
from p4bench.studies.claims import ClaimCheck, ClaimContext, run_values, without_references
from p4bench.studies.equal_privacy import UnequalPrivacyError
from p4bench.studies.preset_plan import PresetPlan, plan_preset
from p4bench.studies.preset_tuning import (
    QUICK_TUNE_GRID,
    TUNE_GRID,
    apply_tuned_lr,
    plan_lr_tuning,
    tune_preset,
)
from p4bench.studies.presets import (  # the presets are part of this command's API (re-exported)
    DATASETS,
    PRESETS,
    Preset,
    shard_variant,
)
from p4bench.studies.sweep import PlannedRun, SweepReport, SweepSpec, option_key, run_sweep
from p4bench.studies.tune_scope import DEFAULT_TUNE_SCOPE

__all__ = [  # planning and lr tuning are re-exported: `p4bench.studies.preset_plan`, `.preset_tuning`
    "DATASETS",
    "PRESETS",
    "QUICK_TUNE_GRID",
    "TUNE_GRID",
    "Preset",
    "PresetPlan",
    "ClaimCheck",
    "ClaimContext",
    "ReproduceReport",
    "apply_tuned_lr",
    "plan_lr_tuning",
    "plan_preset",
    "quick_claims",
    "reproduce",
    "shard_variant",
]


# -- running and reporting ---------------------------------------------------------------


@dataclass
class ReproduceReport:
    preset: Preset
    dataset: str
    quick: bool
    experiment: str
    notices: list[str]
    sweep: SweepReport
    comparison: Any  # p4bench.studies.compare.Comparison, or None when nothing finished
    claims: list[ClaimCheck]
    tuning: Any = None  # p4bench.studies.tune.TuneResult, or None when lr was not tuned
    tuned_lr: dict[str, float] = field(
        default_factory=dict
    )  # tuning group (key, or "key @ partition") -> lr used
    privacy: list[str] = field(
        default_factory=list
    )  # lines stating who is private, under which relation
    extras: list[str] = field(
        default_factory=list
    )  # the preset's own lines (reference values, plots written)
    tuning_plan: Any = (
        None  # p4bench.studies.tune_scope.LrTuningPlan: which runs each tuning served
    )
    beside: Any = (
        None  # the same runs on the other accuracy (`Preset.beside_metric`), printed beside
    )
    # p4bench.studies.tune_stages.StagedTuning: what tuning beyond lr chose (None: lr only)
    staged: Any = None


def quick_claims(checks: Sequence[ClaimCheck]) -> list[ClaimCheck]:
    """A smoke run tests no claim: its yes / no / inconclusive become "not tested", figures
    kept."""
    return [
        replace(
            c,
            status="not tested",
            detail="quick smoke run" + (f"; figures: {c.detail}" if c.detail else ""),
        )
        if c.status in ("yes", "no", "inconclusive") and c.training
        else c
        for c in checks
    ]


def smoke_note(report: ReproduceReport) -> str | None:
    """For a quick report, the line printed above its claims saying that a smoke run tests
    none of them (None for a full run); every front end that shows the claims shows it."""
    if not report.quick:
        return None
    rounds = sorted({run.config.rounds for run in report.sweep.planned})
    scale = (
        (f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}") + " rounds"
        if rounds
        else "no runs"
    )
    seeds = len({run.config.seed for run in report.sweep.planned})
    return (
        f"smoke run (--quick: {scale}, {seeds} seed{'s' if seeds != 1 else ''}, shorter lists): not a test of the "
        'paper\'s claims. A claim that needs training says "not tested" and shows its figures only; run without '
        "--quick for verdicts."
    )


def claim_note(check: ClaimCheck, quick: bool) -> str:
    """What is said after a claim's status and figures: in a quick run, that a verdict
    computed without training stands even there ("" otherwise)."""
    if quick and not check.training and check.status in ("yes", "no"):
        return "no training needed: a verdict even in a smoke run"
    return ""


def reproduce(
    name: str,
    dataset: str | None = None,
    quick: bool = False,
    *,
    backend: Any = None,
    results_dir: str | None = None,
    tracking_uri: str | None = None,
    strict: bool = False,
    progress: Any = None,
    overrides: Mapping[str, Any] | None = None,
    only: Mapping[str, Sequence[Any]] | None = None,
    on_notice: Callable[[str], None] | None = None,
    tune: bool = True,
    tune_grid: Sequence[float] | None = None,
    tune_rounds: int | None = None,
    tune_progress: Any = None,
    allow_mixed_privacy: bool = False,
    tune_on: str = "evaluation-clients",
    tune_scope: str = DEFAULT_TUNE_SCOPE,
    tune_budget: int | None = None,
) -> ReproduceReport:
    """Tune lr per method on the evaluation clients (alone, or with `tune_on="federation"`
    in the whole federation), per partition (`tune_scope`, `p4bench.studies.tune_scope`), run a
    preset (resuming finished runs), aggregate it from MLflow at equal privacy and check
    the claims."""
    from pathlib import Path

    from p4bench.config import RunConfig
    from p4bench.host.manager import default_registry
    from p4bench.options import validate_planned
    from p4bench.studies.compare import compare_experiment
    from p4bench.studies.results import tracking_uri_for
    from p4bench.studies.sweep import describe_run
    from p4bench.studies.tune_federation import check_tune_on
    from p4bench.studies.tune_scope import check_tune_scope, tuning_lines

    check_tune_on(tune_on)
    check_tune_scope(tune_scope)
    plan = plan_preset(name, dataset, quick, strict=strict, overrides=overrides, only=only)
    spec, runs, notices, chosen, skipped = (
        plan.spec,
        plan.runs,
        plan.notices,
        plan.dataset,
        plan.skipped,
    )
    say = on_notice or (lambda text: None)
    for notice in notices:
        say(notice)
    base_dir = str(Path(results_dir or RunConfig.results_dir).resolve())
    uri = tracking_uri_for(tracking_uri, base_dir)
    located = [
        PlannedRun(r.config.replace(results_dir=base_dir, tracking_uri=uri), r.tags) for r in runs
    ]
    validate_planned(
        located, default_registry(), describe_run
    )  # bad plugin options: before tuning starts
    preset = PRESETS[name]
    tuning: Any = None
    tuning_plan: Any = None
    tuned_lr: dict[str, float] = {}
    staged: Any = None
    fixed = any(option_key(k) == "lr" for k in (overrides or {}))
    if tune and fixed:
        notices.append("lr is set explicitly (--set lr=...): not tuned")
        say(notices[-1])
    elif tune and located:
        tuning, tuning_plan, tuned_lr, staged, located = tune_preset(
            preset,
            spec,
            located,
            quick=quick,
            grid=tune_grid,
            budget=tune_budget,
            rounds=tune_rounds,
            tune_on=tune_on,
            scope=tune_scope,
            fixed=[option_key(k) for k in (overrides or {})],
            backend=backend,
            base_dir=base_dir,
            uri=uri,
            progress=tune_progress,
            allow_mixed=allow_mixed_privacy,
            say=say,
            notices=notices,
        )
    elif not tune:
        notices.append(
            f"lr not tuned (--no-tune): every method at lr={located[0].config.lr:g}"
            if located
            else "lr not tuned (--no-tune)"
        )
        say(notices[-1])
    report = run_sweep(
        spec,
        backend,
        results_dir=base_dir,
        tracking_uri=uri,
        progress=progress,
        planned=located,
        allow_mixed_privacy=allow_mixed_privacy,
    )
    context = ClaimContext(chosen, quick, tuple(skipped))
    hashes = [r.config_hash for r in located]
    comparison: Any = None
    beside: Any = None
    try:
        comparison = compare_experiment(
            uri,
            spec.name,
            list(preset.group_by),
            preset.metric,
            config_hashes=hashes,
            allow_mixed_privacy=allow_mixed_privacy,
        )
        beside = (
            compare_experiment(
                uri,
                spec.name,
                list(preset.group_by),
                preset.beside_metric,
                config_hashes=hashes,
                allow_mixed_privacy=allow_mixed_privacy,
            )
            if preset.eval_set == "global"
            else None
        )
    except UnequalPrivacyError:
        raise
    except UsageError as exc:
        notices.append(str(exc))
        comparison = beside = None
    if comparison is not None:  # the runs behind the table: claims pair them by seed
        context = replace(context, runs=run_values(comparison))
    checks = (
        preset.claims(without_references(comparison.table), context)  # no reference row
        if comparison is not None
        else [ClaimCheck("every claim of this preset", "not checked", "no run finished")]
    )
    if quick:
        checks = quick_claims(checks)
    privacy = _privacy_lines(preset, spec, comparison, located) + tuning_lines(tuning)
    extras = (
        preset.report(
            comparison.table if comparison is not None else None, context, Path(base_dir), spec.name
        )
        if preset.report is not None
        else []
    )
    return ReproduceReport(
        preset,
        chosen,
        quick,
        spec.name,
        notices + report.notices,
        report,
        comparison,
        checks,
        tuning,
        tuned_lr,
        privacy,
        extras,
        tuning_plan,
        beside,
        staged,
    )


def _privacy_lines(
    preset: Preset, spec: SweepSpec, comparison: Any, runs: Sequence[PlannedRun]
) -> list[str]:
    """Who is private, under which relation, epsilon and delta; which baselines are not."""
    from p4bench.studies.tune_federation import deltas_text

    lines = []
    verdict = getattr(comparison, "privacy", None)
    if verdict is not None:
        lines.append(verdict.note())
        if verdict.warning:
            lines.append("WARNING: " + verdict.warning)
    relation = spec.base.get("neighbouring")
    private = [r.config for r in runs if r.config.epsilon is not None]
    epsilons = sorted({c.epsilon for c in private if c.epsilon is not None})
    accountants = sorted({c.accountant for c in private})
    delta = deltas_text(verdict.runs) if verdict is not None else ""
    if relation and private:
        lines.append(
            f"one neighbouring relation for the preset: {relation}; target epsilon "
            f"{', '.join(f'{e:g}' for e in epsilons) if epsilons else '-'}"
            + (f", {delta}" if delta else "")
            + (f" (accountant {', '.join(accountants)})" if accountants else "")
        )
    if preset.baselines:
        lines.append(preset.baselines)
    return lines
