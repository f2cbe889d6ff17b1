"""CBDS (Karras et al., Algorithm 1): the swap loop, equal disjoint clients, the paper's
undersampling figures and the statistics a run logs to MLflow."""

from __future__ import annotations

import json
from itertools import permutations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.data.cbds import CBDSPartitioner, cbds_counts, cbds_matrix, imbalance
from p4bench.errors import DataError
from p4bench.rng import SEED_PARTITION, harness_rng


def literal_algorithm_1(matrix: np.ndarray) -> np.ndarray:
    """Algorithm 1 as printed: every client, every ordered label pair, u recomputed from scratch."""
    matrix = matrix.copy()
    clients, labels = matrix.shape
    while True:
        best, where = imbalance(matrix), None
        for i in range(clients):
            for j1, j2 in permutations(range(labels), 2):
                matrix[i, [j1, j2]] = matrix[i, [j2, j1]]
                u = imbalance(matrix)
                matrix[i, [j1, j2]] = matrix[i, [j2, j1]]
                if u < best - 1e-12:
                    best, where = u, (i, j1, j2)
        if where is None:
            return matrix
        i, j1, j2 = where
        matrix[i, [j1, j2]] = matrix[i, [j2, j1]]


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_incremental_swaps_match_the_printed_algorithm(alpha):
    for seed in range(3):
        result = cbds_matrix(12, 5, alpha, np.random.default_rng(seed))
        rng = np.random.default_rng(seed)  # replay: the rows, then the label order of the loop
        drawn = rng.dirichlet(np.full(5, alpha), size=12)
        order = rng.permutation(5)
        expected = np.empty_like(drawn)
        expected[:, order] = literal_algorithm_1(drawn[:, order])
        np.testing.assert_allclose(result.swapped, expected, rtol=0, atol=1e-15)


def test_every_swap_strictly_lowers_u_and_normalises():
    result = cbds_matrix(60, 10, 0.3, np.random.default_rng(4), trace=True)
    history = np.array([result.u_before, *result.history])
    assert result.swaps == len(result.history) > 0
    assert (
        np.diff(history) < 0
    ).all()  # strictly decreasing, recomputed from scratch after each swap
    assert (
        history[-1] == pytest.approx(result.u_after, abs=1e-12) and result.u_after < result.u_before
    )
    np.testing.assert_allclose(
        np.sort(result.swapped, axis=1),
        np.sort(np.random.default_rng(4).dirichlet(np.full(10, 0.3), size=60), axis=1),
    )  # rows only permuted
    columns = result.normalised.sum(axis=0)
    assert (columns <= 1 + 1e-12).all() and columns.max() == pytest.approx(1.0)
    np.testing.assert_allclose(result.normalised.sum(axis=1), 1 / result.column_sums.max())


def test_undersampling_at_c100_alpha001_over_100_seeds():
    """Paper: mean below 1%, at most 3.3%; the spec's numpy check 0.67% / 3.13% (worst label 4.15%).
    Seeds 0..99 as runs draw them (the partition stream of `--seed s`)."""
    results = [cbds_matrix(100, 10, 0.01, harness_rng(seed, SEED_PARTITION)) for seed in range(100)]
    total = np.array([r.undersampling for r in results])
    worst = np.array([r.label_undersampling.max() for r in results])
    print(
        f"CBDS C=100 l=10 alpha=0.01, 100 seeds: undersampling mean {total.mean():.2%} max {total.max():.2%}, "
        f"worst label {worst.max():.2%}, runs with a label above 5%: {(worst > 0.05).mean():.0%}"
    )
    assert total.mean() < 0.01 and total.max() < 0.05


def labels_with_uneven_classes() -> np.ndarray:
    sizes = [
        120,
        100,
        130,
        101,
        150,
        99,
        180,
        100,
        110,
        105,
    ]  # the smallest class (99) is every label's pool
    return np.random.default_rng(0).permutation(np.repeat(np.arange(10), sizes))


