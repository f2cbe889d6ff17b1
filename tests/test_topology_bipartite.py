"""The complete bipartite topology and PDSL's spectral assumption A3 on mixing matrices."""

from __future__ import annotations

import numpy as np
import pytest

from p4bench.errors import ConfigError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.topology.assumptions import check_pdsl_assumption, mixing_report
from p4bench.topology.graphs import (
    BipartiteGraph,
    CompleteGraph,
    RingGraph,
    is_connected,
    is_symmetric,
)
from p4bench.topology.mixing import metropolis_hastings

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("m,left", [(10, 5), (7, 4), (2, 1), (3, 2)])
def test_bipartite_edges(m, left):
    adjacency = BipartiteGraph().edges(m, 0, RNG)
    assert adjacency.dtype == bool and adjacency.shape == (m, m)
    assert not adjacency.diagonal().any() and is_symmetric(adjacency) and is_connected(adjacency)
    assert adjacency[:left, left:].all()  # every cross pair
    assert (
        not adjacency[:left, :left].any() and not adjacency[left:, left:].any()
    )  # no edge within a side
    assert int(np.triu(adjacency).sum()) == left * (m - left)


def test_bipartite_is_registered_and_refuses_one_client():
    registry = Registry(create_plugin_manager(autoload=False))
    assert registry.get("topology", "bipartite") is BipartiteGraph
    with pytest.raises(ConfigError, match="at least 2"):
        BipartiteGraph().edges(1, 0, RNG)


@pytest.mark.parametrize("m", [10, 20])
def test_mh_weights_satisfy_a3_and_rho_orders_the_graphs(m):
    reports = {}
    for cls in (CompleteGraph, BipartiteGraph, RingGraph):
        weights = metropolis_hastings(cls().edges(m, 0, RNG))
        reports[cls.name] = check_pdsl_assumption(weights)
        assert (
            reports[cls.name]["symmetric"]
            and reports[cls.name]["doubly_stochastic"]
            and reports[cls.name]["self_loops"]
        )
        assert reports[cls.name]["lambda_1"] == pytest.approx(1.0)
    # Closed forms for MH weights: complete W = J/M (rho 0); K_{h,h} with weights
    # 1/(h+1) and W_ii = 1/(h+1) has lambda_min = (1-h)/(h+1); the ring (weights 1/3) has
    # lambda_2 = 1/3 + 2/3 cos(2 pi / M), which dominates |lambda_min| = 1/3 for even M.
    h = m // 2
    assert reports["complete"]["rho"] == pytest.approx(0.0, abs=1e-12)
    assert reports["bipartite"]["lambda_min"] == pytest.approx((1 - h) / (h + 1))
    assert reports["bipartite"]["rho"] == pytest.approx(((h - 1) / (h + 1)) ** 2)
    assert reports["ring"]["rho"] == pytest.approx((1 / 3 + 2 / 3 * np.cos(2 * np.pi / m)) ** 2)
    assert reports["complete"]["rho"] < reports["bipartite"]["rho"] < reports["ring"]["rho"] < 1


def test_report_degrees_and_omega_min():
    report = mixing_report(metropolis_hastings(BipartiteGraph().edges(7, 0, RNG)))
    # sides of 4 (degree 3) and 3 (degree 4): every edge weighs 1/(1 + 4)
    assert (report["degree_min"], report["degree_max"]) == (3, 4)
    assert report["degree_mean"] == pytest.approx((4 * 3 + 3 * 4) / 7)
    assert report["omega_min"] == pytest.approx(1 / 5)
    assert report["rho"] < 1


@pytest.mark.parametrize("m", [10, 7])
def test_bipartite_without_self_loops_fails_a3(m):
    adjacency = BipartiteGraph().edges(m, 0, RNG)
    uniform = adjacency / adjacency.sum(axis=1, keepdims=True)  # no self loops: periodic gossip
    assert mixing_report(uniform)["rho"] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="rho") as error:
        check_pdsl_assumption(uniform)
    assert error.value.field == "topology"
    check_pdsl_assumption(metropolis_hastings(adjacency))  # MH adds W_ii > 0: aperiodic


def test_disconnected_and_non_symmetric_weights_fail():
    with pytest.raises(ConfigError, match="rho"):
        check_pdsl_assumption(np.eye(4))  # four isolated clients
    row_stochastic = np.array([[0.5, 0.5, 0.0], [0.25, 0.5, 0.25], [0.0, 0.5, 0.5]])
    with pytest.raises(ConfigError, match="symmetric"):
        check_pdsl_assumption(row_stochastic)
