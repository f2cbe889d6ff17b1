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


# -- clients that join after training (--unseen-fraction) ------------------------------


@pytest.fixture(scope="module")
def unseen_runs(tmp_path_factory):
    """A private fedavg run of 8 clients with a quarter unseen, the same run with none,
    and a non-private one with a quarter unseen (no tracking)."""
    from p4bench.config import RunConfig
    from p4bench.run.runner import run

    folder = str(tmp_path_factory.mktemp("unseen"))
    base = RunConfig(
        method="fedavg", clients=8, rounds=2, local_steps=2, seed=3, results_dir=folder
    )
    return (
        run(base.replace(epsilon=8.0, unseen_fraction=0.25), track=False, verify=False),
        run(base.replace(epsilon=8.0), track=False, verify=False),
        run(base.replace(unseen_fraction=0.25), track=False, verify=False),
    )


def test_unseen_clients_are_reported_apart_with_their_own_epsilon(unseen_runs):
    from p4bench.privacy.accountants import ReleaseSegment, accounted_epsilon
    from p4bench.run.artifacts import final_metrics

    result, _, _ = unseen_runs
    summary = result.summary
    assert summary["clients"] == 8 and summary["unseen_clients"] == 2
    assert result.info.data.num_clients == 6  # they took no part in training
    assert summary["evaluation_clients"] == 2 and summary["reported_clients"] == 4
    assert len(summary["accuracy_per_client"]) == 4  # the reported clients exclude them
    assert 0.0 <= summary["accuracy_unseen_mean"] <= 1.0
    assert summary["accuracy_unseen_std"] >= 0.0
    setup = summary["unseen_fine_tune"]
    assert setup["steps"] == 2 and setup["noise_multiplier"] == summary["noise_multiplier"]
    assert setup["start"] == "the mean of the trained clients' deployed models"
    assert setup["verification"].startswith("not covered for the unseen clients' fine-tune")
    # their epsilon is that of the fine-tune's K DP steps at the run's sigma and data rate
    accountant = result.info.plugins["accountant"]["name"]
    from p4bench.host.manager import Registry, create_plugin_manager

    expected = accounted_epsilon(
        Registry(create_plugin_manager()).get("accountant", accountant)(),
        [ReleaseSegment(summary["noise_multiplier"], 0.2, 2, 2, 1, 1.0, 8, "aggregator")],
        summary["delta"],
        summary["neighbouring"],
    )
    assert summary["epsilon_unseen"] == pytest.approx(expected, rel=1e-6)
    assert summary["epsilon_unseen_mean"] == pytest.approx(expected, rel=1e-6)
    assert 0 < summary["epsilon_unseen"] < summary["epsilon"]
    keys = list(summary)
    assert keys.index("accuracy") < keys.index("unseen_clients") < keys.index("epsilon")
    metrics = final_metrics(result)
    assert metrics["final_accuracy_unseen_mean"] == summary["accuracy_unseen_mean"]
    assert metrics["epsilon_unseen"] == summary["epsilon_unseen"]


def test_without_unseen_clients_nothing_changes(unseen_runs):
    with_unseen, without, _ = unseen_runs
    unseen_keys = [k for k in with_unseen.summary if "unseen" in k]
    assert unseen_keys == [
        "unseen_clients",
        "accuracy_unseen_mean",
        "accuracy_unseen_std",
        "accuracy_unseen_p10",
        "epsilon_unseen",
        "epsilon_unseen_mean",
        "unseen_fine_tune",
    ]
    assert [k for k in with_unseen.summary if k not in unseen_keys] == list(without.summary)
    assert without.info.data.num_clients == 8 and without.summary["reported_clients"] == 6
    # the default adds nothing to the config hash: runs from before the option keep theirs
    from p4bench.config import RunConfig

    assert RunConfig(method="fedavg", clients=8, epsilon=8.0).config_hash() == "e94ee51ccb49caf7"
    assert RunConfig(unseen_fraction=0.25).config_hash() != RunConfig().config_hash()


def test_a_non_private_run_fine_tunes_its_unseen_clients_without_dp(unseen_runs):
    summary = unseen_runs[2].summary
    assert summary["epsilon"] is None and "epsilon_unseen" not in summary
    assert summary["unseen_clients"] == 2 and 0.0 <= summary["accuracy_unseen_mean"] <= 1.0
    assert summary["unseen_fine_tune"]["noise_multiplier"] is None
    assert "verification" not in summary["unseen_fine_tune"]


def test_unseen_clients_are_drawn_among_the_non_evaluation_clients():
    import torch

    from p4bench.config import RunConfig
    from p4bench.data.federated import ClientTensors, FederatedData
    from p4bench.data.unseen import split_unseen
    from p4bench.errors import UsageError

    count = 10
    tensors = ClientTensors(
        torch.arange(count, dtype=torch.float32).reshape(count, 1, 1).expand(count, 3, 1).clone(),
        torch.zeros(count, 3, dtype=torch.int64),
        torch.full((count,), 3),
    )
    evaluation = torch.zeros(count, dtype=torch.bool)
    evaluation[[1, 4]] = True
    data = FederatedData(
        tensors,
        tensors,
        evaluation,
        2,
        (1,),
        ("a", "b"),
        tuple(np.array([i]) for i in range(count)),
    )
    trained, unseen = split_unseen(data, RunConfig(clients=count, unseen_fraction=0.3, seed=5))
    ids = [int(x) for x in unseen.train.x[:, 0, 0]]
    kept = [int(x) for x in trained.train.x[:, 0, 0]]
    assert len(ids) == 3 and not set(ids) & {1, 4} and ids == sorted(ids)
    assert sorted(ids + kept) == list(range(count)) and kept == sorted(kept)
    assert trained.evaluation.tolist() == [k in (1, 4) for k in kept]
    assert [int(c[0]) for c in unseen.client_indices] == ids
    with pytest.raises(UsageError, match="unseen-fraction 0.9"):
        split_unseen(data, RunConfig(clients=count, unseen_fraction=0.9))


def test_proxy_methods_start_newcomers_from_their_proxies():
    import torch

    from p4bench.host.manager import Registry, create_plugin_manager

    registry = Registry(create_plugin_manager())
    state = {
        "private": {"w": torch.tensor([[9.0], [9.0]])},
        "proxy": {"w": torch.tensor([[1.0], [3.0]])},
    }
    for name in ("proxyfl", "p4"):
        method = registry.get("method", name)
        assert method.newcomer_start == "the mean of the trained clients' proxies"
        assert method.newcomer_params(method.__new__(method), state)["w"].tolist() == [2.0]
    fedavg = registry.get("method", "fedavg")
    assert fedavg.newcomer_start == "the mean of the trained clients' deployed models"
