"""p2p-fl (Karras et al. Alg. 2-3): the LocalAverage policies, the validation split,
relay vs mesh, DP accounting per sender, the CLI, runtime equality and the kit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from p4bench.cli import main
from p4bench.data import ClientTensors
from p4bench.engine.messages import Messages, encode
from p4bench.privacy.accountants import RDPAccountant, ReleaseSegment, accounted_epsilon
from p4bench.rng import SERVER_ID, node_keys
from p4bench.run.runner import run
from p4bench.testing import check_method
from p4bench_p2p_fl.method import MODEL, ORIGIN
from p4bench_p2p_fl.policies import policy_weights, validation_split

FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}
# four candidates per receiver; receiver 0 owns column 0, receiver 1 column 2
ACC = torch.tensor([[0.5, 0.9, 0.1, 0.7], [0.2, 0.4, 0.6, 0.8]], dtype=torch.float64)
LOSS = torch.tensor([[1.0, 0.2, 2.0, 0.5], [1.5, 1.0, 0.7, 0.3]], dtype=torch.float64)
OWN = torch.tensor([0, 2])
ALL = torch.ones(2, 4, dtype=torch.bool)


def _weights(policy, present=ALL, **kw):
    return policy_weights(policy, ACC, LOSS, present, OWN, **kw)


# -- the policies --------------------------------------------------------------------------------
def test_uniform_weights_are_equal_over_received_models():
    present = torch.tensor([[True, True, False, True], [True, False, True, False]])
    w = _weights("uniform", present)
    assert torch.allclose(w, present.double() / present.sum(1, keepdim=True))


def test_acc_weighted_is_proportional_to_accuracy():
    assert torch.allclose(_weights("acc-weighted"), ACC / ACC.sum(1, keepdim=True))


def test_softmax_loss_weights():
    tau = 0.5
    assert torch.allclose(_weights("softmax-loss", tau=tau), torch.softmax(-LOSS / tau, dim=1))


def test_top_k_keeps_the_k_best_and_the_own_model():
    w = _weights("top-k", top_k=2)
    # receiver 0: best are columns 1 (0.9) and 3 (0.7), plus own column 0; receiver 1: 3 and 2 (own among them)
    assert torch.equal(w > 0, torch.tensor([[True, True, False, True], [False, False, True, True]]))
    assert torch.allclose(w.sum(1), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(w[0, [0, 1, 3]], torch.full((3,), 1 / 3, dtype=torch.float64))


def test_threshold_drops_peers_scoring_below_the_own_model():
    w = _weights("threshold")
    assert torch.equal(w > 0, torch.tensor([[True, True, False, True], [False, False, True, True]]))


def test_missing_scores_fall_back_to_uniform():
    nan = torch.full_like(ACC, math.nan)
    for policy in ("acc-weighted", "top-k", "threshold", "softmax-loss"):
        w = policy_weights(policy, nan, nan, ALL, OWN)
        assert torch.allclose(w, torch.full_like(w, 0.25)), policy


# -- the validation split ----------------------------------------------------------------------------
def test_validation_split_is_disjoint_and_independent_of_padding():
    x = torch.arange(2 * 50, dtype=torch.float32).reshape(2, 50, 1)
    data = ClientTensors(x, torch.zeros(2, 50, dtype=torch.long), torch.tensor([50, 30]))
    keys = node_keys(3, [0, 1])
    fit, val = validation_split(data, keys, 0.3)
    assert torch.equal(fit.n + val.n, data.n) and bool((val.n > 0).all())
    for i in range(2):
        seen = torch.cat([fit.x[i, : fit.n[i], 0], val.x[i, : val.n[i], 0]])
        assert torch.equal(
            seen.sort().values, x[i, : data.n[i], 0]
        )  # every record once, in one split
    # client 1 alone (no padding to 50) gets the same split
    alone = ClientTensors(x[1:, :30], data.y[1:, :30], data.n[1:])
    fit1, val1 = validation_split(alone, keys[1:], 0.3)
    assert torch.equal(val1.x[0, : val1.n[0]], val.x[1, : val.n[1]])


# -- relay and mesh -------------------------------------------------------------------------------------
def _config(small_config, **changes):
    base = dict(method="p2p-fl", clients=4, rounds=3, local_steps=2, eval_fraction=0.0, seed=5)
    return small_config(**{**base, **changes})


def _params(result) -> np.ndarray:
    params = result.outcome.final_params
    return np.concatenate(
        [params[k].reshape(len(params[k]), -1).numpy() for k in sorted(params)], axis=1
    )


def test_relay_and_mesh_train_the_same_models_with_their_own_traffic(small_config):
    relay = run(_config(small_config, options={"exchange": "relay"}), track=False)
    mesh = run(_config(small_config, options={"exchange": "mesh"}), track=False)
    np.testing.assert_allclose(_params(relay), _params(mesh), atol=1e-6)
    np.testing.assert_allclose(relay.outcome.accuracy, mesh.outcome.accuracy)
    clients, size = 4, relay.info.num_parameters
    vector = torch.zeros(1, size)

    def frame(exchange, src, dst, **extra):
        return len(
            encode(
                exchange,
                1,
                Messages(torch.tensor([src]), torch.tensor([dst]), {MODEL: vector, **extra}),
            )
        )

    relayed = frame("relay", SERVER_ID, 0, **{ORIGIN: torch.zeros(1, dtype=torch.long)})
    per_round = {  # round 0 trains from the common model: no exchange
        "relay": clients * frame("upload", 0, SERVER_ID) + clients * clients * relayed,
        "mesh": clients * (clients - 1) * frame("share", 1, 0),
    }
    for name, result in (("relay", relay), ("mesh", mesh)):
        assert [r.bytes_sent for r in result.outcome.reports] == [
            0,
            per_round[name],
            per_round[name],
        ], name
    assert (
        relay.info.config.clients == clients
        and relay.summary["bytes_sent"] > mesh.summary["bytes_sent"]
    )


def test_validation_accuracies_are_reported_per_round_and_written(small_config, tmp_path):
    result = run(_config(small_config, options={"policy": "top-k", "top_k": 1}), track=False)
    for report in result.outcome.reports:
        assert set(report.extra_accuracy) == {"prefit_val", "postfit_val"}
        assert 0.0 <= report.metrics["accuracy_postfit_val_mean"] <= 1.0
    assert result.summary["accuracy_prefit_val_mean"] <= 1.0
    files = result.write_method_artifacts(tmp_path)
    rows = (tmp_path / "p2p_validation.csv").read_text().strip().splitlines()
    assert [f.name for f in files] == ["p2p_validation.csv", "p2p_weights.csv"] and len(
        rows
    ) == 1 + 4 * 3
    weights = np.loadtxt(tmp_path / "p2p_weights.csv", delimiter=",", skiprows=1)[:, 1:]
    np.testing.assert_allclose(weights.sum(1), 1.0)
    assert ((weights > 0).sum(1) <= 2).all()  # top-1 plus the own model


# -- differential privacy ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, scored", [("acc-weighted", True), ("uniform", False)])
def test_dp_run_certifies_epsilon_per_sender_with_c_minus_1_receivers(
    verify_full, small_config, policy, scored
):
    result = run(
        _config(small_config, epsilon=4.0, accountant="rdp", options={"policy": policy}),
        track=False,
    )
    s = result.summary
    assert s["private"] and s["epsilon_certified"] and s["uncertified_reason"] is None
    assert s["receivers_per_release"] == 3 and s["clients_stopped"] == 0
    # every client: K steps in each of T rounds, plus one score release per round >= 1 when the policy reads scores
    steps = 2 * 3 + (3 - 1 if scored else 0)
    history = [ReleaseSegment(s["noise_multiplier"], result.info.config.data_rate, steps)]
    expected = accounted_epsilon(RDPAccountant(), history, s["delta"], s["neighbouring"])
    assert s["epsilon"] == pytest.approx(expected) and s["epsilon"] <= 4.0 + 0.05


# -- command line, runtimes, conformance -------------------------------------------------------------------
def test_cli_runs_p2p_fl_with_a_policy(capsys, results_dir):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "p2p-fl",
                "--clients",
                "4",
                "--rounds",
                "2",
                "--local-steps",
                "2",
                "--results-dir",
                results_dir,
                "--json",
                "-o",
                "policy=acc-weighted",
            ]
        )
    out, _ = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert (
        (info.value.code or 0) == 0 and summary["method"] == "p2p-fl" and summary["epsilon"] is None
    )
    assert (
        0.0 < summary["accuracy_mean"] <= 1.0 and summary["accuracy_min"] <= summary["accuracy_max"]
    )


@pytest.mark.parametrize("exchange", ["relay", "mesh"])
def test_simulation_bytes_and_device_agree(small_config, exchange):
    options = {"exchange": exchange}
    config = _config(
        small_config,
        rounds=2,
        noise_multiplier=1.0,
        noise_source="seeded",
        device_simulation=True,
        options=options,
    )
    results = {
        "simulation": run(config, track=False),
        "bytes": run(config.replace(runtime="bytes"), track=False),
        "device": run(
            config.replace(runtime="device", options={**options, "device_local_peers": 4, **FAST}),
            track=False,
        ),
    }
    simulated = results["simulation"]
    for name, result in results.items():
        assert not result.summary.get("device", {}).get("dropped"), name
        np.testing.assert_allclose(
            result.outcome.accuracy, simulated.outcome.accuracy, atol=1e-4, err_msg=name
        )
        np.testing.assert_allclose(_params(result), _params(simulated), atol=1e-4, err_msg=name)
        for key in ("prefit_val", "postfit_val"):
            np.testing.assert_allclose(
                result.outcome.extra_accuracy[key], simulated.outcome.extra_accuracy[key], atol=1e-4
            )
        assert result.summary["client_bytes_sent"] == simulated.summary["client_bytes_sent"], name
        assert result.summary["epsilon"] == pytest.approx(simulated.summary["epsilon"]), name


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize("options", [{}, {"exchange": "mesh", "policy": "softmax-loss"}])
def test_p2p_fl_conforms(options):
    check_method("p2p-fl", options=options)


def test_table_ii_adam_with_per_epoch_decay_is_an_option_and_sgd_stays_the_default(small_config):
    base = dict(method="p2p-fl", clients=4, rounds=2, eval_fraction=0.0, lr=5e-3)
    plain = run(small_config(**base), track=False).summary
    explicit = run(
        small_config(**base, options={"optimizer": "sgd", "lr_decay": 1.0}), track=False
    ).summary
    assert (
        plain["accuracy_per_client"] == explicit["accuracy_per_client"]
    )  # the default path unchanged
    adam = run(
        small_config(**base, options={"optimizer": "adam", "lr_decay": 0.995, "epochs": 2}),
        track=False,
    ).summary
    assert adam["accuracy_per_client"] != plain["accuracy_per_client"]
    assert all(0.0 <= a <= 1.0 for a in adam["accuracy_per_client"].values())
