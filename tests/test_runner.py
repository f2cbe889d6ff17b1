"""End-to-end runs on the bundled digits data."""

from __future__ import annotations

import numpy as np
import pytest

from p4bench.config import RunConfig
from p4bench.errors import DataError, IncompatibleError, UnknownNameError
from p4bench.run.runner import run


def test_fedavg_on_iid_digits_reaches_90_percent(results_dir):
    result = run(RunConfig(method="fedavg", rounds=30, results_dir=results_dir), track=False)
    assert result.summary["accuracy_mean"] >= 0.90
    assert result.summary["reported_clients"] == 16  # 20% evaluation clients are excluded


def test_local_training_runs_and_learns(results_dir):
    result = run(RunConfig(method="local", rounds=10, results_dir=results_dir), track=False)
    assert result.summary["accuracy_mean"] > 0.6
    assert result.summary["bytes_sent"] == 0  # local training never communicates


def test_alpha_partition_gives_skewed_clients(small_config):
    result = run(
        small_config(method="local", partitioner="alpha", similarity=0.0, clients=10), track=False
    )
    assert result.summary["accuracy_mean"] > 0.9  # one class per client is easy locally


def test_reported_clients_exclude_evaluation_and_malicious(small_config):
    from p4bench import hookimpl
    from p4bench.engine import Attack
    from p4bench.host.manager import create_plugin_manager

    class Nothing(Attack):
        name = "nothing"

    class Plugin:
        @hookimpl
        def register_attacks(self):
            return [Nothing]

    pm = create_plugin_manager(extra_plugins=(Plugin(),), autoload=False)
    result = run(
        small_config(clients=10, attack="nothing", malicious_fraction=0.3),
        plugin_manager=pm,
        track=False,
    )
    info = result.info
    assert info.evaluation.sum() == 2 and info.malicious.sum() == 3
    reported = [int(c) for c in result.summary["accuracy_per_client"]]
    assert reported == list(np.flatnonzero(~info.evaluation & ~info.malicious))


def test_bad_requests_fail_before_training(small_config):
    with pytest.raises(
        UnknownNameError,
        match="registered methods: centralized, dp-cga, dp-dsgd, dp-dsgt, fedavg, feddf, local",
    ):
        run(small_config(method="nope"), track=False)
    with pytest.raises(DataError, match="at most"):
        run(small_config(samples_per_client=5000), track=False)


def test_defense_on_a_method_without_aggregation_is_refused(small_config):
    from p4bench import hookimpl
    from p4bench.engine import Defense
    from p4bench.host.manager import create_plugin_manager

    class KeepAll(Defense):
        name = "keep-all"

    class Plugin:
        @hookimpl
        def register_defenses(self):
            return [KeepAll]

    pm = create_plugin_manager(extra_plugins=(Plugin(),), autoload=False)
    with pytest.raises(IncompatibleError, match="aggregates none"):
        run(small_config(method="local", defense="keep-all"), plugin_manager=pm, track=False)
