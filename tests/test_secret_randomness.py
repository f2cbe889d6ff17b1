"""Secret per-client randomness (issue 14): where clients are separate parties, each
client's DP noise and Poisson batches come from its own secret source, so a peer that
holds the run config and seed cannot recompute a neighbour's noise or batches.

Every test also runs the seeded mode and shows it IS reproducible, so a secret path that
silently fell back to the seed would fail here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine.runtime import STREAM_TRAINING
from p4bench.engine.training import poisson_batches
from p4bench.errors import UsageError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.privacy.noise import NoiseStreams
from p4bench.rng import SecretRng, client_rng
from p4bench.run.runner import prepare, run
from p4bench_device.node import DeviceNode, peer_config

IDS = [0, 1, 2, 3]
FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}


def _membership(rng, n: torch.Tensor, rate: float) -> torch.Tensor:
    """(rows, max n) bool: which samples one Poisson batch draw selects."""
    index, mask = poisson_batches(rng, n, rate)
    chosen = torch.zeros(len(n), int(n.max()), dtype=torch.bool)
    return chosen.scatter_(1, index, mask)


@pytest.mark.parametrize("secret", [True, False])
def test_streams_are_secret_or_reproducible(secret):
    n = torch.tensor([300, 250, 280, 310])
    first, second = (
        client_rng(5, IDS, STREAM_TRAINING, secret),
        client_rng(5, IDS, STREAM_TRAINING, secret),
    )
    assert isinstance(first, SecretRng) == secret
    batches = [_membership(r, n, 0.2) for r in (first, second)]
    noises = [NoiseStreams(5, IDS, secure=secret).normal(2000).clone() for _ in range(2)]
    if secret:  # same seed and ids: independent draws
        assert not torch.equal(*batches) and not torch.equal(*noises)
        assert all(not torch.equal(batches[0][i], batches[1][i]) for i in range(len(IDS)))
    else:
        assert torch.equal(*batches) and torch.equal(*noises)
    # either way, draws with the right law: Poisson rate s, unit Gaussians, distinct rows
    assert abs(float(batches[0].sum()) / float(n.sum()) - 0.2) < 0.03
    assert abs(float(noises[0].mean())) < 0.05 and abs(float(noises[0].std()) - 1) < 0.05
    assert not torch.equal(noises[0][0], noises[0][1])


def test_secret_sub_streams_take_and_put():
    rng = SecretRng(4)
    rows = torch.tensor([1, 3])
    sub = rng.take(rows)
    picks, mask = sub.subsets(torch.tensor([10, 6]), torch.tensor([3, 6]), 6)
    rng.put(rows, sub)
    assert rng.calls.tolist() == [0, 1, 0, 1]
    assert sorted(picks[1].tolist()) == list(range(6)) and mask.sum(1).tolist() == [3, 6]
    assert len(set(picks[0, :3].tolist())) == 3 and int(picks[0, :3].max()) < 10
    u = rng.uniform(5000)
    assert u.shape == (4, 5000) and 0 < float(u.min()) and float(u.max()) < 1
    noise = NoiseStreams(0, IDS, secure=True)
    part = noise.take(torch.tensor([2, 0]))
    bias, weight = torch.empty(2, 3), torch.empty(2, 3, 4)
    part.fill([bias, weight])
    assert torch.isfinite(weight).all() and not torch.equal(weight[0], weight[1])


def _device_client(config: RunConfig, client: int):
    """The objects the device peer of `client` builds from the launcher's config
    (`run_session`): its group's training stream and DP noise streams."""
    config = peer_config(RunConfig(**config.to_dict()))
    prepared = prepare(config, Registry(create_plugin_manager()))
    peers = SimpleNamespace(
        peers=[SimpleNamespace(node=i, id=str(i)) for i in range(config.clients)]
    )
    node = DeviceNode(SimpleNamespace(node=client, id=str(client)), peers, transport=None)
    node.setup(prepared.job, prepared.ledger)
    (group,) = node.groups
    return group


