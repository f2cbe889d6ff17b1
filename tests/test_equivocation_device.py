"""Equivocation on the device runtime: with one node per peer process over TLS, the
check's two exchanges travel as the method's do, and the equivocator is named as in the
simulator (the same counts, the same per-client accuracies without DP)."""

from __future__ import annotations

import json

import pytest

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.run.runner import run

SIZES = ["--clients", "4", "--rounds", "2", "--local-steps", "2", "--seed", "3"]
ATTACK = ["--attack", "equivocate", "--malicious-fraction", "0.25"]


def test_local_peers_name_the_equivocator_as_the_simulator_does(capsys, tmp_path):
    args = ["run", "--method", "dp-dsgd", "--topology", "ring", "--no-dp", *SIZES, *ATTACK]
    args += ["--eval-fraction", "0", "--local-peers", "4", "--results-dir", str(tmp_path), "--json"]
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err[-3000:]
    device = json.loads(out.strip().splitlines()[-1])
    simulated = run(
        RunConfig(
            method="dp-dsgd",
            no_dp=True,
            clients=4,
            rounds=2,
            local_steps=2,
            seed=3,
            eval_fraction=0.0,
            attack="equivocate",
            malicious_fraction=0.25,
            options={"topology": "ring"},
            results_dir=str(tmp_path),
        ),
        track=False,
    ).summary
    # one attacker, named for each of its messages to its 2 ring neighbours in 2 x 2 gossips
    assert len(simulated["rejections"]) == 1
    assert list(simulated["rejections"].values()) == [8]
    assert device["rejections"] == simulated["rejections"]
    assert device["bytes_sent"] == simulated["bytes_sent"]
    for client, accuracy in simulated["accuracy_per_client"].items():
        assert abs(device["accuracy_per_client"][client] - accuracy) <= 1e-6
