"""What a run writes beside its MLflow record: the partition's table and heatmap, the
accuracy plot, and the final metrics and tags (`p4bench.tracking.tracker` logs them)."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from p4bench.records import RunInfo, RunSummary, display_round

__all__ = [
    "GLOBAL_FIGURES",
    "METHOD_FIGURE_PREFIXES",
    "REPORT_CARD",
    "final_metrics",
    "final_tags",
    "method_figures",
    "plot_accuracy",
    "write_partition_summary",
]

GLOBAL_FIGURES = tuple(f"accuracy_global_{k}" for k in ("mean", "min", "max", "std", "p10"))
# the report card beside the mean: spread over the reported clients, and the unseen clients'
# (`--unseen-fraction`) accuracy; logged as final_<name> where the summary has them
REPORT_CARD = (
    "accuracy_std",
    "accuracy_p10",
    *(f"accuracy_unseen_{k}" for k in ("mean", "std", "p10")),
)


def final_metrics(result: Any) -> dict[str, float]:
    """The run's final MLflow metrics: accuracy (mean, std and p10; the unseen clients'),
    time, bytes, rounds, method figures, epsilon (the reported clients', and
    `epsilon_evaluation_clients` and `epsilon_unseen`: the evaluation and unseen clients' own)."""
    summary = result.summary
    final = {
        "final_accuracy_mean": float(summary["accuracy_mean"]),
        "wall_time_s": float(result.wall_time_s),
        # `--eval global|both`: the global test set's figures too (compare --metric final_accuracy_global_mean)
        **{f"final_{k}": float(summary[k]) for k in REPORT_CARD + GLOBAL_FIGURES if k in summary},
        "bytes_sent_total": float(summary.get("bytes_sent", 0)),
        "rounds_completed": float(summary.get("rounds_completed", len(result.outcome.reports))),
    }
    final.update(method_figures(summary))
    if summary.get("epsilon") is not None:  # a non-private run logs no epsilon at all (never 0.0)
        final.update(
            {
                k: float(summary[k])
                for k in (
                    "epsilon",
                    "epsilon_mean",
                    "epsilon_rdp",
                    "epsilon_rdp_mean",
                    "epsilon_pld",
                    "epsilon_evaluation_clients",
                    "epsilon_unseen",
                    *NETWORK_FIGURES,
                )
                if summary.get(k) is not None
            }
        )
    return final


# a private run's network DP (`p4bench.privacy.network_record`): metrics, and the tag compare groups by
NETWORK_FIGURES = tuple(
    f"epsilon_network_{k}" for k in ("max", "mean", "neighbour_mean", "two_hop_mean")
)


def final_tags(summary: RunSummary) -> dict[str, str]:
    """Tags known at the end: the time budget's stop, the certificate after the checks that
    run after training, and the resolved privacy setting (the config may have left it to
    the method or the calibration)."""
    tags = {"stopped_by_time_budget": str(summary.stopped_by_time_budget).lower()}
    certification, privacy = summary.certification, summary.privacy
    if certification is not None:
        tags["dp.certified"] = str(certification.certified).lower()
        if certification.reason:
            tags["dp.uncertified_reason"] = certification.reason
    if privacy is not None:
        for key in ("neighbouring", "noise_multiplier", "delta", "accountant", "clip"):
            tags[f"dp.{key}"] = str(getattr(privacy, key))
        if privacy.epsilon_scope:  # stopped by the time budget: the rounds the epsilon covers
            tags["dp.epsilon_scope"] = privacy.epsilon_scope
    if "network_dp" in summary.privacy_context:  # `compare --group-by network_dp`
        tags["network_dp"] = str(summary.privacy_context["network_dp"])
    return tags


def write_partition_summary(
    run: RunInfo, folder: Path, table: bool = True, heatmap: bool = True
) -> None:
    """partition.csv (per client: role, sizes, class counts) and a client-by-class heatmap
    (partition.png); `table` and `heatmap` choose which."""
    data = run.data
    if data is None:  # a run whose data lives elsewhere (device peers): nothing to summarize here
        return
    classes = data.num_classes
    counts = np.zeros((data.num_clients, classes), dtype=np.int64)
    for split in (data.train, data.test):
        labels, sizes = (
            split.y.cpu().numpy(),
            split.n.cpu().numpy(),
        )  # one copy from the run's device
        for client in range(data.num_clients):
            counts[client] += np.bincount(labels[client, : sizes[client]], minlength=classes)
    if table:
        with open(folder / "partition.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(
                [
                    "client",
                    "role",
                    "malicious",
                    "n_train",
                    "n_test",
                    *[f"class_{c}" for c in data.class_names],
                ]
            )
            for client in range(data.num_clients):
                role = "evaluation" if run.evaluation[client] else "reported"
                writer.writerow(
                    [
                        client,
                        role,
                        bool(run.malicious[client]),
                        int(data.train.n[client]),
                        int(data.test.n[client]),
                        *counts[client].tolist(),
                    ]
                )
    if heatmap:
        from p4bench.data.summary import plot_partition_heatmap

        plot_partition_heatmap(
            counts,
            data.class_names,
            folder / "partition.png",
            title=f"{run.config.dataset} / {run.config.partitioner}: samples per client and class",
        )


# Run-level figures of the methods (PDSL's rho and Theorem 1 epsilon, P4L's completion rate,
# a client gate's decisions, ...): logged as final MLflow metrics when numeric.
METHOD_FIGURE_PREFIXES = (
    "p4l.",
    "pdsl.",
    "cga.",
    "gate.",
    "rho",
    "degree_",
    "epsilon_theorem1",
    "min_group",
)


def method_figures(summary: Mapping[str, Any]) -> dict[str, float]:
    """The numeric summary values named by `METHOD_FIGURE_PREFIXES`."""
    return {
        k: float(v)
        for k, v in summary.items()
        if k.startswith(METHOD_FIGURE_PREFIXES)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
    }


def plot_accuracy(metrics_csv: Path, out: Path, title: str) -> None:
    """Accuracy of the reported clients per round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import pandas as pd

    frame = pd.read_csv(metrics_csv)
    fig, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    # the last phase's rounds are 1..T (as every method's); earlier ones (P4's grouping) count down
    # to 0, as MLflow shows them (`display_round`; the phases as the rows hold them, all completed)
    phases = [
        SimpleNamespace(name=name, rounds=count)
        for name, count in frame["phase"].value_counts(sort=False).items()
    ]
    shown = [
        display_round(phases, phase, int(r)) for phase, r in zip(frame["phase"], frame["round"])
    ]
    main = frame["phase"] == frame["phase"].iloc[-1] if len(frame) else frame["phase"] == ""
    earlier = int((~main).sum())
    axis.plot(shown, frame["accuracy_mean"], marker="o", markersize=3)
    if earlier:
        axis.axvline(0.5, color="grey", linewidth=0.8, linestyle=":")
        axis.annotate(
            ", ".join(dict.fromkeys(frame["phase"][~main])),
            (0.5, 0.02),
            fontsize=7,
            ha="right",
            xycoords=("data", "axes fraction"),
        )
    axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axis.set_xlabel("round")
    axis.set_ylabel("mean test accuracy (reported clients)")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
