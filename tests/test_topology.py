"""Topologies and mixing matrices."""

from __future__ import annotations

import numpy as np
import pytest

from p4bench.errors import ConfigError, IncompatibleError, UnknownNameError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.topology import (
    CompleteGraph,
    EdgeListGraph,
    ErdosRenyiGraph,
    ExponentialGraph,
    RandomRegularGraph,
    RingGraph,
    TorusGraph,
    degree_stats,
    get_topology,
    is_connected,
    is_doubly_stochastic,
    is_row_stochastic,
    is_symmetric,
    metropolis_hastings,
    spectral_gap,
    torus_shape,
    uniform_averaging,
)

UNDIRECTED = [
    (CompleteGraph, {}, 7),
    (RingGraph, {}, 9),
    (TorusGraph, {}, 12),
    (TorusGraph, {}, 10),  # 2 x 5: degree 3
    (RandomRegularGraph, {"k": 3}, 16),
    (RandomRegularGraph, {}, 25),
    (ErdosRenyiGraph, {"p": 0.3}, 20),
    (ErdosRenyiGraph, {}, 40),
]


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch):
    monkeypatch.setenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_topologies_are_registered_with_attributes():
    registry = Registry(create_plugin_manager(autoload=False))
    names = {"complete", "ring", "torus", "k-regular", "erdos-renyi", "exponential", "edge-list"}
    assert set(registry.names("topology")) >= names
    for name in names:
        cls = registry.get("topology", name)
        assert cls.name == name and cls.description and isinstance(cls.time_varying, bool)
    assert registry.get("topology", "exponential").time_varying
    with pytest.raises(UnknownNameError, match="ring"):
        get_topology("star", registry=registry)


@pytest.mark.parametrize("cls,options,m", UNDIRECTED)
def test_undirected_graphs_are_symmetric_connected_and_mh_doubly_stochastic(cls, options, m, rng):
    adjacency = cls(options).edges(m, 0, rng)
    assert adjacency.dtype == bool and adjacency.shape == (m, m)
    assert not adjacency.diagonal().any()
    assert is_symmetric(adjacency) and is_connected(adjacency)
    weights = metropolis_hastings(adjacency)
    assert is_doubly_stochastic(weights)
    assert np.allclose(weights, weights.T)
    assert 0 < spectral_gap(weights) <= 1
    assert is_row_stochastic(uniform_averaging(adjacency))


def test_uniform_averaging_is_only_row_stochastic_on_irregular_graphs():
    star = np.zeros((5, 5), dtype=bool)
    star[0, 1:] = star[1:, 0] = True
    weights = uniform_averaging(star)
    assert is_row_stochastic(weights) and not is_doubly_stochastic(weights)
    assert is_doubly_stochastic(metropolis_hastings(star))
    # on a regular graph plain averaging happens to be doubly stochastic
    assert is_doubly_stochastic(
        uniform_averaging(RingGraph().edges(6, 0, np.random.default_rng(0)))
    )


def test_metropolis_hastings_refuses_directed_graphs():
    with pytest.raises(IncompatibleError):
        metropolis_hastings(ExponentialGraph().edges(8, 0, np.random.default_rng(0)))


