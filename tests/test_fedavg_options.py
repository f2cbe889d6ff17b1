"""FedAvg's client sampling (P4L's FL baseline): power-law selection, non-private only."""

from __future__ import annotations

import pytest
import torch

from p4bench.errors import UsageError
from p4bench.rng import ClientRng, node_keys
from p4bench.run.runner import run
from p4bench_baselines.fedavg import select_clients


def test_power_law_client_sampling_favours_high_ids_and_refuses_dp(small_config):
    rng = ClientRng(node_keys(0, torch.tensor([-1])))
    counts = torch.zeros(10)
    for _ in range(400):
        picked = select_clients(10, 2, "powerlaw", rng)
        assert int(picked.sum()) == 2
        counts += picked
    # weights F((i+1)/10) - F(i/10), F(x) = x^2: clients 7-9 hold 51% of the weight, 0-2 hold 9%
    assert counts[7:].sum() > 3 * counts[:3].sum()
    uniform = sum(select_clients(10, 2, "uniform", rng).float() for _ in range(400))
    assert uniform[7:].sum() < 1.5 * uniform[:3].sum()
    config = small_config(
        method="fedavg",
        clients=10,
        rounds=2,
        client_rate=0.2,
        eval_fraction=0.0,
        options={"client_sampling": "powerlaw"},
    )
    assert run(config, track=False).summary["rounds_completed"] == 2
    with pytest.raises(UsageError, match="non-private runs"):
        run(config.replace(epsilon=8.0, no_dp=False), track=False)
