"""PDSL and DP-CGA on sparse graphs (issue 35): every agent holds K = max degree
neighbour slots, not one per client; the complete graph keeps its numbers, and the
cross-gradient release (one per agent and round, std scaled by sqrt(k_i)) is unchanged."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from p4bench import hookimpl
from p4bench.config import RunConfig
from p4bench.engine.state import vectorize
from p4bench.privacy.post_processing import run_check
from p4bench.privacy.replay import replaying
from p4bench.run.runner import run
from p4bench.topology import metropolis_hastings
from p4bench_baselines import cross_gradients as cg
from p4bench_baselines.neighbour_table import NeighbourTable


def _run(small_config, method, observers=(), **changes):
    options = (
        {"R": 3, **changes.pop("options", {})} if method == "pdsl" else changes.pop("options", {})
    )
    config = small_config(
        method=method, clients=changes.pop("clients", 5), rounds=3, options=options, **changes
    )
    return run(config, observers=list(observers), track=False)


def _flat(result) -> torch.Tensor:
    return vectorize(result.outcome.final_state["params"]).double()


# -- the table ----------------------------------------------------------------------------------------
def test_the_table_holds_each_neighbourhood_in_ascending_slots_padded_to_the_largest_degree():
    adjacency = np.zeros((5, 5), dtype=bool)  # a star around 0, and the edge 3-4
    for i, j in ((0, 1), (0, 2), (0, 3), (0, 4), (3, 4)):
        adjacency[i, j] = adjacency[j, i] = True
    weights = metropolis_hastings(adjacency)
    members = torch.from_numpy((weights > 0) | np.eye(5, dtype=bool))
    table = NeighbourTable.of(members, torch.from_numpy(weights))
    assert table.width == 5 and table.ids.shape == (5, 5)
    assert table.ids[0].tolist() == [0, 1, 2, 3, 4] and table.ids[3, :3].tolist() == [0, 3, 4]
    assert table.real.sum(1).tolist() == [5, 2, 2, 3, 3] and table.own.tolist() == [0, 1, 1, 1, 2]
    assert bool(
        (table.ids[~table.real] == torch.arange(5).unsqueeze(1).expand(5, 5)[~table.real]).all()
    )  # padding: self
    for i in range(5):
        ids = table.ids[i][table.real[i]]
        torch.testing.assert_close(
            table.weights[i][table.real[i]], torch.from_numpy(weights[i, ids.numpy()])
        )
        assert float(table.weights[i][~table.real[i]].abs().sum()) == 0.0
    # what peers claim to be is untrusted: non-neighbours and ids out of range find no slot
    slot, valid = table.slot_of(torch.tensor([3, 3, 3, 1, 1, 1]), torch.tensor([4, 0, 2, 0, 5, -1]))
    assert valid.tolist() == [True, True, False, True, False, False] and slot[:2].tolist() == [2, 0]


# -- state and messages -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["pdsl", "dp-cga"])
def test_state_on_a_ring_is_indexed_by_neighbour_slot(small_config, method):
    result = _run(small_config, method, clients=8, no_dp=True, options={"topology": "ring"})
    state, size = result.outcome.final_state, _flat(result).shape[1]
    assert state["cross"].shape == (8, 3, size) and state["models"].shape == (8, 3, size)
    assert 0.0 <= result.summary["accuracy_mean"] <= 1.0


def test_the_shapley_log_lists_each_agents_own_neighbours(small_config):
    result = _run(small_config, "pdsl", clients=7, no_dp=True, options={"topology": "bipartite"})
    members = result.method.neighbourhood.cpu().numpy()
    pairs = Counter((agent, neighbour) for _, agent, neighbour, _, _ in result.method.log)
    assert set(pairs) == {(i, j) for i, j in zip(*np.nonzero(members), strict=True)}
    assert set(pairs.values()) == {3}  # once per round


# -- numbers ------------------------------------------------------------------------------------------
# Final parameters (sum, sum of |.|) of the per-client implementation (state M x M x P), at
# 52e63ff: with K = M on the complete graph the slots are the clients, so every number is
# the same; without noise or random Shapley orders a sparse graph gives the same numbers too.
PREVIOUS = [
    ("pdsl", {}, {"epsilon": 4.0}, -3746.3266989588737, 35670.432367026806),
    (
        "pdsl",
        {"clip_mode": "per-example"},
        {"epsilon": 4.0},
        -9.830670281662606,
        292.53226715663914,
    ),
    ("dp-cga", {}, {"epsilon": 4.0}, -253.33511447161436, 8002.8628902211785),
    (
        "dp-cga",
        {"order": "atc", "anchor": "mean"},
        {"epsilon": 4.0},
        -190.91288164258003,
        13190.977593809366,
    ),
    (
        "pdsl",
        {"shapley": "exact", "topology": "ring"},
        {"no_dp": True},
        5.3448771183611825,
        320.3544084976311,
    ),
    ("dp-cga", {"topology": "ring"}, {"no_dp": True}, 5.344877349794842, 227.1128920285264),
    (
        "pdsl",
        {"shapley": "exact", "topology": "bipartite"},
        {"no_dp": True, "clients": 7},
        7.4828214882873,
        677.9938996204874,
    ),
]


@pytest.mark.parametrize(("method", "options", "changes", "total", "magnitude"), PREVIOUS)
def test_numbers_equal_the_per_client_implementation(
    small_config, method, options, changes, total, magnitude
):
    flat = _flat(_run(small_config, method, options=options, **changes))
    assert float(flat.sum()) == pytest.approx(total, rel=1e-6, abs=1e-6)
    assert float(flat.abs().sum()) == pytest.approx(magnitude, rel=1e-6)


# -- the release --------------------------------------------------------------------------------------
class _Spy:
    """Each cross-gradient release: its target's shape and the noise scale per agent; and
    the ledger's releases per (round, client)."""

    def __init__(self) -> None:
        self.shapes, self.scales, self.round, self.counts = [], [], 0, Counter()

    @hookimpl
    def privacy_release(self, run, release):
        for client in release.clients:
            self.counts[(self.round, client)] += release.steps

    @hookimpl
    def round_finished(self, run, report):
        self.round += 1


