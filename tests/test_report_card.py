"""The report card of every summary (issue 46): the reported clients' accuracy std and
bottom decile (p10) beside the mean, min and max, in summary.json, MLflow's final metrics
and the printed table."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from rich.console import Console

from p4bench.run.summary import spread


def test_spread_is_the_population_std_and_the_linear_10th_percentile():
    std, p10 = spread(np.array([0.5, 0.7, 0.9, 1.0]))
    # mean 0.775; squared deviations 0.075625 + 0.005625 + 0.015625 + 0.050625 = 0.1475
    assert std == pytest.approx(math.sqrt(0.1475 / 4))
    # rank 0.1 * (4 - 1) = 0.3 of the sorted values: 0.5 + 0.3 * (0.7 - 0.5)
    assert p10 == pytest.approx(0.56)
    assert spread(np.array([0.25])) == (0.0, 0.25)
    assert all(math.isnan(v) for v in spread(np.array([float("nan")])))
    assert all(math.isnan(v) for v in spread(np.zeros(0)))


def _hand(values: list[float]) -> tuple[float, float]:
    """std (ddof 0) and p10 (linear) without numpy's helpers."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    ordered = sorted(values)
    rank = 0.1 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return std, ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """A private fedavg run measured on the own and the global test sets (no tracking)."""
    from p4bench.config import RunConfig
    from p4bench.run.runner import run

    folder = str(tmp_path_factory.mktemp("report-card"))
    config = RunConfig(
        method="fedavg", clients=10, rounds=2, local_steps=1, seed=1, epsilon=8.0, eval_set="both"
    )
    return run(config.replace(results_dir=folder), track=False, verify=False)


def test_every_summary_carries_std_and_p10_of_the_reported_clients(result):
    summary = result.summary
    values = list(summary["accuracy_per_client"].values())
    assert len(values) == summary["reported_clients"] == 8
    std, p10 = _hand(values)
    assert summary["accuracy_std"] == pytest.approx(std)
    assert summary["accuracy_p10"] == pytest.approx(p10)
    assert summary["accuracy_min"] <= summary["accuracy_p10"] <= summary["accuracy_mean"]
    keys = list(summary)
    at = keys.index("accuracy_max")
    assert keys[at : at + 4] == [
        "accuracy_max",
        "accuracy_std",
        "accuracy_p10",
        "accuracy_per_client",
    ]
    # the global test set's, over the same reported clients
    held = result.outcome.extra_accuracy["global"][result.info.reported].tolist()
    std, p10 = _hand(held)
    assert summary["accuracy_global_std"] == pytest.approx(std)
    assert summary["accuracy_global_p10"] == pytest.approx(p10)
    at = keys.index("accuracy_global_max")
    assert keys[at + 1 : at + 3] == ["accuracy_global_std", "accuracy_global_p10"]
    assert "accuracy_unseen_mean" not in summary and "epsilon_unseen" not in summary


def test_mlflow_metrics_and_the_table_show_them(result):
    from p4bench.cli.summary_table import print_summary
    from p4bench.run.artifacts import final_metrics

    metrics = final_metrics(result)
    summary = result.summary
    for key in ("accuracy_std", "accuracy_p10", "accuracy_global_std", "accuracy_global_p10"):
        assert metrics[f"final_{key}"] == summary[key]
    out = io.StringIO()
    print_summary(Console(file=out, width=200), summary)
    text = out.getvalue()
    assert text.count("std / p10 (bottom decile)") == 2
    assert f"{summary['accuracy_std']:.4f} / {summary['accuracy_p10']:.4f}" in text


def test_a_tuning_run_withholds_std_and_p10_too(result):
    withheld = result.summary.without_reported_accuracy()
    assert math.isnan(withheld["accuracy_std"]) and math.isnan(withheld["accuracy_p10"])
    assert math.isnan(withheld["accuracy_global_p10"])
