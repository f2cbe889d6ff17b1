"""Issue #47: the `late-sender` attack. On the device runtime the malicious peer holds every
batch back until 0.9 of the exchange timeout; its receivers stop waiting for it at its
deadline, drop it and the run names it. In the simulator (no clock) it is honest, and says so."""

from __future__ import annotations

import logging

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