def test_spectral_gap_values():
    complete = CompleteGraph().edges(5, 0, np.random.default_rng(0))
    assert spectral_gap(metropolis_hastings(complete)) == pytest.approx(1.0)  # W = J/M
    ring = metropolis_hastings(RingGraph().edges(10, 0, np.random.default_rng(0)))
    assert spectral_gap(ring) == pytest.approx((1 - np.cos(2 * np.pi / 10)) * 2 / 3)
    two_islands = np.zeros((4, 4), dtype=bool)
    two_islands[0, 1] = two_islands[1, 0] = two_islands[2, 3] = two_islands[3, 2] = True
    assert not is_connected(two_islands)
    assert spectral_gap(metropolis_hastings(two_islands)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("m", [2, 3, 5, 8, 9, 16, 17, 100])
def test_exponential_graph_follows_proxyfl_schedule(m):
    topology = ExponentialGraph()
    period = int(np.floor(np.log2(m - 1))) + 1
    for r in range(2 * period + 1):
        adjacency = topology.edges(m, r, np.random.default_rng(0))
        shift = 2 ** (r % period)
        for k in range(m):
            assert list(np.flatnonzero(adjacency[k])) == [(k + shift) % m]
        assert (adjacency.sum(axis=0) == 1).all()  # a permutation: one sender each
        assert is_doubly_stochastic(uniform_averaging(adjacency))
    # over one period the union of the rounds reaches everyone
    union = sum(topology.edges(m, r, None) for r in range(period)).astype(bool)
    assert is_connected(union)


def test_exponential_schedule_example_from_proxyfl():
    # N=8 -> hops [1, 2, 4]
    hops = [int(np.flatnonzero(ExponentialGraph().edges(8, r, None)[0])[0]) for r in range(4)]
    assert hops == [1, 2, 4, 1]


@pytest.mark.parametrize(
    "m,shape", [(9, (3, 3)), (12, (3, 4)), (16, (4, 4)), (20, (4, 5)), (100, (10, 10))]
)
def test_torus_is_4_regular_on_square_factorisation(m, shape, rng):
    assert torus_shape(m) == shape
    adjacency = TorusGraph().edges(m, 0, rng)
    assert (adjacency.sum(axis=1) == 4).all() and (adjacency.sum(axis=0) == 4).all()
    assert is_connected(adjacency)


def test_torus_options_and_prime_error(rng):
    adjacency = TorusGraph({"rows": 3, "cols": 8}).edges(24, 0, rng)
    assert (adjacency.sum(axis=1) == 4).all()
    with pytest.raises(ConfigError, match="prime"):
        TorusGraph().edges(13, 0, rng)
    with pytest.raises(ConfigError, match="rows x cols"):
        TorusGraph({"rows": 5}).edges(24, 0, rng)


@pytest.mark.parametrize("m,k", [(10, 2), (10, 3), (20, 4), (31, 6), (12, 11)])
def test_k_regular_degrees_and_connected(m, k, rng):
    adjacency = RandomRegularGraph({"k": k}).edges(m, 0, rng)
    assert is_symmetric(adjacency) and not adjacency.diagonal().any()
    assert (adjacency.sum(axis=1) == k).all()
    assert is_connected(adjacency)


def test_k_regular_is_random_but_reproducible():
    a = RandomRegularGraph({"k": 4}).edges(30, 0, np.random.default_rng(7))
    b = RandomRegularGraph({"k": 4}).edges(30, 0, np.random.default_rng(7))
    c = RandomRegularGraph({"k": 4}).edges(30, 0, np.random.default_rng(8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_k_regular_rejects_impossible_degrees(rng):
    with pytest.raises(ConfigError, match="even"):
        RandomRegularGraph({"k": 3}).edges(11, 0, rng)
    with pytest.raises(ConfigError, match="options.k"):
        RandomRegularGraph({"k": 12}).edges(12, 0, rng)
    with pytest.raises(ConfigError, match="unknown option"):
        RandomRegularGraph({"degree": 3})


def test_erdos_renyi_density_and_failure(rng):
    adjacency = ErdosRenyiGraph({"p": 0.5}).edges(60, 0, rng)
    density = adjacency.sum() / (60 * 59)
    assert 0.4 < density < 0.6
    with pytest.raises(ConfigError, match="raise p"):
        ErdosRenyiGraph({"p": 0.01, "max_tries": 3}).edges(50, 0, rng)
    assert ErdosRenyiGraph({"resample": True}).time_varying and not ErdosRenyiGraph().time_varying


def test_edge_list_from_file(tmp_path, rng):
    path = tmp_path / "graph.txt"
    path.write_text(
        "# a path 0-1-2 and a triangle 2-3-4\n0 1\n1 2   # trailing comment\n\n2 3\n3 4\n4 2\n"
    )
    adjacency = EdgeListGraph({"path": str(path)}).edges(5, 0, rng)
    assert is_symmetric(adjacency) and is_connected(adjacency)
    assert degree_stats(adjacency) == {
        "out_min": 1,
        "out_mean": 2.0,
        "out_max": 3,
        "in_min": 1,
        "in_mean": 2.0,
        "in_max": 3,
    }
    directed = EdgeListGraph({"path": str(path), "directed": True}).edges(5, 0, rng)
    assert directed.sum() == 5 and directed[0, 1] and not directed[1, 0]
    assert is_doubly_stochastic(metropolis_hastings(adjacency))


def test_edge_list_errors(tmp_path, rng):
    with pytest.raises(ConfigError, match="path"):
        EdgeListGraph({})
    with pytest.raises(ConfigError, match="cannot read"):
        EdgeListGraph({"path": str(tmp_path / "missing.txt")}).edges(3, 0, rng)
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1\n1 two\n")
    with pytest.raises(ConfigError, match=":2:"):
        EdgeListGraph({"path": str(bad)}).edges(3, 0, rng)
    small = tmp_path / "small.txt"
    small.write_text("0 7\n")
    with pytest.raises(ConfigError, match="client 7"):
        EdgeListGraph({"path": str(small)}).edges(5, 0, rng)
