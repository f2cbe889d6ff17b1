"""A private gossip run reports its network DP (p4bench.privacy.network_record): the summary
keys, the matrix and its heatmap as artifacts, "not applicable" where the method does not
declare its mixing, and `compare` groups by it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import p4bench.run.runner as runner
from p4bench.config import RunConfig
from p4bench.privacy.network_dp import pairwise_epsilon
from p4bench.privacy.network_events import Gossip, Release
from p4bench.privacy.network_record import NetworkRecorder, graph_adjacency
from p4bench.run.runner import run
from p4bench.topology import metropolis_hastings

FIGURES = ("max", "mean", "neighbour_mean", "two_hop_mean")


@pytest.fixture
def recorders(monkeypatch):
    """The network recorders of the runs in the test, kept for inspection."""
    kept: list[NetworkRecorder] = []

    class Kept(NetworkRecorder):
        def __init__(self, prepared, resumed=False):
            super().__init__(prepared, resumed)
            kept.append(self)

    monkeypatch.setattr(runner, "NetworkRecorder", Kept)
    return kept


def _ring(n: int) -> np.ndarray:
    adjacency = np.zeros((n, n), dtype=bool)
    for i in range(n):
        adjacency[i, (i + 1) % n] = adjacency[(i + 1) % n, i] = True
    return adjacency


def _run(results_dir, method="muffliato", **changes):
    base = dict(
        method=method,
        clients=6,
        rounds=2,
        local_steps=1,
        epsilon=8.0,
        accountant="rdp",
        eval_fraction=0.0,
        results_dir=results_dir,
        options={"topology": "ring"},
    )
    return run(RunConfig(**{**base, **changes}), verify=False)


def test_a_muffliato_ring_run_reports_its_network_dp_and_logs_the_matrix(results_dir, recorders):
    result = _run(results_dir, options={"topology": "ring", "gossip_steps": 2})
    summary = result.summary
    assert summary["network_dp"].startswith("pairwise, one curious node")
    epsilon = summary["epsilon"]
    assert summary["epsilon_network_max"] <= epsilon + 1e-9
    assert summary["epsilon_network_two_hop_mean"] <= summary["epsilon_network_neighbour_mean"]
    # the recorded mixing is the ring's Metropolis-Hastings matrix (the topology harness's),
    # once per gossip exchange (2 rounds x 1 iteration x 2 steps), one object for all of them
    recorder = recorders[0]
    gossips = [e for e in recorder.events if isinstance(e, Gossip)]
    mixing = [g for g in gossips if np.count_nonzero(g.weights - np.diag(np.diag(g.weights)))]
    assert len(mixing) == 4 and len({id(g) for g in mixing}) == 1
    np.testing.assert_allclose(mixing[0].weights, metropolis_hastings(_ring(6)))
    assert np.array_equal(graph_adjacency(recorder.events, 6), _ring(6))
    # the artifact is the matrix the figures come from
    folder = Path(result.info.tracking["results_dir"])
    with open(folder / "network_epsilon.csv") as handle:
        rows = list(csv.reader(handle))[1:]
    matrix = np.array([[float(x) for x in row[1:]] for row in rows])
    off = ~np.eye(6, dtype=bool)
    assert matrix.shape == (6, 6) and np.allclose(np.diag(matrix), 0)
    assert matrix[off].max() == pytest.approx(summary["epsilon_network_max"], rel=1e-5)
    assert matrix[off].mean() == pytest.approx(summary["epsilon_network_mean"], rel=1e-5)
    assert (folder / "network_epsilon.png").stat().st_size > 0
    written = json.loads((folder / "summary.json").read_text())
    assert all(f"epsilon_network_{k}" in written for k in FIGURES)


def test_release_scales_are_declared_exactly_as_diagonal_mixings():
    """A release scaled by k_i on its way into the state, as diag(1/k) -> Release ->
    diag(k): a common scale changes nothing (the noise multiplier is a ratio); a node whose
    releases enter ten times smaller hides the others' less."""
    n, sigma = 5, 2.0
    weights = metropolis_hastings(_ring(n))
    every = np.ones(n, dtype=bool)

    def run_of(scales):
        events = []
        for _ in range(3):
            events += [Gossip(np.diag(1 / scales)), Release(every, sigma), Gossip(np.diag(scales))]
            events.append(Gossip(weights))
        return pairwise_epsilon(events, n, 1e-5).epsilon

    plain = pairwise_epsilon([Release(every, sigma), Gossip(weights)] * 3, n, 1e-5).epsilon
    np.testing.assert_allclose(run_of(np.full(n, 0.25)), plain, rtol=1e-9, atol=1e-12)
    quiet = np.ones(n)
    quiet[1] = 0.1  # node 1's releases enter small: its noise masks node 0's less for node 2
    assert run_of(quiet)[0, 2] > plain[0, 2]


def test_dp_dsgt_and_a_non_private_run_report_no_figure(results_dir):
    tracked = _run(results_dir, method="dp-dsgt").summary
    assert tracked["network_dp"].startswith("not applicable (dp-dsgt: its tracker")
    assert not any(k.startswith("epsilon_network") for k in tracked)
    open_run = _run(results_dir, epsilon=None, no_dp=True).summary
    assert "network_dp" not in open_run


def test_compare_groups_runs_by_network_dp(results_dir):
    from p4bench.studies.compare import compare_experiment
    from p4bench.studies.results import tracking_uri_for

    _run(results_dir)
    _run(results_dir, method="dp-dsgt")
    comparison = compare_experiment(
        tracking_uri_for(None, results_dir), "p4bench", ["network_dp"], allow_mixed_privacy=True
    )
    groups = set(comparison.table["network_dp"])
    assert any(g.startswith("pairwise") for g in groups)
    assert any(g.startswith("not applicable") for g in groups)


def test_a_run_beyond_the_accounting_budget_says_where_to_compute_it(results_dir, monkeypatch):
    monkeypatch.setattr("p4bench.privacy.network_record.WORK_LIMIT", 0.0)
    summary = _run(results_dir, options={"topology": "ring"}).summary
    assert "epsilon_network_max" not in summary
    assert summary["network_dp"].startswith("not computed in the run (")
    assert "p4bench privacy network" in summary["network_dp"]
