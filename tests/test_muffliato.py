"""Muffliato: runs private on ring and complete graphs, K = 0 is local noisy SGD, more (and
Chebyshev-accelerated) gossip brings the nodes closer to consensus, the ledger certifies
the target epsilon, and the conformance kit passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p4bench.errors import ConfigError
from p4bench.run.runner import run
from p4bench.testing import check_method
from p4bench.topology import RingGraph, metropolis_hastings, spectral_gap
from p4bench_baselines.muffliato import chebyshev_weights


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny kernels: one thread avoids contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _spread(params) -> float:
    """Mean distance of the nodes' models to their mean model."""
    flat = torch.cat([v.double().flatten(start_dim=1) for _, v in sorted(params.items())], dim=1)
    return float((flat - flat.mean(0)).norm(dim=1).mean())


@pytest.mark.parametrize("topology", ["ring", "complete"])
def test_runs_private_and_the_ledger_certifies_epsilon(small_config, topology):
    result = run(
        small_config(method="muffliato", rounds=4, epsilon=2.0, options={"topology": topology}),
        track=False,
    )
    summary = result.summary
    assert summary["private"] and 0 < summary["epsilon"] <= 2.0 and summary["clients_stopped"] == 0
    assert summary["accuracy_mean"] > 0.3  # digits, 10 classes
    assert summary["receivers_per_release"] == (2 if topology == "ring" else 7)
    assert "local DP" in summary["amplification"]  # network DP beside it, never in its place
    assert summary["network_dp"].startswith("pairwise")
    assert summary["epsilon_network_max"] <= summary["epsilon"] + 1e-9
    assert result.outcome.bytes_sent > 0


def test_default_is_private(small_config):
    result = run(small_config(method="muffliato", rounds=1), track=False)
    assert result.summary["private"] and result.summary["epsilon"] <= 8.0


@pytest.mark.parametrize("private", [True, False])
def test_no_gossip_is_local_noisy_sgd(small_config, private):
    """K = 0: no message, and the same batches, noise and steps as `local` (same seed)."""
    extra = {"epsilon": 4.0} if private else {"no_dp": True}
    local = run(small_config(method="local", clients=6, **extra), track=False)
    muff = run(
        small_config(method="muffliato", clients=6, options={"gossip_steps": 0}, **extra),
        track=False,
    )
    assert muff.outcome.bytes_sent == 0
    for key, value in local.outcome.final_params.items():
        assert torch.equal(value, muff.outcome.final_params[key]), key
    if private:
        assert muff.summary["epsilon"] == local.summary["epsilon"] <= 4.0


def test_one_gossip_step_is_dp_dsgd_half_a_step_later(small_config):
    """K = 1 is adapt-then-combine DSGD; dp-dsgd (combine-then-adapt) follows the same
    trajectory half an iteration earlier: W x_dsgd = x_muffliato, same noise (docs/dp-dpsgd.md)."""
    from p4bench.engine.method_kit import GraphSchedule
    from p4bench.engine.state import vectorize
    from p4bench_baselines.dsgt import mixing_matrix

    base = dict(
        clients=6, epsilon=4.0, partitioner="alpha", similarity=0.0, options={"topology": "ring"}
    )
    dsgd = run(small_config(method="dp-dsgd", **base), track=False)
    muff = run(small_config(method="muffliato", **base), track=False)
    w = torch.from_numpy(
        mixing_matrix(GraphSchedule("ring", None, 6, 1).adjacency(0), "metropolis")
    )
    x_dsgd, x_muff = (
        vectorize(dsgd.outcome.final_params).double(),
        vectorize(muff.outcome.final_params).double(),
    )
    assert torch.allclose(w @ x_dsgd, x_muff, atol=1e-6)
    assert not torch.allclose(x_dsgd, x_muff, atol=1e-3)
    assert dsgd.summary["epsilon"] == muff.summary["epsilon"]


def test_more_gossip_brings_nodes_closer_to_consensus(small_config):
    spreads = {}
    for label, options in (
        ("K0", {"gossip_steps": 0}),
        ("K1", {"gossip_steps": 1}),
        ("K4", {"gossip_steps": 4}),
        ("K4-cheb", {"gossip_steps": 4, "chebyshev": True}),
    ):
        config = small_config(
            method="muffliato",
            clients=10,
            rounds=3,
            epsilon=4.0,
            partitioner="alpha",
            similarity=0.0,
            options={"topology": "ring", **options},
        )
        spreads[label] = _spread(run(config, track=False).outcome.final_params)
    assert spreads["K0"] > spreads["K1"] > spreads["K4"] > spreads["K4-cheb"], spreads


def test_chebyshev_recursion_is_the_scaled_chebyshev_polynomial():
    """x^K of the recursion equals T_K(W/lam) x / T_K(1/lam): the average is kept and the
    disagreement shrinks by 1/T_K(1/lam), faster than lam^K of plain gossip."""
    w = metropolis_hastings(RingGraph().edges(12, 0, np.random.default_rng(0)))
    lam, steps = 1.0 - spectral_gap(w), 6
    x0 = np.random.default_rng(1).normal(size=(12, 3))
    previous, current = x0, x0
    for k, omega in enumerate(chebyshev_weights(lam, steps)):
        previous, current = current, omega * (w @ current) + (1 - omega) * (previous if k else 0)
    # T_K(W / lam) by the three-term recurrence on matrices
    t_prev, t_cur = np.eye(12), w / lam
    for _ in range(steps - 1):
        t_prev, t_cur = t_cur, 2 * (w / lam) @ t_cur - t_prev
    expected = t_cur @ x0 / np.cosh(steps * np.arccosh(1 / lam))
    assert np.allclose(current, expected)
    assert np.allclose(current.mean(0), x0.mean(0))
    plain = np.linalg.matrix_power(w, steps) @ x0
    assert np.linalg.norm(current - x0.mean(0)) < np.linalg.norm(plain - x0.mean(0))
    assert chebyshev_weights(0.0, 3) == [1.0, 1.0, 1.0]  # W averages exactly: plain gossip


def test_chebyshev_needs_an_undirected_graph(small_config):
    with pytest.raises(ConfigError, match="chebyshev"):
        run(
            small_config(
                method="muffliato", options={"topology": "exponential", "chebyshev": True}
            ),
            track=False,
        )


@pytest.mark.parametrize("options", [{"topology": "ring", "gossip_steps": 2, "chebyshev": True}])
def test_muffliato_conforms(options):
    check_method("muffliato", options=options)
