"""The method-level audit (#29): canary records through the whole method, read from the
messages a curious neighbour receives. Planted leaks are flagged, honest runs at the
same settings are not, and bad input gets one clear line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from p4bench.audit.method_level import run_method_audit
from p4bench.audit.observer import MessageScores
from p4bench.audit.records import RecordCanaries
from p4bench.cli import main
from p4bench.data.federated import ClientTensors, FederatedData
from p4bench.engine.messages import Messages
from p4bench.errors import IncompatibleError, UsageError
from p4bench.host.manager import create_plugin_manager
from p4bench.testing.audit_faults import FAULTY_METHODS, unclipped

# A claim the few canaries of these small runs can refute: their one-run ceiling (3.9 at
# 8 clients x 30 canaries) is above it.
CLAIM = 1.0


def audit(small_config, **kwargs):
    settings = dict(
        clients=8, rounds=3, local_steps=5, epsilon=CLAIM
    )  # 15 steps: nearly every canary is sampled
    settings.update(kwargs.pop("config", {}))
    pm = create_plugin_manager()
    pm.register(FAULTY_METHODS)
    return run_method_audit(
        small_config(**settings),
        canaries_per_client=kwargs.pop("canaries", 30),
        track=False,
        plugin_manager=pm,
        **kwargs,
    )


# -- the canaries and the observer, alone -----------------------------------------------
def tiny_data(clients=3, classes=4, n=5) -> FederatedData:
    x = torch.rand(clients, n, 1, 2, 2)
    y = torch.randint(0, classes, (clients, n))
    tensors = ClientTensors(x, y, torch.full((clients,), n))
    return FederatedData(
        tensors,
        tensors,
        torch.zeros(clients, dtype=torch.bool),
        classes,
        (1, 2, 2),
        tuple(map(str, range(classes))),
        tuple(np.arange(n) for _ in range(clients)),
    )


@pytest.mark.parametrize("neighbouring", ["add-remove", "replace-one"])
def test_canary_records_and_their_probes_are_planted_in_their_own_marker_columns(neighbouring):
    canaries = RecordCanaries(
        3, 2, 4, seed=5, clip=1.0, neighbouring=neighbouring, probes=2, probe_scale=0.5
    )
    data, _ = canaries.transform(tiny_data(), None)
    assert (
        data.feature_shape == (4 + 6,)
        and data.train.x.shape[2] == 10
        and data.test.x.shape[2] == 10
    )
    assert torch.all(data.test.x[:, :, 4:] == 0) and torch.all(
        data.train.x[:, :5, 4:] == 0
    )  # real records: no marker
    labels = np.stack([canaries.label, canaries.other, canaries.probe], axis=-1)
    assert all(len(set(row)) == 3 for row in labels.reshape(-1, 3))  # c, c', l distinct
    for i in range(3):
        for k in range(2):
            column = 4 + canaries.columns[i, k]
            rows = data.train.x[i, : int(data.train.n[i]), column] != 0
            ys = data.train.y[i, : int(data.train.n[i])][rows].tolist()
            values = data.train.x[i, : int(data.train.n[i]), column][rows].tolist()
            assert (
                ys.count(int(canaries.probe[i, k])) == 2 and values.count(5.0) == 2
            )  # the probes, at half scale
            has_canary = int(canaries.label[i, k]) in ys
            assert has_canary == bool(canaries.included[i, k])
            assert (int(canaries.other[i, k]) in ys) == (
                neighbouring == "replace-one" and not canaries.included[i, k]
            )
            assert torch.all(
                data.train.x[[j for j in range(3) if j != i], :, column] == 0
            )  # only client i's records


def test_message_scores_read_the_marker_column_of_the_sender():
    canaries = RecordCanaries(2, 1, 3, seed=0, clip=1.0, neighbouring="add-remove", probes=1)
    data, _ = canaries.transform(tiny_data(clients=2, classes=3), None)
    width = data.feature_shape[0]
    params = {"weight": torch.zeros(3, width), "bias": torch.zeros(3)}
    scores = MessageScores(*canaries.parameter_index(3), params)
    weight = torch.zeros(2, 3, width)
    c, j = int(canaries.label[0, 0]), 4 + int(canaries.columns[0, 0])
    weight[0, c, j] = 3.0  # client 0's message moved its canary's W[c, j]
    message = Messages(
        torch.tensor([0, 1]),
        torch.tensor([1, 0]),
        {"update.weight": weight, "update.bias": torch.zeros(2, 3)},
    )
    scores.add(message)
    assert scores.scores[0, 0].item() == pytest.approx(3.0) and scores.scores[1, 0].item() == 0.0
    flat = torch.cat([torch.zeros(2, 3), weight.reshape(2, -1)], dim=1)[[0, 0]]  # client 0's, twice
    scores.add(
        Messages(torch.tensor([0, 0]), torch.tensor([0, 1]), {"update.gradient": flat})
    )  # one to itself: unseen
    assert scores.scores[0, 0].item() == pytest.approx(0.0)  # a gradient counts against the model
    with pytest.raises(IncompatibleError, match="payload entry 'update.sketch'"):
        scores.add(
            Messages(torch.tensor([0]), torch.tensor([1]), {"update.sketch": torch.zeros(1, 7)})
        )


# -- real audits on digits -----------------------------------------------------------------
def test_a_method_sending_its_non_dp_personal_model_is_flagged_and_honest_proxyfl_is_not(
    small_config,
):
    leaky = audit(small_config, config=dict(method="leaky-proxyfl"))
    honest = audit(small_config, config=dict(method="proxyfl"))
    assert (
        leaky.bound.ceiling > CLAIM and honest.bound.ceiling > CLAIM
    )  # both could have been flagged
    assert leaky.exceeds and leaky.verdict == "refuted", leaky.line()
    assert not honest.exceeds and honest.verdict == "consistent", honest.line()
    assert "so the claim fails" in leaky.line()


def test_a_teacher_trained_without_dp_on_the_same_records_is_flagged_by_the_isolation_replay(
    small_config,
):
    """ProxyFL with the paper's teacher: the trials of a small run cannot show its leak (the
    teacher moves other records' clipped terms a little), the isolation replay does."""
    result = audit(small_config, config=dict(method="proxyfl", options={"teacher": "private"}))
    assert result.verdict == "leaks" and result.leaks and not result.exceeds, result.line()
    assert (
        "LEAKS" in result.line() and "record isolation: " in result.line()
    )  # the finding's wording is the replay's
    assert result.as_dict()["behaviour"]["isolation"] == "failed"


