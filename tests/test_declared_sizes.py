"""Declared sizes (issue 47, item 4): a sender's declared record count (``weight``) is held
to its own partition's size where the run knows it, else to a declared cap, else ignored;
and the record-inflation attack that probes it."""

from __future__ import annotations

import logging

import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine import Messages
from p4bench.engine.declared_sizes import DeclaredSizes
from p4bench.engine.receive_gate import ReceiveGate, Rejections, rejection_counts
from p4bench.run.runner import prepare, run
from p4bench_baselines.fedavg import FedAvg


class _Declared:
    """A method's declarations as the gate reads them (no bounds of its own)."""

    num_clients = 4

    def messages_per_pair(self, exchange, phase, round_index):
        return 1

    def server_messages_per_pair(self, exchange, phase, round_index):
        return 1

    def payload_bounds(self, exchange, phase, round_index):
        return {}


def _gate(sizes: DeclaredSizes, records: int | None = 1000) -> tuple[ReceiveGate, Rejections]:
    rejections = Rejections()
    return ReceiveGate(_Declared(), records, rejections, sizes), rejections


def _uploads(src, weight) -> Messages:
    count = len(src)
    payload = {
        "update.w": torch.arange(count, dtype=torch.float32).reshape(count, 1),
        "weight": torch.tensor(weight, dtype=torch.float64),
    }
    return Messages(torch.tensor(src), torch.full((count,), -1), payload)


def _counts(rejections: Rejections) -> dict[str, int]:
    return rejection_counts(rejections.metrics())


def test_each_sender_is_held_to_its_own_partition():
    gate, rejections = _gate(DeclaredSizes(torch.tensor([10, 20, 30, 0])))
    # 0: its own 10; 1: 21 of 20; 2: 25 of 30 (more than 0 holds, within its own); 3: 1 of 0
    kept = gate.admit("upload", "train", 0, _uploads([0, 1, 2, 3], [10.0, 21.0, 25.0, 1.0]))
    assert kept.src.tolist() == [
        0,
        2,
        3,
    ]  # a count of 1 is always allowed: uniform weighting declares 1
    assert _counts(rejections) == {"declared records above partition from 1": 1}


def test_the_partition_bound_is_tighter_than_the_data_set():
    # the case: 359 held, 1,400 declared, within the data set's 1,435
    gate, rejections = _gate(DeclaredSizes(torch.tensor([359, 400, 300, 376])), records=1435)
    kept = gate.admit("upload", "train", 0, _uploads([0, 1], [1400.0, 400.0]))
    assert kept.src.tolist() == [1]
    assert _counts(rejections) == {"declared records above partition from 0": 1}


def test_a_declared_cap_bounds_every_sender_where_the_partition_is_unknown():
    gate, rejections = _gate(DeclaredSizes(None, cap=15))
    kept = gate.admit("upload", "train", 0, _uploads([0, 1, 2], [15.0, 16.0, -1.0]))
    assert kept.src.tolist() == [0]
    assert _counts(rejections) == {
        "declared records above cap from 1": 1,
        "out of range weight from 2": 1,  # below 0: the range check names it
    }


def test_with_both_the_smaller_bound_holds():
    gate, rejections = _gate(DeclaredSizes(torch.tensor([10, 50, 50, 50]), cap=40))
    kept = gate.admit("upload", "train", 0, _uploads([0, 1, 2], [11.0, 40.0, 41.0]))
    assert kept.src.tolist() == [1]
    assert set(_counts(rejections)) == {
        "declared records above partition from 0",
        "declared records above partition from 2",
    }


def test_without_partition_or_cap_every_weight_counts_one_and_the_run_says_so(caplog):
    gate, rejections = _gate(DeclaredSizes(None, None))
    with caplog.at_level(logging.WARNING, logger="p4bench.engine"):
        kept = gate.admit("upload", "train", 0, _uploads([0, 1, 2], [5.0, 900.0, 3.0]))
        gate.admit("upload", "train", 1, _uploads([0], [5.0]))
    assert kept.src.tolist() == [0, 1, 2] and not _counts(rejections)
    assert kept.value("weight").tolist() == [1.0, 1.0, 1.0]
    assert sum("counts 1" in r.getMessage() for r in caplog.records) == 1  # said once


