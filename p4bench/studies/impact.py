"""Attack impact and ideal-defense gap across MLflow runs (`p4bench impact`, in `p4bench.cli.impact`).

The P4 paper's robustness metrics, computed from finished runs of one experiment:

- attack impact = benign accuracy without attack - benign accuracy with the attack, for
  the same seed and config (method, dataset, defense and every other parameter; the
  attack's own options and the malicious fraction are ignored on the unattacked side).
  Both sides average the same clients: the unattacked run's per-client accuracies
  (its `clients.csv` artifact) are averaged over the clients that are benign in the
  attacked run, since without an attack every client counts as benign;
- ideal-defense gap = benign accuracy with the `ideal` defense - with the real defense,
  same seed, attack and config apart from the defense and its options.

Benign accuracy is the metric `final_accuracy_mean` (mean test accuracy of the benign,
non-evaluation clients) unless another metric is named; for another metric the
unattacked side is that metric as logged (no per-client matching). Runs are identified by their
tags (method, attack, defense, dataset, seed) and parameters; when the same config was
run twice, the latest finished run counts. Seeds are paired first, then averaged.

Equal privacy (`p4bench.studies.equal_privacy`): the experiment's private runs must share one
neighbouring relation and be certified, else the table is refused (UsageError naming the runs)
unless `allow_mixed_privacy` (`--allow-mixed-privacy`), which adds a `privacy` column.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p4bench.errors import UsageError
from p4bench.studies.equal_privacy import COLUMN as PRIVACY
from p4bench.studies.equal_privacy import PrivacyCheck

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_METRIC = "final_accuracy_mean"
TAGS = ("method", "attack", "defense", "dataset", "seed")
DETECTION = ("detection_precision_total", "detection_recall_total")
DP_TAGS = ("dp.private", "dp.certified", "dp.neighbouring", "dp.uncertified_reason")
# never part of a config's identity: where it was logged, and what tags say better
_NOT_CONFIG = {
    "experiment",
    "tracking_uri",
    "results_dir",
    "attack",
    "defense",
    "method",
    "dataset",
    "seed",
}


def plugin_option_names(kind: str) -> set[str]:
    """Option keys (`config.options`) that belong to registered plugins of `kind`."""
    from p4bench.host.manager import default_registry

    names: set[str] = set()
    for entry in default_registry().entries(kind):
        names.update(o.name for o in getattr(entry.cls, "options", ()))
    return names


def load_runs(experiment: str, tracking_uri: str, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """One row per finished run of `experiment`: run_id, start_time, the tags, `metric`,
    detection totals and every parameter as a `param.<name>` column."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        known = sorted(e.name for e in client.search_experiments())
        raise UsageError(
            f"no MLflow experiment '{experiment}' at {tracking_uri}; experiments there: {', '.join(known) or '(none)'}"
        )
    rows, token = [], None
    while True:
        page = client.search_runs(
            [found.experiment_id],
            "attributes.status = 'FINISHED'",
            max_results=1000,
            page_token=token,
        )
        for r in page:
            row: dict[str, Any] = {"run_id": r.info.run_id, "start_time": r.info.start_time}
            row.update({tag: r.data.tags.get(tag, "none") for tag in TAGS})
            row.update({tag: r.data.tags.get(tag) for tag in DP_TAGS})
            row["accuracy"] = r.data.metrics.get(metric, float("nan"))
            row.update({name: r.data.metrics.get(name, float("nan")) for name in DETECTION})
            row.update({f"param.{k}": v for k, v in r.data.params.items()})
            rows.append(row)
        token = page.token
        if not token:
            break
    return pd.DataFrame(rows)


def load_client_accuracies(tracking_uri: str, run_ids: Iterable[str]) -> dict[str, pd.DataFrame]:
    """Each run's `clients.csv` artifact (client, role, malicious, accuracy); runs
    without it are left out."""
    import tempfile

    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    tables: dict[str, pd.DataFrame] = {}
    with tempfile.TemporaryDirectory() as folder:
        for run_id in run_ids:
            try:
                path = client.download_artifacts(run_id, "clients.csv", str(Path(folder) / run_id))
            except Exception:  # noqa: BLE001 - a run without artifacts keeps its logged metric
                continue
            tables[run_id] = pd.read_csv(path)
    return tables


def matched_accuracy(clean: pd.DataFrame, attacked: pd.DataFrame) -> float:
    """Mean accuracy in `clean` over the clients reported (benign, non-evaluation) in `attacked`."""
    benign = attacked[(attacked["role"] == "reported") & ~attacked["malicious"].astype(bool)][
        "client"
    ]
    values = clean.set_index("client").reindex(benign)["accuracy"]
    return float(values.mean()) if values.notna().all() and len(values) else float("nan")


