"""Figures the device launcher computes itself (issue 30, item 4): the run's epsilon from
the schedule it drives, never from the peers' reports; a peer's release report checked
against it; self-reported figures labelled. Unit cases on `ReleaseCheck`, then device runs
with real peers on 127.0.0.1, one of them tampered."""

from __future__ import annotations

import json
import subprocess
import threading
from types import SimpleNamespace

import pytest
import torch

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.engine.method import Phase, PlannedRelease
from p4bench.privacy.mechanism import DPSettings
from p4bench.run.runner import run
from p4bench_device import runtime as device_runtime
from p4bench_device.local import LocalPeers
from p4bench_device.node import DeviceNode, serve
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.report_check import ReleaseCheck, mismatch_reasons
from p4bench_device.report_schema import parse_releases

FAST = [
    "--option",
    "device_exchange_timeout_s=30",
    "--option",
    "device_round_timeout_s=120",
    "--option",
    "device_startup_timeout_s=180",
]
# a private method that is certified on devices (secret randomness, no step outside the ledger)
RUN = dict(method="dp-dsgt", clients=3, rounds=3, local_steps=2, seed=5, eval_fraction=0.0)


# -- the launcher's figures and its check, without peers ---------------------------------------
class _Method:
    def __init__(self, plan, phases):
        self.plan, self._phases = plan, phases

    def privacy_plan(self):
        return self.plan

    def phases(self):
        return self._phases

    def round_steps(self, phase, round_index):
        return ()


def _check(plan=None, phases=None, allowed=None, clients=3, server=False):
    """A ReleaseCheck over a stub job (sigma 0.8, clip 1) and peers a, b, c (clients 0-2)."""
    charged = []
    job = SimpleNamespace(
        dp=DPSettings(clip=1.0, noise_multiplier=0.8),
        data=SimpleNamespace(num_clients=clients),
        method=_Method(
            plan or [PlannedRelease("train", 0.2, 6, 2, 3, 1.0)], phases or [Phase("train", 3)]
        ),
        release_allowed=allowed
        or (lambda rows, rate, phase: torch.ones(len(rows), dtype=torch.bool)),
        report_release=charged.append,
    )
    specs = [PeerSpec(name, "127.0.0.1", 1 + i, i) for i, name in enumerate("abc"[:clients])]
    if server:
        specs.append(PeerSpec("hub", "127.0.0.1", 9, -1))
    return ReleaseCheck(job, PeersFile(tuple(specs))), charged


def _release(clients, rate=0.2, sigma=0.8, steps=1, phase="train", clip=1.0):
    return {
        "clients": clients,
        "sample_rate": rate,
        "noise_multiplier": sigma,
        "steps": steps,
        "phase": phase,
        "clip": clip,
    }


def _found(check):
    return [(m["peer"], m["what"]) for m in check.finish()["mismatches"]]


def test_the_launcher_charges_the_plan_round_by_round_for_every_client():
    check, charged = _check()
    check.charge_through(1)
    assert [(r.clients, r.sample_rate, r.noise_multiplier, r.steps, r.phase) for r in charged] == [
        ((0, 1, 2), 0.2, 0.8, 1, "train")
    ] * 2
    check.charge_through(1)  # a round is charged once
    check.charge_through(3)
    assert len(charged) == 6 and check.finish()["charged"] == {"train": 6}


def test_a_run_cut_short_is_charged_for_the_rounds_it_took_and_client_sampling_for_every_round():
    check, charged = _check(
        plan=[PlannedRelease("train", 0.2, 5, 2, 4, 1.0)], phases=[Phase("train", 4)]
    )
    check.charge_through(2)  # ceil(5 * 2 / 4) steps after 2 of 4 rounds
    assert len(charged) == 3
    # client_rate 0.5: the plan's typical client takes ceil(0.5 * 4) rounds, but the launcher
    # cannot see who was selected: K steps in every round for every client (a bound)
    check, charged = _check(
        plan=[PlannedRelease("train", 0.2, 4, 2, 4, 0.5)], phases=[Phase("train", 4)]
    )
    check.charge_through(4)
    assert len(charged) == 8


