"""The receive gate (issue 30): what a node accepts from authenticated but misbehaving
senders, in the round driver every runtime shares; and the attacks that probe it."""

from __future__ import annotations

import pytest
import torch

from p4bench.cli.summary_table import rejections_line
from p4bench.config import RunConfig
from p4bench.engine import Messages
from p4bench.engine.receive_gate import ReceiveGate, Rejections, rejection_counts
from p4bench.run.runner import run
from p4bench_baselines.fedavg import FedAvg


class _Declared:
    """A method's declarations as the gate reads them."""

    num_clients = 8

    def __init__(self, per_pair: int = 1, server: int = 1, bounds: dict | None = None) -> None:
        self.per_pair, self.server, self.bounds = per_pair, server, bounds or {}

    def messages_per_pair(self, exchange, phase, round_index):
        return self.per_pair

    def server_messages_per_pair(self, exchange, phase, round_index):
        return self.server

    def payload_bounds(self, exchange, phase, round_index):
        return self.bounds


def _gate(method=None, records: int | None = 100) -> tuple[ReceiveGate, Rejections]:
    rejections = Rejections()
    return ReceiveGate(method or _Declared(), records, rejections), rejections


def _messages(src, dst, values, weight=None) -> Messages:
    payload = {"update.w": torch.tensor(values, dtype=torch.float32).reshape(len(src), -1)}
    if weight is not None:
        payload["weight"] = torch.tensor(weight, dtype=torch.float64)
    return Messages(torch.tensor(src), torch.tensor(dst), payload)


def test_extra_copies_from_one_sender_are_rejected_and_the_first_kept():
    gate, rejections = _gate()
    inbox = _messages([2, 2, 2, 1], [0, 0, 0, 0], [[1.0], [2.0], [3.0], [4.0]])
    kept = gate.admit("upload", "train", 0, inbox)
    assert kept.src.tolist() == [2, 1] and kept.payload["update.w"].flatten().tolist() == [1.0, 4.0]
    assert rejections.metrics() == {"rejected extra message from 2": 2.0}


def test_copies_to_different_receivers_are_not_extras():
    gate, rejections = _gate()
    kept = gate.admit("gossip", "train", 0, _messages([2, 2, 2], [0, 1, 3], [[1.0], [1.0], [1.0]]))
    assert len(kept) == 3 and not rejections.counts


def test_a_broadcast_counts_once_for_every_receiver():
    gate, rejections = _gate()
    # 2 broadcasts twice and also messages 0 directly; 1 broadcasts once
    inbox = _messages([2, 2, 1, 2], [-2, -2, -2, 0], [[1.0], [2.0], [3.0], [4.0]])
    kept = gate.admit("share", "grouping", 0, inbox)
    assert kept.src.tolist() == [2, 1] and kept.payload["update.w"].flatten().tolist() == [1.0, 3.0]
    assert rejections.metrics() == {"rejected extra message from 2": 2.0}


def test_declared_counts_per_pair_and_from_the_server():
    gate, rejections = _gate(_Declared(per_pair=2, server=3))
    inbox = _messages([4, 4, 4, -1, -1, -1, -1], [0] * 7, [[float(i)] for i in range(7)])
    kept = gate.admit("relay", "train", 0, inbox)
    assert kept.src.tolist() == [4, 4, -1, -1, -1]
    assert rejections.metrics() == {
        "rejected extra message from -1": 1.0,
        "rejected extra message from 4": 1.0,
    }


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_payloads_are_rejected_naming_the_sender(bad):
    gate, rejections = _gate()
    kept = gate.admit("upload", "train", 0, _messages([1, 3], [0, 0], [[1.0, 2.0], [bad, 0.0]]))
    assert kept.src.tolist() == [1]
    assert rejection_counts(rejections.metrics()) == {"non-finite from 3": 1}


def test_a_shared_table_row_is_checked_once_for_every_receiver():
    table = {"update.w": torch.tensor([[1.0], [float("nan")]])}
    inbox = Messages(
        torch.tensor([5, 5, 6, 6]),
        torch.tensor([0, 1, 0, 1]),
        table,
        rows=torch.tensor([0, 0, 1, 1]),
    )
    gate, rejections = _gate()
    assert gate.admit("gossip", "train", 0, inbox).src.tolist() == [5, 5]
    assert rejections.metrics() == {"rejected non-finite from 6": 2.0}


def test_weights_outside_zero_to_the_records_of_the_data_set_are_rejected():
    gate, rejections = _gate(records=100)
    inbox = _messages([1, 2, 3, 4], [-1] * 4, [[0.0]] * 4, weight=[10.0, 100.0, 101.0, -1.0])
    assert gate.admit("upload", "train", 0, inbox).src.tolist() == [1, 2]
    assert rejection_counts(rejections.metrics()) == {
        "out of range weight from 3": 1,
        "out of range weight from 4": 1,
    }


def test_method_bounds_apply_and_each_message_is_counted_once():
    gate, rejections = _gate(_Declared(bounds={"update.w": (0.0, 1.0)}))
    inbox = _messages([1, 2, 2], [0, 0, 0], [[0.5], [float("nan")], [2.0]])
    assert gate.admit("share", "train", 0, inbox).src.tolist() == [1]
    assert rejection_counts(rejections.metrics()) == {
        "non-finite from 2": 1,
        "extra message from 2": 1,
    }