def _key_columns(runs: pd.DataFrame, ignore: Iterable[str]) -> list[str]:
    ignored = set(_NOT_CONFIG) | set(ignore)
    # `option.*` are resolved plugin options: derived from the plugins and `options.*`, and
    # only logged for the plugins a run uses (an attack's exist on attacked runs only)
    return sorted(
        c
        for c in runs.columns
        if c.startswith("param.")
        and not c.startswith("param.option.")
        and c[len("param.") :] not in ignored
    )


def _latest(runs: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    return runs.sort_values("start_time").drop_duplicates(subset=key, keep="last")


def pair_runs(
    runs: pd.DataFrame,
    attack_options: set[str],
    defense_options: set[str],
    clients: dict[str, pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """Attacked runs with their unattacked and ideal-defense partners: columns accuracy,
    clean_accuracy, attack_impact, ideal_accuracy, ideal_gap (NaN where no partner).
    With `clients` (per-client accuracies by run id), the unattacked accuracy is taken
    over the attacked run's benign clients."""
    import pandas as pd

    runs = runs.copy()
    params = [c for c in runs.columns if c.startswith("param.")]
    runs[params] = runs[params].fillna("<unset>")
    full = _key_columns(runs, ())
    runs = _latest(runs, ["method", "attack", "defense", "dataset", "seed", *full])
    attacked = runs[runs["attack"] != "none"].copy()
    if attacked.empty:
        return attacked.assign(clean_accuracy=[], attack_impact=[], ideal_accuracy=[], ideal_gap=[])

    clean_key = ["method", "dataset", "seed", "defense"] + _key_columns(
        runs, {"malicious_fraction"} | {f"options.{o}" for o in attack_options}
    )
    clean = runs[runs["attack"] == "none"]
    clean = _latest(clean, clean_key)[clean_key + ["accuracy", "run_id"]]
    clean = clean.rename(columns={"accuracy": "clean_accuracy", "run_id": "clean_run_id"})
    paired = attacked.merge(clean, on=clean_key, how="left")
    if clients is not None:
        for index, row in paired.iterrows():
            if row["run_id"] in clients and row["clean_run_id"] in clients:
                paired.loc[index, "clean_accuracy"] = matched_accuracy(
                    clients[row["clean_run_id"]], clients[row["run_id"]]
                )

    ideal_key = ["method", "dataset", "seed", "attack"] + _key_columns(
        runs, {f"options.{o}" for o in defense_options}
    )
    ideal = runs[(runs["defense"] == "ideal") & (runs["attack"] != "none")]
    ideal = _latest(ideal, ideal_key)[ideal_key + ["accuracy"]].rename(
        columns={"accuracy": "ideal_accuracy"}
    )
    paired = paired.merge(ideal, on=ideal_key, how="left")
    paired["attack_impact"] = paired["clean_accuracy"] - paired["accuracy"]
    paired["ideal_gap"] = paired["ideal_accuracy"] - paired["accuracy"]
    return pd.DataFrame(paired)


def group_columns(paired: pd.DataFrame) -> list[str]:
    """Grouping of seeds into one table row: the tags plus every parameter that varies
    between the attacked runs (other than the seed)."""
    params = _key_columns(paired, ())
    varying = [c for c in params if paired[c].nunique(dropna=False) > 1]
    marked = [PRIVACY] if PRIVACY in paired.columns else []
    return ["dataset", "method", *marked, *varying, "attack", "defense"]


def impact_table(paired: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds per config: accuracy, clean accuracy, attack impact,
    ideal gap, detection precision and recall (run totals)."""
    groups = group_columns(paired)
    values = ["accuracy", "clean_accuracy", "attack_impact", "ideal_gap", *DETECTION]
    grouped = paired.groupby(groups, dropna=False, sort=True)
    table = grouped[values].agg(["mean", "std"])
    table.columns = [f"{name}_{stat}" for name, stat in table.columns]
    table.insert(0, "seeds", grouped["seed"].nunique())
    return table.reset_index()


def format_table(table: pd.DataFrame) -> str:
    """The impact table as text: mean ± std columns, one row per config."""
    import pandas as pd

    def pm(name: str) -> pd.Series:
        mean, std = table[f"{name}_mean"], table[f"{name}_std"].fillna(0.0)
        return pd.Series(
            [("-" if pd.isna(m) else f"{m:.3f} ± {s:.3f}") for m, s in zip(mean, std)],
            index=table.index,
        )

    shown = table[[c for c in table.columns if not c.endswith(("_mean", "_std"))]].copy()
    shown.columns = [c[len("param.") :] if c.startswith("param.") else c for c in shown.columns]
    for name, title in (
        ("accuracy", "benign acc"),
        ("clean_accuracy", "no-attack acc"),
        ("attack_impact", "attack impact"),
        ("ideal_gap", "ideal gap"),
        ("detection_precision_total", "det. precision"),
        ("detection_recall_total", "det. recall"),
    ):
        shown[title] = pm(name)
    return str(shown.to_string(index=False))


def plot_impact(table: pd.DataFrame, path: Path, title: str = "") -> Path:
    """Paper-style grouped bars: attack impact per attack (x) and defense (bars), one
    panel per dataset / method (and varying parameter), error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [c for c in group_columns_of(table) if c not in ("attack", "defense")]
    groups = list(table.groupby(panels, dropna=False, sort=True)) if panels else [((), table)]
    fig, axes = plt.subplots(
        1, len(groups), figsize=(max(5.0, 4.5 * len(groups)), 3.8), squeeze=False, sharey=True
    )
    defenses = sorted(table["defense"].unique(), key=lambda d: (d != "none", d != "ideal", d))
    for axis, (label, part) in zip(axes[0], groups):
        attacks = sorted(part["attack"].unique())
        width = 0.8 / max(len(defenses), 1)
        for k, defense in enumerate(defenses):
            rows = part[part["defense"] == defense].set_index("attack").reindex(attacks)
            x = np.arange(len(attacks)) + (k - (len(defenses) - 1) / 2) * width
            axis.bar(
                x,
                rows["attack_impact_mean"],
                width,
                yerr=rows["attack_impact_std"].fillna(0.0),
                capsize=2,
                label=defense,
            )
        axis.axhline(0, color="black", linewidth=0.6)
        axis.set_xticks(np.arange(len(attacks)), attacks, rotation=20)
        axis.set_title(panel_title(panels, label), fontsize=9)
        axis.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("attack impact (benign accuracy drop)")
    axes[0][-1].legend(title="defense", fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def panel_title(panels: list[str], label: Any) -> str:
    """An impact panel's title: what varies between panels, as "column value"; a parameter
    the runs did not set ("<unset>") says nothing."""
    values = label if isinstance(label, tuple) else (label,)
    named = [
        f"{column} {value}"
        for column, value in zip(panels, values)
        if str(value) not in ("<unset>", "nan", "None")
    ]
    return " / ".join(named) or "all runs"


def group_columns_of(table: pd.DataFrame) -> list[str]:
    """The grouping columns present in an impact table."""
    return [
        c
        for c in table.columns
        if c in ("dataset", "method", PRIVACY, "attack", "defense") or c.startswith("param.")
    ]


def check_privacy_of(
    runs: pd.DataFrame, experiment: str, allow_mixed: bool = False
) -> tuple[pd.DataFrame, PrivacyCheck]:
    """The equal-privacy rule on the runs (UsageError naming them unless it holds or
    `allow_mixed`); where their marks differ, a `privacy` column is added. (runs, check)."""
    from p4bench.studies.equal_privacy import check_privacy, from_row

    verdict = check_privacy(
        [from_row(row, params="param.") for row in runs.to_dict("records")],
        allow_mixed=allow_mixed,
        what=f"experiment '{experiment}'",
    )
    if verdict.needs_column:
        runs = runs.assign(**{PRIVACY: [r.mark for r in verdict.runs]})
    return runs, verdict


def compute_impact(
    experiment: str,
    tracking_uri: str,
    metric: str = DEFAULT_METRIC,
    allow_mixed_privacy: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-run pairs, table) for an experiment; UsageError if it has no attacked run, or
    if its runs do not compare at equal privacy (unless `allow_mixed_privacy`)."""
    runs = load_runs(experiment, tracking_uri, metric)
    if runs.empty or not (runs["attack"] != "none").any():
        raise UsageError(
            f"experiment '{experiment}' has no finished run with an attack; nothing to compare"
        )
    runs, verdict = check_privacy_of(runs, experiment, allow_mixed_privacy)
    clients = (
        load_client_accuracies(tracking_uri, runs["run_id"]) if metric == DEFAULT_METRIC else None
    )
    paired = pair_runs(runs, plugin_option_names("attack"), plugin_option_names("defense"), clients)
    table = impact_table(paired)
    table.attrs["privacy"] = verdict  # the note and warning impact_command prints
    return paired, table
