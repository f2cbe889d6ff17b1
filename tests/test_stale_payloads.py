"""Stale and copied payloads (issue 47, item 4): where a method declares an exchange's
payloads fresh, a model that repeats the sender's own last one or another sender's is
rejected and named; honest runs of the declaring methods are never flagged; and the
stale-replay attack that probes it."""

from __future__ import annotations

import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine import Messages
from p4bench.engine import payload_history as history_module
from p4bench.engine.payload_history import row_digests
from p4bench.engine.receive_gate import ReceiveGate, Rejections, rejection_counts
from p4bench.run.runner import run


class _Fresh:
    """A method's declarations as the gate reads them: `fresh` exchanges judged."""

    num_clients = 8

    def __init__(self, fresh: bool = True) -> None:
        self.fresh = fresh

    def messages_per_pair(self, exchange, phase, round_index):
        return 1

    def server_messages_per_pair(self, exchange, phase, round_index):
        return 1

    def payload_bounds(self, exchange, phase, round_index):
        return {}

    def fresh_payloads(self, exchange, phase, round_index):
        return self.fresh


def _gate(fresh: bool = True) -> tuple[ReceiveGate, Rejections]:
    rejections = Rejections()
    return ReceiveGate(_Fresh(fresh), None, rejections), rejections


def _messages(src, dst, values) -> Messages:
    payload = {"update.w": torch.tensor(values, dtype=torch.float32).reshape(len(src), -1)}
    return Messages(torch.tensor(src), torch.tensor(dst), payload)


def _counts(rejections: Rejections) -> dict[str, int]:
    counts = rejection_counts(rejections.metrics())
    rejections.clear()
    return counts


def test_digests_are_equal_exactly_for_equal_bits():
    base = torch.randn(5, 300)
    table = {"update.a": base, "update.b": base[:, :7].double(), "weight": torch.arange(5.0)}
    digests, nonzero = row_digests(table)
    again, _ = row_digests({k: v.clone() for k, v in table.items()})
    assert torch.equal(digests, again) and nonzero.all()
    assert len(set(digests.tolist())) == 5
    flipped = base.clone()
    flipped[2, 123] = torch.nextafter(flipped[2, 123], torch.tensor(1e9))  # one bit
    changed, _ = row_digests({**table, "update.a": flipped})
    assert (changed != digests).tolist() == [False, False, True, False, False]
    # only update.* entries count; an all-zero update is flagged as such
    _, zero = row_digests({"update.a": torch.zeros(2, 4).index_fill_(0, torch.tensor([1]), 1.0)})
    assert zero.tolist() == [False, True]
    narrow, _ = row_digests({**table, "weight": torch.zeros(5)})
    assert torch.equal(narrow, digests)


def test_a_sender_repeating_its_last_payload_is_stale():
    gate, rejections = _gate()
    gate.admit("gossip", "train", 1, _messages([1, 2, 3], [0, 0, 0], [[1.0], [2.0], [3.0]]))
    assert not _counts(rejections)
    kept = gate.admit("gossip", "train", 2, _messages([1, 2, 3], [0, 0, 0], [[1.5], [2.0], [3.5]]))
    assert kept.src.tolist() == [1, 3]
    assert _counts(rejections) == {"stale payload from 2": 1}
    # two exchanges later, against the last payload it had accepted from sender 2
    kept = gate.admit("gossip", "train", 3, _messages([1, 2], [0, 0], [[1.7], [2.0]]))
    assert kept.src.tolist() == [1] and _counts(rejections) == {"stale payload from 2": 1}


def test_history_is_per_receiver_and_per_exchange():
    gate, rejections = _gate()
    gate.admit("gossip", "train", 1, _messages([1], [0], [[1.0]]))
    # the same model to another receiver, and in another exchange: nothing to compare with
    gate.admit("gossip", "train", 2, _messages([1], [4], [[1.0]]))
    gate.admit("track", "train", 2, _messages([1], [0], [[1.0]]))
    assert not _counts(rejections)


def test_a_copy_of_another_senders_payload_in_the_same_exchange_is_named():
    gate, rejections = _gate()
    # 5 re-sends 2's model to receiver 0, delivered after it; to receiver 6 2's model alone is fine
    inbox = _messages([2, 3, 5, 2], [0, 0, 0, 6], [[7.0], [8.0], [7.0], [7.0]])
    kept = gate.admit("upload", "train", 0, inbox)
    assert kept.src.tolist() == [2, 3, 2]
    assert _counts(rejections) == {"copied payload from 5": 1}


