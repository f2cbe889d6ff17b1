"""#44: what a run says about privacy. A non-private run's epsilon is `none (no DP)` (JSON
null, no MLflow epsilon), never a number or a certificate; the evaluation clients (reserved
for tuning, yet training in every run) have their own epsilon in the summary, the table
and MLflow."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from p4bench.cli.summary_table import print_summary
from p4bench.privacy import RDPAccountant
from p4bench.privacy.ledger import PrivacyLedger
from p4bench.privacy.mechanism import DPSettings
from p4bench.privacy.pld import PLDAccountant
from p4bench.records import Release
from p4bench.run.artifacts import final_metrics


def _ledger(clients: int = 4) -> PrivacyLedger:
    settings = DPSettings(clip=1.0, noise_multiplier=1.0, neighbouring="add-remove")
    return PrivacyLedger(
        settings, PLDAccountant(), RDPAccountant(), clients, 1e-5, None, {}, pld=PLDAccountant()
    )


def test_ledger_reports_the_evaluation_clients_epsilon_apart():
    ledger = _ledger()
    ledger.run_started(run=SimpleNamespace(evaluation=np.array([False, False, True, True])))
    ledger.record_release(
        Release(clients=(0, 1, 2, 3), sample_rate=0.1, noise_multiplier=1.0, steps=20)
    )
    ledger.record_release(
        Release(clients=(3,), sample_rate=0.1, noise_multiplier=1.0, steps=60)
    )  # client 3 trains more
    reported = np.array([True, True, False, False])
    summary = ledger.summary(reported)
    epsilons = ledger.epsilons()
    assert summary["epsilon"] == pytest.approx(epsilons[:2].max())
    assert summary["epsilon_evaluation_clients"] == pytest.approx(epsilons[3])
    assert epsilons[3] > summary["epsilon"]
    assert summary["evaluation_clients"] == 2
    # told explicitly, the mask wins over the run's
    assert ledger.summary(reported, evaluation=np.array([False, False, True, False]))[
        "epsilon_evaluation_clients"
    ] == pytest.approx(epsilons[2])


def test_ledger_without_evaluation_clients_or_not_told():
    ledger = _ledger()
    ledger.record_release(
        Release(clients=(0, 1, 2, 3), sample_rate=0.1, noise_multiplier=1.0, steps=20)
    )
    everyone = np.ones(4, dtype=bool)
    assert ledger.summary(everyone)["epsilon_evaluation_clients"] is None  # never told who they are
    assert "evaluation_clients" not in ledger.summary(everyone)
    ledger.run_started(run=SimpleNamespace(evaluation=np.zeros(4, dtype=bool)))
    figures = ledger.summary(everyone)
    assert figures["epsilon_evaluation_clients"] is None and figures["evaluation_clients"] == 0


def _base(**changes):
    summary = {
        "method": "fedavg",
        "dataset": "digits",
        "seed": 0,
        "attack": None,
        "defense": None,
        "rounds": 3,
        "reported_clients": 16,
        "clients": 20,
        "evaluation_clients": 4,
        "accuracy_mean": 0.8,
        "accuracy_min": 0.7,
        "accuracy_max": 0.9,
        "wall_time_s": 1.0,
        "epsilon": None,
        "epsilon_evaluation_clients": None,
    }
    summary.update(changes)
    return summary


def _printed(summary) -> str:
    text = io.StringIO()
    print_summary(Console(file=text, width=250), summary)
    return text.getvalue()


def _row(printed: str, label: str) -> str:
    line = next(line for line in printed.splitlines() if f" {label} " in line)
    return " ".join(line.replace("│", " ").split())


@pytest.mark.parametrize(
    "extra",
    [
        {
            "private": False,
            "epsilon_certified": False,
            "uncertified_reason": "non-private run: no DP, no epsilon",
        },
        {},  # a summary without the certification's keys
        {
            "private": False,
            "epsilon": 0.0,
            "epsilon_mean": 0.0,
            "epsilon_certified": False,
        },  # a stray 0.0: still no DP
    ],
)
def test_a_non_private_run_prints_epsilon_none(extra):
    printed = _printed(_base(**extra))
    assert _row(printed, "epsilon") == "epsilon none (no DP)"
    assert "UNCERTIFIED" not in printed and "0.000" not in printed and "certified" not in printed
    assert "evaluation clients' epsilon" not in printed  # no DP: nothing spent, no row


PRIVATE = {
    "private": True,
    "epsilon": 7.99,
    "epsilon_mean": 7.99,
    "epsilon_rdp": 9.4,
    "epsilon_pld": 7.99,
    "accountant": "pld",
    "delta": 1e-5,
    "noise_multiplier": 0.7,
    "neighbouring": "add-remove",
    "clients_stopped": 0,
    "epsilon_certified": True,
    "post_processing": "verified",
    "record_isolation": "verified",
    "epsilon_evaluation_clients": 8.25,
}


def test_a_private_run_prints_the_evaluation_clients_epsilon_on_its_own_line():
    printed = _printed(_base(**PRIVATE))
    assert _row(printed, "epsilon").startswith("epsilon certified 7.990 max")
    row = _row(printed, "evaluation clients' epsilon")
    assert row.startswith(
        "evaluation clients' epsilon 8.250 max over the 4 evaluation clients (pld) in this run"
    )
    uncertified = _printed(
        _base(**{**PRIVATE, "epsilon_certified": False, "uncertified_reason": "a reason"})
    )
    assert "UNCERTIFIED" in _row(uncertified, "evaluation clients' epsilon")
    unknown = _printed(
        _base(**{**PRIVATE, "epsilon_evaluation_clients": None, "evaluation_clients": None})
    )
    assert _row(unknown, "evaluation clients' epsilon") == "evaluation clients' epsilon not known"
    none = _printed(
        _base(**{**PRIVATE, "epsilon_evaluation_clients": None, "evaluation_clients": 0})
    )
    assert "evaluation clients' epsilon" not in none


def test_mlflow_final_metrics_carry_the_evaluation_clients_epsilon_and_no_epsilon_without_dp():
    outcome = SimpleNamespace(reports=[])
    private = final_metrics(
        SimpleNamespace(summary=_base(**PRIVATE), wall_time_s=1.0, outcome=outcome)
    )
    assert private["epsilon"] == 7.99 and private["epsilon_evaluation_clients"] == 8.25
    plain = final_metrics(
        SimpleNamespace(summary=_base(private=False), wall_time_s=1.0, outcome=outcome)
    )
    assert not any(key.startswith("epsilon") for key in plain)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A private and a non-private fedavg run (6 clients, 2 rounds; no tracking)."""
    from p4bench.config import RunConfig
    from p4bench.run.runner import run

    folder = str(tmp_path_factory.mktemp("privacy-summary"))
    base = dict(method="fedavg", clients=10, rounds=2, local_steps=1, seed=1, results_dir=folder)
    return (
        run(RunConfig(**base, epsilon=8.0), track=False, verify=False).summary,
        run(RunConfig(**base), track=False, verify=False).summary,
    )