def test_the_runs_budget_decides_each_charged_step():
    taken = [0, 0, 0]

    def allowed(rows, rate, phase):  # client 2 can afford two steps
        ok = torch.tensor([taken[int(r)] < (2 if int(r) == 2 else 99) for r in rows])
        for r in rows[ok]:
            taken[int(r)] += 1
        return ok

    check, charged = _check(allowed=allowed)
    check.charge_through(3)
    assert [r.clients for r in charged] == [(0, 1, 2)] * 2 + [(0, 1)] * 4
    assert check.charged["train"].tolist() == [6, 6, 2]


def test_an_honest_peers_releases_match():
    check, _ = _check()
    check.charge_through(3)
    for peer, node in (("a", 0), ("b", 1), ("c", 2)):
        check.check(peer, "round", "train", parse_releases([_release([node], steps=6)]))
    assert _found(check) == []
    assert mismatch_reasons(check.finish()) == []


def test_a_release_for_another_peers_client_is_a_mismatch_that_names_the_peer():
    check, charged = _check(server=True)
    check.charge_through(3)
    check.check("b", "round", "train", parse_releases([_release([0, 1, 2], steps=6)]))
    check.check("hub", "setup", "train", parse_releases([_release([1, 7])]))
    assert _found(check) == [
        ("b", "release for client(s) 0, 2 of peer(s) a, c (it holds client 1)"),
        ("hub", "release for client(s) 1 of peer(s) b (it holds no client)"),
        ("hub", "release for client(s) 7, which no peer holds (it holds no client)"),
    ]
    assert (
        mismatch_reasons(check.finish())[0]
        == "release mismatch from peer b: release for client(s) 0, 2 of peer(s) a, c (it holds client 1)"
    )
    assert len(charged) == 6  # the reports charged nothing


def test_settings_and_counts_other_than_the_launchers_are_mismatches():
    check, _ = _check()
    check.charge_through(2)  # 4 steps so far
    check.check(
        "a",
        "round",
        "train",
        parse_releases(
            [
                _release([0], sigma=0.5),
                _release([0], rate=0.3),
                _release([0], clip=5.0),
                _release([0], phase="extra"),
                _release([0], clip=None),
                {"clients": "x"},
                _release([0], steps=1),
            ]
        ),
    )
    check.check(
        "b", "round", "train", parse_releases([_release([1], steps=5)])
    )  # beyond the 4 charged
    check.check("c", "round", "train", parse_releases([]))  # ran the phase without the DP mechanism
    assert _found(check) == [
        ("a", "noise multiplier 0.5; the launcher's is 0.8"),
        ("a", "sampling rate 0.3 in phase 'train'; the plan declares 0.2"),
        ("a", "clip 5.0; the launcher's is 1"),
        ("a", "release in phase 'extra', which privacy_plan() does not declare"),
        ("a", "clip None; the launcher's is 1"),
        ("a", "malformed release entry"),
        (
            "a",
            "5 release step(s) of client 0 in phase 'train'; the launcher's plan for the rounds it drove allows 4",
        ),
        (
            "b",
            "5 release step(s) of client 1 in phase 'train'; the launcher's plan for the rounds it drove allows 4",
        ),
        (
            "c",
            "no DP release of client 2 reported in phase 'train', "
            "where the plan declares 4 step(s) for the rounds it ran",
        ),
    ]


def test_many_distinct_mismatches_are_capped_in_the_reasons():
    check, _ = _check()
    check.charge_through(3)
    for i in range(150):
        check.check("a", "setup", "train", parse_releases([_release([0], rate=0.001 * (i + 1))]))
    figures = check.finish()
    reasons = mismatch_reasons(figures)
    assert len(figures["mismatches"]) == 100 and figures["mismatches_not_kept"] > 0
    assert (
        len(reasons) == 11
        and reasons[-1].startswith("release mismatches: ")
        and reasons[-1].endswith(" more (summary device.releases)")
    )


# -- device runs: peers on 127.0.0.1 ----------------------------------------------------------------
@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """The simulator's summary of `RUN`: the epsilon a device run must publish."""
    return run(
        RunConfig(**RUN, results_dir=str(tmp_path_factory.mktemp("simulated"))), track=False
    ).summary