def test_a_copy_of_another_senders_earlier_payload_is_named_whatever_the_order():
    gate, rejections = _gate()
    gate.admit("gossip", "train", 1, _messages([4, 6], [0, 0], [[4.0], [6.0]]))
    kept = gate.admit("gossip", "train", 2, _messages([1, 4, 6], [0, 0, 0], [[6.0], [4.5], [6.5]]))
    assert kept.src.tolist() == [4, 6]
    assert _counts(rejections) == {"copied payload from 1": 1}


def test_a_digest_collision_is_not_taken_for_a_copy(monkeypatch):
    """Copies in one exchange are confirmed bit for bit before a message is rejected."""

    def colliding(table):
        rows = len(table["update.w"])
        return torch.zeros(rows, dtype=torch.int64), torch.ones(rows, dtype=torch.bool)

    monkeypatch.setattr(history_module, "row_digests", colliding)
    gate, rejections = _gate()
    kept = gate.admit("upload", "train", 0, _messages([2, 3, 5], [0, 0, 0], [[7.0], [8.0], [7.0]]))
    assert kept.src.tolist() == [2, 3] and _counts(rejections) == {"copied payload from 5": 1}


def test_nothing_is_judged_where_payloads_are_not_declared_fresh_nor_zero_updates():
    gate, rejections = _gate(fresh=False)
    same = _messages([1, 2], [0, 0], [[1.0], [1.0]])
    for round_index in range(3):  # a relay's or a broadcast's honest repeats
        assert len(gate.admit("broadcast", "train", round_index, same)) == 2
    assert not _counts(rejections) and gate.history.entries() == 0
    gate, rejections = _gate()
    zeros = _messages([1, 2], [0, 0], [[0.0], [0.0]])  # clients that took no step
    for round_index in range(3):
        assert len(gate.admit("upload", "train", round_index, zeros)) == 2
    assert not _counts(rejections)


def test_the_history_holds_one_digest_per_pair_whatever_the_rounds():
    gate, rejections = _gate()
    # a ring and self: every node sends its model to itself and its two neighbours
    dst = torch.cat([torch.arange(8), (torch.arange(8) + 1) % 8, (torch.arange(8) - 1) % 8])
    src = torch.arange(8).repeat(3)
    sizes = []
    for round_index in range(12):
        models = torch.randn(8, 5)[src]
        kept = gate.admit("gossip", "train", round_index, Messages(src, dst, {"update.w": models}))
        assert len(kept) == 24
        sizes.append(gate.history.entries())
    assert sizes == [24] * 12 and not _counts(rejections)


# -- end to end: honest runs of every method that declares fresh payloads ------------------------
CLEAN = [
    ("fedavg", {"epsilon": 8.0, "local_steps": 2, "client_rate": 0.5}, {}),
    ("feddf", {"epsilon": 8.0, "local_steps": 2}, {"distill_steps": 20, "distill_eval_every": 10}),
    ("dp-dsgd", {}, {}),
    ("dp-dsgd", {}, {"topology": "ring"}),
    ("dp-dsgd", {}, {"order": "d-psgd", "iterations": 1}),
    ("muffliato", {}, {}),
    (
        "dp-dsgt",
        {},
        {"iterations": 1},
    ),  # not declared: its gossiped model is a mix, the same at every node
]


@pytest.mark.parametrize("method, fields, options", CLEAN)
def test_clean_runs_of_the_declaring_methods_reject_nothing(method, fields, options):
    config = RunConfig(
        method=method, clients=6, rounds=3, seed=2, eval_fraction=0.0, options=options, **fields
    )
    summary = run(config, track=False).summary
    assert not summary["rejections"]


@pytest.mark.parametrize(
    "method, fields, options, reason",
    [
        ("dp-dsgd", {}, {"topology": "ring", "stale_mode": "own"}, "stale payload"),
        ("dp-dsgd", {}, {"topology": "ring", "stale_mode": "copy"}, "copied payload"),
        ("fedavg", {"epsilon": 8.0, "local_steps": 2}, {"stale_mode": "own"}, "stale payload"),
    ],
)
def test_stale_replay_is_rejected_naming_exactly_the_attackers(method, fields, options, reason):
    config = RunConfig(
        method=method,
        clients=8,
        rounds=3,
        seed=2,
        eval_fraction=0.0,
        attack="stale-replay",
        malicious_fraction=0.25,
        options=options,
        **fields,
    )
    result = run(config, track=False)
    rejections = result.summary["rejections"]
    named = {int(key.rsplit(" from ", 1)[1]) for key in rejections}
    assert named == set(result.info.malicious.nonzero()[0].tolist())
    # replaying the common start, two neighbouring attackers also send each other's model;
    # copying per receiver, an attacker also equivocates (p4bench.engine.equivocation)
    assert any(key.startswith(reason) for key in rejections)
    assert all(
        key.startswith(("stale payload", "copied payload", "equivocation")) for key in rejections
    )
