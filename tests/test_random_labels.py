"""The random-labels attack (Karras et al.'s noisy clients): uniform labels on the
malicious clients only, the same labels in every runtime, accepted by every method."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.rng import ClientRng, node_keys
from p4bench.run.runner import prepare
from p4bench.testing import check_attack
from p4bench_attacks.random_labels import RandomLabels


def trained_labels(
    config: RunConfig,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], np.ndarray]:
    """(labels each client trained on, its true labels, malicious mask) after one round."""
    prepared = prepare(config, Registry(create_plugin_manager()))
    prepared.runtime.execute(prepared.job, lambda report: None)
    trained = {}
    for group in prepared.runtime.driver.groups:
        for position, client in enumerate(group.rows.tolist()):
            trained[client] = group.train.y[position, : int(group.train.n[position])]
    train = prepared.job.data.train
    truth = {c: train.y[c, : int(train.n[c])] for c in range(train.y.shape[0])}
    return trained, truth, prepared.info.malicious


def config(**changes) -> RunConfig:
    base = dict(
        method="fedavg",
        attack="random-labels",
        malicious_fraction=0.25,
        clients=12,
        rounds=1,
        local_steps=1,
        seed=3,
    )
    return RunConfig(**{**base, **changes})


def test_malicious_clients_get_uniform_labels_and_honest_ones_keep_theirs():
    trained, truth, malicious = trained_labels(config())
    assert malicious.sum() == 3
    for client in np.flatnonzero(~malicious):
        assert torch.equal(trained[client], truth[client])
    poisoned = torch.cat([trained[c] for c in np.flatnonzero(malicious)])
    original = torch.cat([truth[c] for c in np.flatnonzero(malicious)])
    counts = torch.bincount(poisoned, minlength=10).double()
    expected = len(poisoned) / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9  # chi-square with 9 degrees of freedom: p = 0.001
    kept = float(
        (poisoned == original).double().mean()
    )  # a random label equals the true one w.p. 1/10
    assert 0.02 < kept < 0.2


def test_same_labels_under_simulation_and_bytes():
    simulated, truth, malicious = trained_labels(config())
    assert any(not torch.equal(simulated[c], truth[c]) for c in np.flatnonzero(malicious))
    separate, _, _ = trained_labels(config(runtime="bytes"))
    assert simulated.keys() == separate.keys()
    for client in simulated:
        assert torch.equal(simulated[client], separate[client]), client


def test_padding_is_kept_and_rows_do_not_depend_on_each_other():
    attack = RandomLabels(RunConfig(attack="random-labels"), 10)
    labels = torch.tensor([[1, 2, 3, -1], [4, 5, 6, 7]])
    both = attack.poison_labels(labels, rng=ClientRng(node_keys(0, [5, 9], 2)))
    assert both[0, 3] == -1 and ((both >= -1) & (both < 10)).all()
    alone = attack.poison_labels(labels[1:, :3], rng=ClientRng(node_keys(0, [9], 2)))
    assert torch.equal(alone[0], both[1, :3])  # a client's labels: its own stream, any padded width
    with pytest.raises(ValueError, match="rng"):
        attack.poison_labels(labels)


def test_conforms_and_is_accepted_by_every_method():
    check_attack("random-labels", checks=("labels", "needs"), methods=("fedavg", "local"))


def test_cli_run_with_random_labels(capsys, results_dir):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "fedavg",
                "--attack",
                "random-labels",
                "--malicious-fraction",
                "0.25",
                "--clients",
                "8",
                "--rounds",
                "2",
                "--results-dir",
                results_dir,
                "--json",
            ]
        )
    assert (info.value.code or 0) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["attack"] == "random-labels" and summary["reported_clients"] < 8
    assert np.isfinite(summary["accuracy_mean"])
