"""Cross-baseline comparison from MLflow: aggregate runs over seeds, print, plot.

Runs are read from one experiment (FINISHED only), deduplicated by config hash (the latest
run of a config wins, so a config run twice counts once), grouped by the chosen keys and
aggregated over what is left, normally seeds: mean, sample standard deviation and n.
Keys are tags (method, attack, defense, dataset, variant, ...) or run options
(`similarity`, `epsilon`, `options.group_size`, ...).

Equal privacy (`p4bench.studies.equal_privacy`): private runs under different neighbouring relations,
or with an uncertified epsilon, are refused (UsageError naming them) unless
`allow_mixed_privacy`; whenever the runs do not all carry the same privacy mark (e.g. private
methods next to non-private local training) a `privacy` group column marks each row.

One privacy setting per row: a row never pools runs at different privacy settings. Besides
the `privacy` mark (private or not, the relation, certification), each run's `epsilon` (its
target, else the epsilon its ledger reported; `none` for a non-private run), `delta` and
`accountant` are read (`privacy_settings`); where the runs of one group differ in one of
them, it becomes a group key of its own (`Comparison.split_by` names those added, and the
CLI says so). So `--group-by method` over fedavg at epsilon 1 and 8 gives one row per
epsilon, never their mean. A group key `epsilon`, `delta` or `accountant` names these
columns too (a non-private run's epsilon is `none`, not a blank). Nor does a row pool two
attacks or defenses (`THREATS`): `--group-by method,attack` over runs with several defenses
keeps `defense` as a key, and says so. Nor does a row pool a declared reference row (tag
`reference`: a paper's uncertified variant, a non-private ceiling; `sweep_plan.REFERENCE`)
with compared runs: where any run has one, `reference` is a group key (`-` for the others).

Uncertainty: each row's 95% t interval of its mean (`p4bench.studies.intervals`; none
where n = 1) is printed beside it; the plots (`p4bench.studies.compare_plot`) draw it as
bands and error bars, and no error bar for a group of one run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p4bench.errors import UsageError
from p4bench.moved import forward_moved
from p4bench.studies.equal_privacy import COLUMN as PRIVACY_COLUMN
from p4bench.studies.equal_privacy import PrivacyCheck

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Comparison",
    "compare_experiment",
    "aggregate",
    "default_group_by",
    "format_table",
    "interval_cell",
    "DEFAULT_METRIC",
    "SETTINGS",
    "privacy_settings",
    "keep_settings_apart",
    "split_note",
]

DEFAULT_METRIC = (
    "final_accuracy_mean"  # mean test accuracy of the reported clients after the last round
)
CURVE_METRIC = "accuracy_mean"  # the same, per round
_TAG_KEYS = ("method", "attack", "defense", "dataset", "variant", "reference")
REFERENCE = "reference"  # the tag of a declared reference row (`sweep_plan.REFERENCE`)
_NOT_GROUPS = {"seed", "experiment", "tracking_uri", "results_dir"}
SETTINGS = (
    "epsilon",
    "delta",
    "accountant",
)  # privacy settings a row never pools (besides the `privacy` mark)
THREATS = ("attack", "defense")  # nor two attacks or defenses (tags): `--group-by method,attack`
NONE = "none"  # a non-private run's epsilon (never a number: 0 would read as perfect privacy)


@dataclass
class Comparison:
    experiment: str
    tracking_uri: str
    runs: Any  # pandas DataFrame, one row per (deduplicated) run
    table: Any  # pandas DataFrame: group keys, mean, std, n
    group_by: list[str]
    metric: str
    privacy: Any = None  # p4bench.studies.equal_privacy.PrivacyCheck of the compared runs
    split_by: list[str] = field(
        default_factory=list
    )  # privacy settings added to group_by: they vary in a group


def dedupe(runs: pd.DataFrame) -> pd.DataFrame:
    """The latest finished run of every config hash."""
    if runs.empty or "config_hash" not in runs:
        return runs
    return (
        runs.sort_values("start_time", kind="stable")
        .drop_duplicates("config_hash", keep="last")
        .reset_index(drop=True)
    )


def column_for(runs: pd.DataFrame, key: str) -> str:
    """The DataFrame column holding `key` (a tag, a run option, or options.<name>)."""
    key = key.strip()
    candidates = (
        [key]
        if key in _TAG_KEYS or key in ("seed", "sweep", "network_dp", PRIVACY_COLUMN, *SETTINGS)
        else []
    )
    name = key.replace("-", "_")
    candidates += [f"params.{name}", f"params.{key}"]
    for column in candidates:
        if column in runs:
            return str(column)
    params = (c[len("params.") :] for c in runs if c.startswith("params."))
    available = sorted({*(k for k in _TAG_KEYS if k in runs), *params})
    raise UsageError(
        f"unknown group key '{key}'; keys present in these runs: {', '.join(available)}"
    )


def default_group_by(runs: pd.DataFrame) -> list[str]:
    """Every tag or option that varies across the runs, except the seed."""
    keys = [k for k in _TAG_KEYS if k in runs and runs[k].fillna("-").nunique() > 1]
    for column in sorted(c for c in runs if c.startswith("params.")):
        name = column[len("params.") :]
        if (
            name in _NOT_GROUPS or name in keys or name.startswith("option.")
        ):  # resolved plugin options: derived
            continue
        if runs[column].fillna("-").nunique() > 1:
            keys.append(name)
    return keys or ["method"]


def aggregate(
    runs: pd.DataFrame, group_by: Sequence[str], metric: str = DEFAULT_METRIC
) -> pd.DataFrame:
    """mean, std (sample, n-1) and n of `metric` per group; NaN values are left out."""
    import pandas as pd

    column = f"metrics.{metric}"
    if column not in runs:
        names = sorted(c[len("metrics.") :] for c in runs if c.startswith("metrics."))
        raise UsageError(
            f"metric '{metric}' is not logged in these runs; available: {', '.join(names)}"
        )
    frame = pd.DataFrame(
        {key: runs[column_for(runs, key)].fillna("-").astype(str) for key in group_by}
    )
    frame["value"] = pd.to_numeric(runs[column], errors="coerce")
    frame = frame.dropna(subset=["value"])
    table = (
        frame.groupby(list(group_by), dropna=False, sort=False)["value"]
        .agg(["mean", "std", "count"])
        .reset_index()
    )
    table = table.rename(columns={"count": "n"})
    return _sorted(table, list(group_by))


def _sorted(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Rows ordered by the keys; numbers numerically, before text such as `none`."""

    def rank(value: str) -> tuple[int, float, str]:
        try:
            return (0, float(value), "")
        except ValueError:
            return (1, 0.0, value)

    order = sorted(range(len(table)), key=lambda i: [rank(str(table[k].iloc[i])) for k in keys])
    return table.iloc[order].reset_index(drop=True)