def _device_run(capsys, monkeypatch, results_dir):
    monkeypatch.setenv("COLUMNS", "400")  # the printed table on one line per row
    args = [
        "run",
        "--method",
        RUN["method"],
        "--local-peers",
        str(RUN["clients"]),
        "--rounds",
        str(RUN["rounds"]),
        "--local-steps",
        str(RUN["local_steps"]),
        "--seed",
        str(RUN["seed"]),
        "--eval-fraction",
        "0",
        "--results-dir",
        results_dir,
        "--json",
        *FAST,
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    epsilon_row = next(line for line in err.splitlines() if "│ epsilon " in line)
    return summary, epsilon_row, err


def test_an_honest_device_runs_epsilon_is_the_launchers_and_equals_the_simulators(
    verify_full, capsys, monkeypatch, tmp_path, simulated
):
    summary, epsilon_row, printed = _device_run(capsys, monkeypatch, str(tmp_path))
    for key in (
        "epsilon",
        "epsilon_mean",
        "epsilon_rdp",
        "epsilon_pld",
        "noise_multiplier",
        "delta",
        "clip",
    ):
        assert summary[key] == simulated[key], key
    assert summary["epsilon_certified"] is True and summary["uncertified_reason"] is None
    releases = summary["device"]["releases"]
    assert releases["mismatches"] == [] and releases["charged"] == {"train": 6}
    assert (
        summary["device"]["rejected_reports"] == []
        and "malformed report" not in summary["device"]["launcher_rejected"]
    )
    assert releases["reported"] == {
        "0": {"train": 6},
        "1": {"train": 6},
        "2": {"train": 6},
    }  # checked, not charged
    assert "certified" in epsilon_row and "UNCERTIFIED" not in epsilon_row
    assert summary["device"]["self_reported"][0] == "accuracy"
    assert "self-reported" in printed and "not checked by the launcher" in printed


TAMPERED = "1"


class _OnePeerHere(LocalPeers):
    """Local peers whose peer TAMPERED runs in this process (a thread), where a test can
    patch it; the others are `device serve` subprocesses as usual."""

    def start(self) -> None:
        for spec in self.peers.peers:
            if spec.id == TAMPERED:
                self.thread = threading.Thread(
                    target=serve,
                    args=(
                        spec.id,
                        f"{spec.host}:{spec.port}",
                        str(self.peers_path),
                        str(self.tls_dir),
                    ),
                    kwargs={"idle_timeout": 300.0},
                    daemon=True,
                )
                self.thread.start()
                continue
            handle = open(self.folder / f"peer-{spec.id}.log", "wb")
            self._logs.append(handle)
            self.processes[spec.id] = subprocess.Popen(
                self.command(spec),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def stop(self, failed: bool = False, timeout: float = 15.0) -> None:
        self.thread.join(timeout)  # it exits on the launcher's stop
        super().stop(failed, timeout)


def test_a_peer_reporting_releases_for_other_clients_is_named_and_the_run_is_not_certified(
    verify_full, capsys, monkeypatch, tmp_path, simulated
):
    """Acceptance (issue 30, item 4): peer 1's release reports name every client (the
    report that once published epsilon 22,672 as certified)."""
    honest = DeviceNode._record_release

    def tampered(self, release):
        honest(self, release)
        self.releases[-1]["clients"] = list(range(self.job.data.num_clients))

    monkeypatch.setattr(DeviceNode, "_record_release", tampered)
    monkeypatch.setattr(
        device_runtime, "LocalPeers", _OnePeerHere
    )  # where the device runtime starts its peers
    summary, epsilon_row, printed = _device_run(capsys, monkeypatch, str(tmp_path))
    assert summary["epsilon_certified"] is False
    # the only reason: what the configuration alone would certify (the honest test above)
    assert (
        summary["uncertified_reason"]
        == "release mismatch from peer 1: release for client(s) 0, 2 of peer(s) 0, 2 (it holds client 1)"
    )
    assert [(m["peer"], m["count"]) for m in summary["device"]["releases"]["mismatches"]] == [
        ("1", 6)
    ]
    assert (
        summary["epsilon"] == simulated["epsilon"]
    )  # the launcher's figure, not the peers' reports
    assert (
        summary["epsilon_pld"] == simulated["epsilon_pld"]
        and summary["epsilon_rdp"] == simulated["epsilon_rdp"]
    )
    assert "UNCERTIFIED" in epsilon_row and "release mismatch from peer 1" in epsilon_row
    assert not epsilon_row.split("│")[2].strip().startswith("certified")