def test_a_run_holds_senders_to_the_partition_it_built_and_reads_the_cap_option():
    config = RunConfig(method="fedavg", clients=4, rounds=1, seed=3, eval_fraction=0.0)
    prepared = prepare(config, _registry())
    sizes = ReceiveGate.for_job(prepared.job, Rejections()).declared_sizes
    assert torch.equal(sizes.partition.long(), prepared.job.data.train.n.long().clamp_min(1))
    assert sizes.cap is None and not sizes.uniform
    capped = prepare(config.replace(options={"max_declared_records": 50}), _registry())
    assert ReceiveGate.for_job(capped.job, Rejections()).declared_sizes.cap == 50.0


def _registry():
    from p4bench.host.manager import Registry, create_plugin_manager

    return Registry(create_plugin_manager())


def test_fedavg_pins_a_first_declaration_within_the_partition_only():
    """The gate rejects an inflated first upload before FedAvg can pin it; a later inflation
    never reaches the method either, so the pinned weight stays the honest one."""
    method = FedAvg(RunConfig(method="fedavg", clients=3), model=None, num_clients=3)  # type: ignore[arg-type]
    gate, rejections = _gate(DeclaredSizes(torch.tensor([30, 40, 50])))
    state = {"declared": torch.full((3,), float("nan"), dtype=torch.float64)}

    class _Ctx:
        def reject(self, reason, senders):
            raise AssertionError("nothing left for the method to reject")

    first = gate.admit("upload", "train", 0, _uploads([0, 1], [120.0, 40.0]))
    _, weights, state = method.admitted_uploads(state, first, _Ctx())  # type: ignore[arg-type]
    assert weights.tolist() == [40.0] and torch.isnan(state["declared"][0])
    later = gate.admit("upload", "train", 1, _uploads([0, 1], [30.0, 160.0]))
    _, weights, state = method.admitted_uploads(state, later, _Ctx())  # type: ignore[arg-type]
    assert weights.tolist() == [30.0] and state["declared"].tolist()[:2] == [30.0, 40.0]
    assert _counts(rejections) == {
        "declared records above partition from 0": 1,
        "declared records above partition from 1": 1,
    }


# -- end to end: record-inflation against FedAvg ----------------------------------------------
def _fedavg(attack: str | None, **options) -> object:
    config = RunConfig(
        method="fedavg",
        clients=8,
        rounds=4,
        seed=5,
        eval_fraction=0.0,
        attack=attack,
        malicious_fraction=0.25,
        options=options,
    )
    return run(config, track=False)


@pytest.fixture(scope="module")
def clean() -> object:
    return _fedavg(None)


def test_record_inflation_is_rejected_naming_exactly_the_attackers(clean):
    result = _fedavg("record-inflation")
    summary = result.summary
    named = {int(key.rsplit(" from ", 1)[1]) for key in summary["rejections"]}
    attackers = set(result.info.malicious.nonzero()[0].tolist())  # what the harness knows
    assert named == attackers
    assert all(k.startswith("declared records above partition") for k in summary["rejections"])
    assert abs(summary["accuracy_mean"] - clean.summary["accuracy_mean"]) <= 0.03


def test_without_the_partition_bound_record_inflation_hurts(clean, monkeypatch):
    """The control: the gate of before (weights within the data set's N) lets it through."""
    monkeypatch.setattr(
        ReceiveGate,
        "for_job",
        classmethod(lambda cls, job, rejections: cls(job.method, job.public_records, rejections)),
    )
    summary = _fedavg("record-inflation").summary
    assert not summary["rejections"]
    assert summary["accuracy_mean"] < clean.summary["accuracy_mean"] - 0.05