@pytest.mark.parametrize("source", ["secure", "auto", "seeded"])
def test_a_peer_holding_the_run_config_cannot_reproduce_a_neighbours_noise(small_config, source):
    config = small_config(
        method="p4",
        clients=4,
        epsilon=8.0,
        runtime="device",
        noise_source=source,
        device_simulation=source == "seeded",
        options={"group_size": 2},
    )
    victim = _device_client(config, 1)
    assert victim.dp is not None  # a private run
    noise = victim.dp.noise.normal(512).clone()
    batch = _membership(victim.rng, victim.train.n, config.data_rate)
    # the peer next door rebuilds client 1's objects from the same config and seed
    guess = _device_client(config, 1)
    guessed_noise = guess.dp.noise.normal(512).clone()
    guessed_batch = _membership(guess.rng, guess.train.n, config.data_rate)
    if source == "seeded":  # the simulation mode: anyone can recompute it (so this test can fail)
        assert torch.equal(noise, guessed_noise) and torch.equal(batch, guessed_batch)
    else:
        assert not torch.equal(noise, guessed_noise) and not torch.equal(batch, guessed_batch)
        # subtracting the guess leaves noise of twice the variance: nothing cancels
        assert abs(float((noise - guessed_noise).std()) - 2**0.5) < 0.2
        assert isinstance(victim.rng, SecretRng) and victim.dp.noise.secure


def test_a_peer_refuses_seeded_randomness_unless_the_run_is_a_simulation(small_config):
    config = small_config(
        method="p4", clients=4, epsilon=8.0, runtime="device", noise_source="seeded"
    )
    with pytest.raises(UsageError, match="device-simulation"):
        peer_config(config)
    assert peer_config(config.replace(noise_source="auto")).noise_source == "secure"
    assert peer_config(config.replace(device_simulation=True)).noise_source == "seeded"


@pytest.mark.parametrize("source", ["secure", "auto"])
def test_simulation_is_secret_with_secure_noise_and_reproducible_by_default(small_config, source):
    runs = [
        run(
            small_config(
                method="p4",
                clients=4,
                rounds=1,
                local_steps=1,
                epsilon=8.0,
                noise_source=source,
                options={"group_size": 2},
            ),
            track=False,
        )
        for _ in range(2)
    ]
    first, second = (r.outcome.final_params for r in runs)
    if source == "secure":
        assert any(not torch.equal(first[k], second[k]) for k in first)
    else:  # auto is seeded in simulation: reproducible, not secret
        assert runs[0].info.config.noise_source == "seeded"
        assert all(torch.equal(first[k], second[k]) for k in first)


def _params(result) -> np.ndarray:
    params = result.outcome.final_params
    return np.concatenate(
        [params[k].reshape(len(params[k]), -1).numpy() for k in sorted(params)], axis=1
    )


def test_device_runs_with_one_seed_give_different_noise(small_config):
    """End to end on 3 local peers, private, the same seed twice: secret noise and
    batches by default on devices, so every client's model differs between the runs.
    (The seeded counterpart, a device run equal to the simulator, is
    tests/test_device_runtime.py::test_local_peers_match_the_simulator_and_log_to_mlflow.)"""
    # a given noise multiplier: the same DP path as --epsilon without calibrating on every peer
    config = small_config(
        method="p4",
        clients=3,
        rounds=1,
        local_steps=1,
        noise_multiplier=1.0,
        eval_fraction=0.0,
        seed=4,
        runtime="device",
        options={"group_size": 3, "device_local_peers": 3, **FAST},
    )
    runs = [run(config, track=False) for _ in range(2)]
    assert all(r.info.config.noise_source == "secure" for r in runs)  # auto, on devices
    first, second = _params(runs[0]), _params(runs[1])
    assert np.isfinite(first).all() and np.isfinite(second).all()
    assert (np.abs(first - second).max(axis=1) > 0).all()  # every client's model differs
