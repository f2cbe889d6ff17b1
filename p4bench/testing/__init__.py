"""Conformance kit for p4bench plugin authors.

One call checks a plugin against the engine's contract and returns a report (raising
an AssertionError that lists every failed check)::

    from p4bench.testing import check_method, check_attack, check_defense

    check_method("my-method")              # a registered name, or the Method subclass
    check_method(MyMethod, clients=6, options={"mix": 0.3}, device=True)
    check_attack("my-attack", methods=("fedavg", "dp-dsgd", "local"))
    check_defense(MyDefense)

Method checks: state layout and message addressing; the same results in the
`simulation`, `reference` and `bytes` runtimes (and `device`, opt-in) with DP on and
off; every DP step reaches the ledger (noise draws = releases, matching
`privacy_plan()`); declared capabilities match what the run does; declared options
round-trip. See `p4bench.testing.methods` and `p4bench.testing.threats` for each
check, and docs/method-authors.md. In pytest, enable the `conformance` fixture with
``pytest_plugins = ["p4bench.testing.pytest_plugin"]``.
"""

from p4bench.testing.methods import METHOD_CHECKS, check_method
from p4bench.testing.report import CheckResult, ConformanceError, ConformanceReport
from p4bench.testing.runs import BASE_CONFIG
from p4bench.testing.threats import ATTACK_CHECKS, DEFENSE_CHECKS, check_attack, check_defense

__all__ = [
    "ATTACK_CHECKS",
    "BASE_CONFIG",
    "CheckResult",
    "ConformanceError",
    "ConformanceReport",
    "DEFENSE_CHECKS",
    "METHOD_CHECKS",
    "check_attack",
    "check_defense",
    "check_method",
]