def test_clipping_removed_is_flagged_where_the_clipped_run_is_consistent(small_config):
    faulty = audit(small_config, wrap_mechanism=unclipped, config=dict(method="fedavg"))
    honest = audit(small_config, config=dict(method="fedavg"))
    assert faulty.exceeds, faulty.line()
    assert honest.verdict == "consistent", honest.line()
    assert honest.bound.epsilon_lower < faulty.bound.epsilon_lower


def test_the_line_says_what_was_checked_and_the_final_models_view_works(small_config):
    result = audit(small_config, observer="final", config=dict(method="fedavg"))
    line = result.line()
    assert line.startswith(
        "audit fedavg on digits (method-level: observer final models, canaries: input records with "
        "probe twins; post-processing and record-isolation replays): one-run (f-DP) empirical "
        "epsilon >= "
    )
    assert (
        " guesses right on 240 canaries in 1 run, 30 canaries per client; ceiling " in line
        and " CPU s) vs " in line
    )
    figures = result.as_dict()
    assert (
        figures["level"] == "method" and figures["observer"] == "final" and figures["seconds"] > 0
    )
    assert (
        figures["cpu_seconds"] > 0
        and figures["canaries_per_client"] == 30
        and figures["trials"] == 240
    )
    assert figures["canary_kind"] == "input records with probe twins"


def test_a_claim_above_the_ceiling_is_inconclusive(small_config):
    result = audit(small_config, canaries=5, config=dict(method="fedavg", epsilon=8.0, clients=4))
    assert result.verdict == "inconclusive" and result.bound.ceiling < 8.0
    assert (
        f"inconclusive: this audit cannot refute a claim above {result.bound.ceiling:.2f}"
        in result.line()
    )
    assert "--runs " in result.line()


def test_bad_input_is_refused(small_config):
    with pytest.raises(IncompatibleError, match="not one .*--model linear"):
        audit(small_config, config=dict(method="fedavg", model="cnn"))
    with pytest.raises(UsageError, match="--observer"):
        audit(small_config, observer="server", config=dict(method="fedavg"))
    with pytest.raises(UsageError, match="private run"):
        run_method_audit(small_config(method="fedavg"), track=False)


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def test_cli_method_level_prints_the_line_and_json(capsys, results_dir):
    code, out, err = invoke(
        [
            "audit",
            "--method",
            "fedavg",
            "--level",
            "method",
            "--epsilon",
            "1",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--canaries-per-client",
            "20",
            "--results-dir",
            results_dir,
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    line, figures = out.strip().splitlines()[-2:]
    assert (
        "(method-level: observer neighbour messages, canaries: input records with probe twins; post-processing and "
        "record-isolation replays)"
    ) in line
    figures = json.loads(figures)
    assert (
        figures["level"] == "method" and figures["runs"] == 1 and figures["verdict"] == "consistent"
    )
    assert figures["bound"] == "one-run" and figures["ceiling"] > figures["claimed_epsilon"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--level", "model"], "--level must be mechanism or method"),
        (["--level", "mechanism", "--observer", "final"], "--observer applies to --level method"),
    ],
)
def test_cli_refuses_bad_levels_and_observers(capsys, args, message):
    code, _, err = invoke(["audit", "--method", "fedavg", "--epsilon", "1", *args], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