def mark_privacy(
    runs: pd.DataFrame, keys: list[str], *, allow_mixed: bool = False, what: str = "this table"
) -> tuple[pd.DataFrame, list[str], PrivacyCheck]:
    """Apply the equal-privacy rule to the runs of a table (UsageError unless it holds or
    `allow_mixed`); where the runs carry different marks, add the `privacy` column to the
    runs and to the group keys. Returns (runs, keys, check)."""
    from p4bench.studies.equal_privacy import check_privacy, from_row

    verdict = check_privacy(
        [from_row(row) for row in runs.to_dict("records")], allow_mixed=allow_mixed, what=what
    )
    if verdict.needs_column or PRIVACY_COLUMN in keys:
        runs = runs.assign(**{PRIVACY_COLUMN: [r.mark for r in verdict.runs]})
        if PRIVACY_COLUMN not in keys:
            keys = [*keys, PRIVACY_COLUMN]
    return runs, keys, verdict


def _text(value: Any) -> str | None:
    """A cell as text; None for missing values (NaN) and 'none'/'null'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip()
    return None if not text or text.lower() in ("none", "null", "nan") else text


def _epsilon_of(row: Mapping[str, Any], private: bool) -> str:
    """A run's epsilon setting as a table cell: `none` (non-private), its target epsilon as
    logged, else the epsilon its ledger reported (a run given a noise multiplier), else `?`."""
    if not private:
        return NONE
    target = _text(row.get("params.epsilon"))
    if target is not None:
        return target
    spent = row.get("metrics.epsilon")
    if isinstance(spent, (int, float)) and not math.isnan(spent):
        return f"{spent:.3g}"
    return "?"


def privacy_settings(runs: pd.DataFrame, verdict: PrivacyCheck) -> pd.DataFrame:
    """The runs with the columns `epsilon`, `delta` and `accountant` (text; `-` where a
    non-private run has none), from each run's privacy (`verdict.runs`, in row order)."""
    rows = runs.to_dict("records")
    private = [r.private for r in verdict.runs]
    return runs.assign(
        epsilon=[_epsilon_of(row, p) for row, p in zip(rows, private)],
        delta=[
            f"{r.delta:.3g}" if r.private and r.delta is not None else "-" for r in verdict.runs
        ],
        accountant=[(r.accountant or "?") if r.private else "-" for r in verdict.runs],
    )


