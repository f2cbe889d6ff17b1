"""One round driver, three networks: the simulator (in-process, all clients batched), the
bytes runtime (one client per group, every message serialised) and the device runtime
(one peer process per client over TLS on 127.0.0.1) give the same private run."""

from __future__ import annotations

import numpy as np
import pytest

from p4bench.run.runner import run

FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}
METHODS = {"p4": {"group_size": 2}, "fedavg": {}, "proxyfl": {}, "dp-dsgt": {"topology": "ring"}}


def _params(result) -> np.ndarray:
    params = result.outcome.final_params
    return np.concatenate(
        [params[k].reshape(len(params[k]), -1).numpy() for k in sorted(params)], axis=1
    )


@pytest.mark.parametrize("method", sorted(METHODS))
def test_simulator_bytes_and_device_runs_agree_with_dp(small_config, method):
    # seeded DP randomness so that the runs can agree: on devices only as a marked simulation
    config = small_config(
        method=method,
        clients=4,
        rounds=2,
        local_steps=2,
        eval_fraction=0.0,
        seed=7,
        noise_multiplier=1.0,
        noise_source="seeded",
        device_simulation=True,
        options=METHODS[method],
    )
    results = {
        "simulation": run(config, track=False),
        "bytes": run(config.replace(runtime="bytes"), track=False),
        "device": run(
            config.replace(
                runtime="device", options={**METHODS[method], "device_local_peers": 4, **FAST}
            ),
            track=False,
        ),
    }
    simulated = results["simulation"]
    assert simulated.summary["private"] and simulated.outcome.reports  # a private run that trained
    for name, result in results.items():
        assert not result.summary.get("device", {}).get("dropped"), name
        np.testing.assert_allclose(
            result.outcome.accuracy, simulated.outcome.accuracy, atol=1e-4, err_msg=name
        )
        np.testing.assert_allclose(_params(result), _params(simulated), atol=1e-4, err_msg=name)
        assert result.summary["client_bytes_sent"] == simulated.summary["client_bytes_sent"], name
        assert result.summary["epsilon"] == pytest.approx(simulated.summary["epsilon"]), name