@pytest.mark.parametrize("alpha,clients", [(0.01, 20), (1.0, 7), (100.0, 30)])
def test_partition_is_disjoint_with_equal_sizes_within_pools(alpha, clients):
    labels = labels_with_uneven_classes()
    partitioner = CBDSPartitioner()
    config = RunConfig(options={"cbds_alpha": alpha})
    parts = partitioner.partition(labels, 10, clients, None, np.random.default_rng(1), config)
    sizes = {len(p) for p in parts}
    everything = np.concatenate(parts)
    assert len(parts) == clients and len(sizes) == 1 and sizes.pop() >= 2
    assert len(np.unique(everything)) == len(everything)  # disjoint
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    assert (counts.sum(axis=0) <= 99).all()
    # each client's label mix is its row of P up to rounding (< 1 sample per label, plus the trim)
    stats = partitioner.report.stats
    assert stats["samples_per_client"] == len(parts[0]) and stats["u_after"] <= stats["u_before"]
    matrix = np.loadtxt(
        partitioner.report.artifacts["partition_matrix.csv"].splitlines(), delimiter=",", skiprows=1
    )
    assert matrix.shape == (clients, 11) and (matrix[:, 1:].sum(axis=0) <= 1 + 1e-9).all()
    assert np.abs(counts - matrix[:, 1:] * 99).max() < 10 + 1e-9


def test_requested_size_is_exact_and_too_large_a_size_is_refused():
    labels = labels_with_uneven_classes()
    partitioner, config = CBDSPartitioner(), RunConfig(options={"cbds_alpha": 0.5})
    parts = partitioner.partition(labels, 10, 12, 40, np.random.default_rng(2), config)
    assert {len(p) for p in parts} == {40}
    with pytest.raises(DataError, match="at most"):
        partitioner.partition(labels, 10, 12, 400, np.random.default_rng(2), config)


def test_rounding_gives_floors_plus_largest_remainders_within_pools():
    shares = np.array(
        [[0.55, 0.45], [0.45, 0.55]]
    )  # quotas at pool 9: [4.95, 4.05] and [4.05, 4.95]
    assert cbds_counts(shares, 9).tolist() == [[5, 4], [4, 5]]
    uneven = np.array([[0.95, 0.0], [0.05, 1.0]])  # sizes 9.5 and 10.5 at pool 10: both get 9
    assert cbds_counts(uneven, 10).tolist() == [[9, 0], [0, 9]]
    contested = np.array(
        [[0.35, 0.15], [0.35, 0.15], [0.30, 0.20]]
    )  # one sample of label 0 left for two clients
    assert cbds_counts(contested, 10).tolist() == [[4, 1], [3, 2], [3, 2]]
    assert cbds_counts(contested, 10, size=4).sum(axis=1).tolist() == [4, 4, 4]


def test_rounding_keeps_nearly_all_of_the_pools():
    for clients, labels, pool in ((1000, 10, 6000), (1000, 100, 600), (40, 10, 6000)):
        result = cbds_matrix(clients, labels, 1.0, np.random.default_rng(0))
        counts = cbds_counts(result.normalised, pool)
        row_total = result.normalised.sum(axis=1, keepdims=True) * pool
        quotas = result.normalised * pool * np.floor(row_total.min() + 1e-9) / row_total
        assert (counts.sum(axis=0) <= pool).all() and len(set(counts.sum(axis=1))) == 1
        assert (
            (counts == np.floor(quotas)) | (counts == np.floor(quotas) + 1)
        ).all()  # no fallback trim needed
        assert counts.sum() > clients * (np.floor(pool / result.column_sums.max()) - 1)


def test_thousand_clients_partition_quickly():
    result = cbds_matrix(1000, 10, 0.01, np.random.default_rng(0))
    assert result.u_after < result.u_before and result.undersampling < 0.01


def test_run_logs_cbds_statistics_to_mlflow(capsys, tmp_path):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = [
        "run",
        "--method",
        "fedavg",
        "--partitioner",
        "cbds",
        "-o",
        "cbds_alpha=0.5",
        "--clients",
        "10",
        "--rounds",
        "1",
        "--results-dir",
        str(tmp_path / "runs"),
        "--tracking-uri",
        uri,
        "--json",
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert (info.value.code or 0) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stats = summary["partition_stats"]
    assert (
        stats["u_after"] <= stats["u_before"]
        and 0 <= stats["undersampling"] <= stats["undersampling_worst_label"]
    )
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["run_id"])
    assert run.data.params["option.cbds_alpha"] == "0.5"
    for name in ("u_before", "u_after", "undersampling", "undersampling_worst_label", "swaps"):
        assert run.data.metrics[f"partition.{name}"] == pytest.approx(stats[name])
    assert "partition_matrix.csv" in {a.path for a in client.list_artifacts(summary["run_id"])}