def keep_settings_apart(runs: pd.DataFrame, keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """(keys, added): `keys` and, after them, every privacy setting (`SETTINGS`) and threat
    (`THREATS`: attack, defense) that takes more than one value within one group of `keys`;
    so no row pools two settings, attacks or defenses."""
    keys = list(keys)
    added: list[str] = []
    for name in (*SETTINGS, *THREATS):
        if name in keys or name not in runs:
            continue
        columns = [column_for(runs, k) for k in keys]
        values = runs[[*columns, name]].fillna("-").astype(str)
        if columns:
            varies = bool(
                (values.groupby(columns, dropna=False, sort=False)[name].nunique() > 1).any()
            )
        else:
            varies = values[name].nunique() > 1
        if varies:
            keys.append(name)
            added.append(name)
    return keys, added


def split_note(added: Sequence[str]) -> str | None:
    """The line saying which privacy settings were added as group keys (None: none)."""
    if not added:
        return None
    names = " and ".join(added)
    what = " or ".join(
        w
        for w, group in (("privacy settings", SETTINGS), ("attacks or defenses", THREATS))
        if set(added) & set(group)
    )
    return (
        f"rows also split by {names}: the runs of a group differ in it, and a row never pools "
        f"runs at different {what}"
    )


def compare_experiment(
    uri: str,
    experiment: str,
    group_by: Sequence[str] | None = None,
    metric: str = DEFAULT_METRIC,
    config_hashes: Sequence[str] | None = None,
    allow_mixed_privacy: bool = False,
) -> Comparison:
    """Read the experiment's finished runs, check they compare at equal privacy, aggregate."""
    from p4bench.studies.results import load_runs

    runs = dedupe(load_runs(uri, experiment))
    if config_hashes is not None and not runs.empty:
        runs = runs[runs["config_hash"].isin(set(config_hashes))].reset_index(drop=True)
    if runs.empty:
        raise UsageError(f"experiment '{experiment}' has no finished runs to compare")
    keys = list(group_by) if group_by else default_group_by(runs)
    runs, keys, verdict = mark_privacy(
        runs, keys, allow_mixed=allow_mixed_privacy, what=f"experiment '{experiment}'"
    )
    runs = privacy_settings(runs, verdict)
    if REFERENCE in runs and runs[REFERENCE].notna().any() and REFERENCE not in keys:
        keys = [*keys, REFERENCE]  # reference rows apart from the compared ones, and named
    keys, added = keep_settings_apart(runs, keys)
    return Comparison(
        experiment, uri, runs, aggregate(runs, keys, metric), keys, metric, verdict, added
    )


def _cell(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def interval_cell(std: float, n: int) -> str:
    """A row's 95% t half-width as a table cell: `+-0.0497`, or `n=1: none` (one run gives
    no interval, `p4bench.studies.intervals`)."""
    from p4bench.studies.intervals import half_width

    half = half_width(float(std), int(n))
    return f"n={int(n)}: none" if half != half else f"+-{half:.4f}"


def format_table(comparison: Comparison, fmt: str = "markdown") -> str:
    """The aggregated table as markdown or CSV text (the rich table is drawn by the CLI), with
    each row's 95% t half-width (`ci95_half`, empty where n = 1) beside its mean."""
    from p4bench.studies.intervals import half_width

    table = comparison.table
    if fmt == "csv":
        halves = [half_width(float(s), int(n)) for s, n in zip(table["std"], table["n"])]
        return str(table.assign(ci95_half=halves).to_csv(index=False)).rstrip("\n")
    if fmt != "markdown":
        raise UsageError(f"unknown format '{fmt}'; choose table, markdown or csv")
    header = [*comparison.group_by, f"{comparison.metric} mean", "95% (t)", "std", "n"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in table.itertuples(index=False):
        *keys, mean, std, n = (_cell(v) for v in row)
        lines.append(
            "| " + " | ".join([*keys, mean, interval_cell(row[-2], row[-1]), std, n]) + " |"
        )
    return "\n".join(lines)


# the plots were drawn here until they got their own module
__getattr__ = forward_moved(__name__, {"plot_comparison": "p4bench.studies.compare_plot"})
