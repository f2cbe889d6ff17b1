"""The from-scratch peer-to-peer example (examples/p4bench-gossip): discovered through
its entry point, conforming in every runtime (the device runtime included), and run
through the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from p4bench.host.manager import Registry, create_plugin_manager, reset_default
from p4bench.testing import check_attack, check_method

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "p4bench-gossip"


@pytest.fixture
def installed_gossip(install_example):
    """The example importable with real distribution metadata and its entry point (what
    `pip install` writes), here and in subprocesses (device peers), without touching
    the environment."""
    install_example(EXAMPLE, subprocesses=True)
    yield
    sys.modules.pop("p4bench_gossip", None)
    reset_default()


def test_gossip_is_discovered_and_declares_its_options(installed_gossip):
    registry = Registry(create_plugin_manager())
    entry = registry.entry("method", "gossip")
    assert (entry.distribution, entry.version) == ("p4bench-gossip", "0.1.0")
    assert [o.name for o in entry.cls.options] == ["mix", "topology", "topology_options"]


def test_gossip_conforms_in_every_runtime(installed_gossip):
    report = check_method("gossip")
    assert {
        "runtimes.dp",
        "runtimes.no-dp",
        "ledger.noise",
        "ledger.plan",
        "capabilities.has_aggregator",
        "options.mix",
        "options.topology",
    } <= set(report.names())


def test_gossip_on_a_time_varying_directed_graph(installed_gossip):
    check_method(
        "gossip",
        checks=("runtimes", "ledger", "capabilities"),
        privacy=("dp",),
        options={"topology": "exponential", "mix": 0.3},
        clients=5,
    )


def test_gossip_on_local_peers_matches_the_simulator(installed_gossip):
    """One TLS peer process per client on 127.0.0.1, seeded streams (a simulation on
    devices): the same parameters, accuracies and bytes as the simulator."""
    report = check_method(
        "gossip",
        checks=("runtimes",),
        runtimes=("simulation",),
        device=True,
        privacy=("dp",),
        clients=2,
    )  # two peer processes: starting them (imports, data) is most of the time
    assert report.passed and "device" in report.results[0].message


def test_gossip_accepts_message_attacks_where_they_act(installed_gossip):
    check_attack("byzantine-random", methods=("gossip",), checks=("needs", "runtimes"))


def test_gossip_runs_through_the_cli(installed_gossip, capsys, results_dir):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "gossip",
                "-o",
                "mix=0.3",
                "--topology",
                "exponential",
                "--clients",
                "6",
                "--rounds",
                "3",
                "--results-dir",
                results_dir,
                "--json",
            ]
        )
    assert (info.value.code or 0) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["method"] == "gossip" and summary["epsilon"] is not None  # private by default
    assert summary["accuracy_mean"] > 0.2 and summary["bytes_sent"] > 0


def test_gossip_refuses_a_bad_option_before_training(installed_gossip, capsys):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "--method", "gossip", "-o", "mix=2"])
    assert info.value.code == 2 and "options.mix" in capsys.readouterr().err