def test_ids_outside_the_federation_are_rejected():
    gate, rejections = _gate()
    assert gate.admit(
        "gossip", "train", 0, _messages([1, 8, -2], [0, 0, 0], [[0.0]] * 3)
    ).src.tolist() == [1]
    assert rejection_counts(rejections.metrics()) == {
        "unknown node from 8": 1,
        "unknown node from -2": 1,
    }


def test_rejections_line_names_reason_sender_and_count():
    assert (
        rejections_line({"non-finite from 3": 5, "extra message from 1": 9})
        == "rejected 14 messages: extra message from 1 (9), non-finite from 3 (5)"
    )


# -- FedAvg: weights the receiver fixes -------------------------------------------------------
class _Ctx:
    def __init__(self) -> None:
        self.rejected: list[tuple[str, list[int]]] = []

    def reject(self, reason, senders):
        self.rejected.append((reason, senders.tolist()))


def test_fedavg_weights_are_those_declared_first_and_a_changed_weight_is_rejected():
    method = FedAvg(RunConfig(method="fedavg", clients=3), model=None, num_clients=3)  # type: ignore[arg-type]
    assert method.weighting == "records"  # non-private default
    state = {"declared": torch.full((3,), float("nan"), dtype=torch.float64)}
    ctx = _Ctx()
    first = _messages([0, 2], [-1, -1], [[1.0], [1.0]], weight=[30.0, 50.0])
    _, weights, state = method.admitted_uploads(state, first, ctx)
    assert weights.tolist() == [30.0, 50.0] and not ctx.rejected
    later = _messages([0, 1, 2], [-1, -1, -1], [[1.0]] * 3, weight=[30.0, 20.0, 5000.0])
    kept, weights, state = method.admitted_uploads(state, later, ctx)
    assert kept.src.tolist() == [0, 1] and weights.tolist() == [30.0, 20.0]
    assert ctx.rejected == [("changed weight", [2])]


def test_private_fedavg_weights_uniformly_and_records_weighting_is_uncertified_under_add_remove():
    private = RunConfig(method="fedavg", clients=3, epsilon=8.0)
    assert FedAvg(private, model=None, num_clients=3).weighting == "uniform"  # type: ignore[arg-type]
    assert FedAvg(private, model=None, num_clients=3).uncertified_steps() == []  # type: ignore[arg-type]
    by_records = private.replace(options={"weighting": "records"})
    assert "n_i" in FedAvg(by_records, model=None, num_clients=3).uncertified_steps()[0]  # type: ignore[arg-type]
    replace_one = by_records.replace(neighbouring="replace-one")
    assert FedAvg(replace_one, model=None, num_clients=3).uncertified_steps() == []  # type: ignore[arg-type]


# -- end to end: one compromised client of four --------------------------------------------------
def _fedavg(attack: str | None, **options) -> dict:
    config = RunConfig(
        method="fedavg",
        clients=4,
        rounds=8,
        seed=3,
        eval_fraction=0.0,
        attack=attack,
        defense="m-krum",
        malicious_fraction=0.25,
        options=options,
    )
    return run(config, track=False).summary


@pytest.fixture(scope="module")
def clean_fedavg() -> dict:
    return _fedavg(None)


@pytest.mark.parametrize(
    "attack, reason",
    [
        ("nan-update", "non-finite"),
        ("duplicate-messages", "extra message"),
        ("weight-lie", "non-finite"),
    ],
)
def test_each_payload_attack_is_rejected_by_sender_and_honest_accuracy_holds(
    clean_fedavg, attack, reason
):
    summary = _fedavg(attack)
    senders = {key.rsplit(" from ", 1)[1] for key in summary["rejections"]}
    assert len(senders) == 1 and all(key.startswith(reason) for key in summary["rejections"])
    assert summary["rejected_messages"] > 0 and clean_fedavg["rejected_messages"] == 0
    assert abs(summary["accuracy_mean"] - clean_fedavg["accuracy_mean"]) <= 0.02


def test_a_lied_weight_within_range_changes_nothing_after_the_first_upload(clean_fedavg):
    # within the sender's partition (about 360 records each): a constant lie there is a
    # declaration, fixed, not rejected (above it: tests/test_declared_sizes.py)
    summary = _fedavg("weight-lie", lied_weight=100.0)
    assert not summary["rejections"]
    assert abs(summary["accuracy_mean"] - clean_fedavg["accuracy_mean"]) <= 0.02


def test_an_attack_cannot_send_as_a_client_it_does_not_control(monkeypatch):
    from p4bench_attacks.duplicate_messages import DuplicateMessages

    def impersonate(self, exchange, messages, rng, reference=None):
        return Messages(messages.src + 1, messages.dst, messages.payload).select(
            torch.tensor([0, 0])
        )

    monkeypatch.setattr(DuplicateMessages, "tamper", impersonate)
    with pytest.raises(ValueError, match="does not control"):
        _fedavg("duplicate-messages")