@pytest.mark.parametrize("method", ["pdsl", "dp-cga"])
@pytest.mark.parametrize(
    ("topology", "clients", "degrees"),
    [("ring", 6, [3] * 6), ("bipartite", 7, [4, 4, 4, 4, 5, 5, 5])],
)
def test_one_release_per_agent_and_round_with_std_scaled_by_its_own_degree(
    verify_full, small_config, monkeypatch, method, topology, clients, degrees
):
    spy = _Spy()

    class Recording(cg.Releases):
        def privatise(self, sums, scale):
            if not replaying():  # the run's own releases, not those of its verification replay
                spy.shapes.append(tuple(sums["g"].shape))
                spy.scales.append(scale.clone())
            return super().privatise(sums, scale)

    monkeypatch.setattr(cg, "Releases", Recording)
    result = _run(
        small_config,
        method,
        observers=[spy],
        clients=clients,
        epsilon=4.0,
        accountant="rdp",
        options={"topology": topology},
    )
    s, size = result.summary, _flat(result).shape[1]
    assert s["epsilon_certified"] and spy.counts == Counter(
        {(t, c): 1 for t in range(3) for c in range(clients)}
    )
    assert spy.shapes == [(clients, max(degrees) * size)] * 3  # K slots per agent, not M
    settings = result.method.dp_settings if method == "pdsl" else None
    expected = torch.tensor(
        degrees, dtype=torch.float64
    ).sqrt()  # batch clipping: sqrt(k_i) 2 C sigma / noise_std
    for scale in spy.scales:
        ratio = scale.double() / expected
        torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio))
        if settings is not None:
            std = cg.noise_std_per_coordinate(settings, "batch", degrees[0])
            assert float(scale[0]) * float(settings.noise_std) == pytest.approx(std)
    padded = result.outcome.final_state["cross"][torch.tensor(degrees) < max(degrees), -1]
    assert bool((padded == 0).all())  # padding holds no gradient, nor noise


@pytest.mark.parametrize("method", ["pdsl", "dp-cga"])
@pytest.mark.parametrize("topology", ["ring", "bipartite"])
def test_post_processing_check_passes_on_sparse_graphs(method, topology):
    result = run_check(
        RunConfig(method=method, epsilon=8.0, clients=5, options={"topology": topology}), run
    )
    assert result.status == "verified", result.findings
    assert result.releases > 0 and result.messages > 0


# -- gossip methods: messages by edge list ------------------------------------------------------------
@pytest.mark.parametrize("rows", [list(range(6)), [1, 4], [0, 2, 3, 5]])
def test_messages_along_edges_equal_those_of_the_support_matrix(rows):
    from p4bench.engine.method_kit import Edges, send_along

    support = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) < 0.4
    support[0, 1] = False
    support[:, 1] = False  # a sender without receivers
    index = torch.tensor(rows)
    payload = {
        "v": torch.arange(len(rows), dtype=torch.float32).unsqueeze(1) + 10 * index.unsqueeze(1)
    }
    dense, listed = (
        send_along(index, support, payload),
        send_along(index, Edges.of(support), payload),
    )
    assert torch.equal(dense.src, listed.src) and torch.equal(dense.dst, listed.dst)
    assert torch.equal(dense.value("v"), listed.value("v"))


@pytest.mark.parametrize("method", ["pdsl", "dp-cga"])
def test_the_bytes_runtime_agrees_on_a_graph_with_padded_slots(small_config, method):
    options = {"topology": "bipartite", **({"R": 3} if method == "pdsl" else {})}
    config = small_config(
        method=method,
        clients=5,
        rounds=2,
        noise_multiplier=1.0,
        noise_source="seeded",
        device_simulation=True,
        options=options,
    )
    simulated, carried = run(config, track=False), run(config.replace(runtime="bytes"), track=False)
    np.testing.assert_allclose(carried.outcome.accuracy, simulated.outcome.accuracy, atol=1e-6)
    torch.testing.assert_close(_flat(carried), _flat(simulated))
