"""The built-in plugins pass the conformance kit (`p4bench.testing`): the same results
in every runtime, every DP step in the ledger as planned, honest capabilities, and
declared options that round-trip."""

from __future__ import annotations

import pytest

from p4bench.testing import check_attack, check_defense, check_method

pytestmark = pytest.mark.usefixtures("fresh_registry")


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "local", "dp-dsgd", "dp-dsgt", "proxyfl"])
def test_builtin_methods_conform(method):
    check_method(method)


def test_p4_conforms():
    # one group of 4 (group_size defaults to min(4, clients)); runtimes compared with DP on
    # (the no-DP path is the same code without the mechanism, covered by the baselines)
    check_method("p4", privacy=("dp",))


def test_p4_span_path_conforms():
    # the fused span path draws K releases' noise at once: the ledger check counts per phase
    report = check_method("p4", checks=("ledger",), options={"fused": "span"})
    assert report.passed


def test_centralized_conforms():
    # the server adds the pooled step's noise from its own stream, outside the clients'
    # mechanisms, so the kit cannot count it: every other check applies
    report = check_method("centralized", skip=("ledger.noise",))
    assert not report.failed("ledger")


@pytest.mark.parametrize("attack", ["label-flip", "byzantine-random", "alie"])
def test_builtin_attacks_conform(attack):
    check_attack(attack)


@pytest.mark.parametrize("defense", ["m-krum", "median", "norm-clipping", "ideal"])
def test_builtin_defenses_conform(defense):
    check_defense(defense)