def test_runs_report_the_evaluation_clients_and_null_epsilon(runs):
    from p4bench.cli.run import json_default
    from p4bench.studies.equal_privacy import from_summary

    private, plain = runs
    assert private["evaluation_clients"] == 2 and private["reported_clients"] == 8
    assert 0 < private["epsilon_evaluation_clients"] <= 8.0 + 1e-6
    assert "evaluation clients' epsilon" in _printed(private)
    assert plain["private"] is False and plain["evaluation_clients"] == 2
    line = json.loads(json.dumps(plain.as_dict(), default=json_default))  # the `--json` line
    assert line["epsilon"] is None and line["epsilon_evaluation_clients"] is None
    assert _row(_printed(plain), "epsilon") == "epsilon none (no DP)"
    assert (
        from_summary(plain).mark == "non-private" and from_summary(private).private
    )  # what studies read


def test_tuning_says_what_it_spent_of_the_evaluation_clients_privacy(tmp_path):
    from p4bench.studies.tune import TuneSpec, run_tuning
    from p4bench.studies.tune_scope import evaluation_clients_line, tuning_lines

    tiny = {
        "dataset": "digits",
        "clients": 10,
        "rounds": 1,
        "local_steps": 1,
        "seed": 3,
        "epsilon": 8.0,
        "results_dir": str(tmp_path),
    }
    spec = TuneSpec("tp", tiny, {"fedavg": {"lr": (0.1, 1.0)}}, (3,), tune_on="evaluation-clients")
    result = run_tuning(
        spec, allow_mixed_privacy=True
    )  # certification is not what this test is about
    line = evaluation_clients_line(result)
    assert line is not None and line in tuning_lines(result)
    assert line.startswith(
        "evaluation clients' own privacy: each partition's evaluation clients trained in 2 tuning "
        "runs (1 partition); epsilon up to "
    )
    spent = float(line.split("epsilon up to ")[1].split(" ")[0])
    assert 0 < spent <= 8.0 + 1e-6
    # read back from the store (a resumed tuning skips its finished runs): the same line
    again = run_tuning(spec, allow_mixed_privacy=True)
    assert {r.status for r in again.report.records} == {"skipped"} and evaluation_clients_line(
        again
    ) == line
    # non-private tuning spends nothing: no line
    plain = TuneSpec(
        "tq",
        {**tiny, "epsilon": None},
        {"fedavg": {"lr": (0.1,)}},
        (3,),
        tune_on="evaluation-clients",
    )
    assert evaluation_clients_line(run_tuning(plain)) is None
