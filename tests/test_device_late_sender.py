"""Issue #47: the `late-sender` attack. On the device runtime the malicious peer holds every
batch back until 0.9 of the exchange timeout; its receivers stop waiting for it at its
deadline, drop it and the run names it. In the simulator (no clock) it is honest, and says so."""

from __future__ import annotations

import logging
import sys

from p4bench.config import RunConfig
from p4bench.run.runner import run
from p4bench_device.launcher import LocalPeers

SEEDED = {"noise_source": "seeded", "device_simulation": True}


def _config(**changes) -> RunConfig:
    base = dict(
        method="fedavg",
        clients=4,
        rounds=3,
        local_steps=2,
        seed=5,
        eval_fraction=0.0,
        malicious_fraction=0.25,
        **SEEDED,
    )
    base.update(changes)
    return RunConfig(**base)


def test_late_sender_is_honest_in_the_simulator_and_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="p4bench.attacks"):
        late = run(
            _config(attack="late-sender", results_dir=str(tmp_path / "late")), track=False
        ).summary
    said = [
        r
        for r in caplog.records
        if "late-sender" in r.getMessage() and "behave honestly" in r.getMessage()
    ]
    assert len(said) == 1
    # no attack at all, with the same client held malicious (a sign-flip scaled to 0 would still act):
    # the benign clients' accuracies equal the late-sender run's, so its malicious client sent honestly
    clean = run(
        _config(
            attack="duplicate-messages",
            options={"duplicate_copies": 1, "duplicate_scale": 0.0},
            results_dir=str(tmp_path / "clean"),
        ),
        track=False,
    ).summary
    assert late["accuracy_per_client"].keys() == clean["accuracy_per_client"].keys()
    for client, accuracy in clean["accuracy_per_client"].items():
        assert abs(late["accuracy_per_client"][client] - accuracy) <= 1e-6, client


def test_a_late_sender_on_the_device_is_dropped_by_every_honest_peer_and_named(tmp_path):
    with LocalPeers(4, server=True) as cluster:
        config = _config(
            attack="late-sender",
            runtime="device",
            results_dir=str(tmp_path),
            options={
                "device_peers": str(cluster.peers_path),
                "device_tls_dir": str(cluster.tls_dir),
                "device_exchange_timeout_s": 10,
                "device_round_timeout_s": 120,
                "device_startup_timeout_s": 180,
            },
        )
        summary = run(config, track=False).summary
    device = summary["device"]
    assert device["dropped"] == [] and all(p["finished"] for p in device["peers"].values())
    # the malicious client is the one the summary does not report (eval_fraction 0)
    malicious = {str(c) for c in range(4)} - set(summary["accuracy_per_client"])
    assert len(malicious) == 1
    late = malicious.pop()
    honest = {"server", "0", "1", "2", "3"} - {late}
    assert {e["peer"] for e in device["slow_dropped"]} == {late}
    assert {
        e["by"] for e in device["slow_dropped"]
    } == honest  # every honest receiver judged it on its own
    assert all(
        f"dropped slow peer {late}" in e["message"] and "deadline" in e["reason"]
        for e in device["slow_dropped"]
    )
    assert device["slow_drops_unconfirmed"] == []
    for peer in honest:
        assert device["peers"][peer]["transport"]["refused"] == [late]


# A compromised peer (its key, its process; the harness takes it for honest): every round it
# reports that it dropped every other peer as slow, and an accuracy of 1.0 for its client.
BRAGGART = r"""
from p4bench_device import network, node

honest_exchange = network.TLSNetwork.exchange

def exchange(self, exchange, phase, round_index, outgoing):
    delivery = honest_exchange(self, exchange, phase, round_index, outgoing)
    if not self.slow_dropped:
        self.slow_dropped += [
            {"peer": p, "seq": self.seq, "phase": phase, "round": round_index, "exchange": exchange,
             "reason": "no end marker by its deadline"}
            for p in sorted(self.others)
        ]
    return delivery

network.TLSNetwork.exchange = exchange
node.DeviceNode._accuracy_fields = staticmethod(lambda accuracy, extra: {"accuracy": 1.0, "extra": {}})
from p4bench_device.cli import main
main()
"""


class OneBraggart(LocalPeers):
    def command(self, spec):
        argv = super().command(spec)
        return [sys.executable, "-c", BRAGGART, *argv[3:]] if spec.id == "3" else argv


def test_one_peers_fake_drops_are_claims_and_its_perfect_accuracy_is_named(tmp_path):
    with OneBraggart(4, server=True) as cluster:
        config = _config(
            runtime="device",
            results_dir=str(tmp_path),
            options={
                "device_peers": str(cluster.peers_path),
                "device_tls_dir": str(cluster.tls_dir),
                "device_exchange_timeout_s": 30,
                "device_round_timeout_s": 120,
                "device_startup_timeout_s": 180,
            },
        )
        summary = run(config, track=False).summary
    device = summary["device"]
    assert device["slow_dropped"] == []  # nobody backs peer 3's word: nothing published as a drop
    claims = device["slow_drops_unconfirmed"]
    assert {e["peer"] for e in claims} == {"0", "1", "2", "server"} and {
        e["by"] for e in claims
    } == {"3"}
    assert all(
        "peer 3 reports it dropped slow peer" in e["message"] and "unconfirmed" in e["message"]
        for e in claims
    )
    for peer in ("0", "1", "2", "server"):  # and nobody refused anyone
        assert device["peers"][peer]["transport"]["refused"] == []
    check = device["accuracy_check"]
    assert [o["peer"] for o in check["outliers"]] == ["3"] and check["outliers"][0][
        "accuracy"
    ] == 1.0
    assert check["mean_without_outliers"] < check["mean"] and check["median"] < 1.0
