"""`--time-budget MINUTES`: the round driver stops any run after the first round that ends
past the budget (simulator, bytes and device runtimes alike), the summary says how many
rounds ran, and a private run's epsilon is that of the releases it took."""

from __future__ import annotations

import hashlib
import json
from itertools import count

import numpy as np
import pytest

from p4bench.cli import main
from p4bench.config import RunConfig, resolve_config
from p4bench.engine import schedule
from p4bench.errors import ConfigError
from p4bench.run.runner import run

FAST = {
    "device_exchange_timeout_s": 30,
    "device_round_timeout_s": 120,
    "device_startup_timeout_s": 180,
}


@pytest.fixture
def minute_clock(monkeypatch):
    """The budget's clock advances one minute every time it is read."""
    minutes = count()
    monkeypatch.setattr(schedule, "BUDGET_CLOCK", lambda: 60.0 * next(minutes))


def test_budget_is_validated_and_kept_out_of_old_hashes(tmp_path):
    for bad in (0, -1.0, "soon"):
        with pytest.raises(ConfigError, match="time_budget_min"):
            RunConfig(time_budget_min=bad)
    assert RunConfig(time_budget_min=5).time_budget_min == 5.0
    # runs without a budget keep their hash (sweeps find their finished runs again)
    plain = RunConfig()
    before = {
        k: v
        for k, v in plain.to_dict().items()
        if k
        not in (
            "experiment",
            "tracking_uri",
            "results_dir",
            "time_budget_min",
            "device",
            "noise_generator",
            "federation_clients",
            "memory_budget_gb",
            "eval_set",
            "hold_out_public",
            "unseen_fraction",
            "verify",
            "threads",
        )
    }
    assert (
        plain.config_hash()
        == hashlib.sha256(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()[:16]
    )
    assert plain.config_hash() != plain.replace(time_budget_min=50.0).config_hash()
    path = tmp_path / "run.yaml"
    path.write_text("method: fedavg\ntime-budget-min: 50\n")
    assert resolve_config(path).time_budget_min == 50.0


@pytest.mark.parametrize("runtime", ["simulation", "bytes"])
def test_budget_counts_the_rounds_that_finished_within_it(small_config, minute_clock, runtime):
    # minute 0 at the start; rounds end at minutes 1, 2, 3: the third ends past 2.5 minutes,
    # so the run stops there and its figures are the second round's (the papers' count)
    result = run(small_config(rounds=10, time_budget_min=2.5, runtime=runtime), track=False)
    summary = result.summary
    assert (
        summary["rounds"] == 10
        and summary["rounds_completed"] == 2
        and summary["stopped_by_time_budget"]
    )
    assert summary["rounds_past_budget"] == 1 and summary["rounds_within_budget"] == 2
    assert [r.step for r in result.outcome.reports] == [
        1,
        2,
        3,
    ]  # the third ran (bytes, privacy) and is logged
    # the accuracy reported is the last round's within the budget: that of a plain 2-round run
    plain = run(small_config(rounds=2, runtime=runtime), track=False)
    np.testing.assert_allclose(result.outcome.accuracy, plain.outcome.accuracy, atol=1e-6)
    np.testing.assert_allclose(
        result.outcome.accuracy, result.outcome.reports[1].accuracy, atol=1e-6
    )
    assert summary["accuracy_mean"] == pytest.approx(plain.summary["accuracy_mean"])
    assert not plain.summary["stopped_by_time_budget"] and plain.summary["rounds_completed"] == 2
    assert "rounds_past_budget" not in plain.summary


def test_a_first_round_past_the_budget_is_kept(small_config, minute_clock):
    summary = run(small_config(rounds=10, time_budget_min=0.5), track=False).summary
    assert summary["stopped_by_time_budget"] and summary["rounds_completed"] == 1
    assert summary["rounds_within_budget"] == 0 and summary["rounds_past_budget"] == 0


def test_budget_that_is_never_reached_runs_every_round(small_config, minute_clock):
    summary = run(small_config(rounds=3, time_budget_min=100.0), track=False).summary
    assert summary["rounds_completed"] == 3 and not summary["stopped_by_time_budget"]


def test_private_run_stopped_early_reports_the_epsilon_of_its_releases(small_config, minute_clock):
    config = small_config(rounds=10, epsilon=8.0, noise_source="seeded")
    stopped = run(config.replace(time_budget_min=2.5), track=False).summary
    full = run(config, track=False).summary
    assert stopped["rounds_completed"] == 2 and stopped["noise_multiplier"] == pytest.approx(
        full["noise_multiplier"]
    )
    # sigma calibrated for all 10 rounds, the ledger counts the 3 rounds taken (the third ran past the budget)
    assert stopped["epsilon"] < full["epsilon"] <= 8.0 + 1e-6
    assert (
        "2 of 10 rounds" in stopped["epsilon_scope"]
        and "the 1 that ran past it" in stopped["epsilon_scope"]
    )
    assert "target epsilon 8" in stopped["epsilon_scope"]
    assert "epsilon_scope" not in full


@pytest.mark.parametrize("runtime", ["simulation", "bytes"])
def test_cli_time_budget_on_a_real_clock(tmp_path, capsys, runtime):
    """0.002 minutes (0.12 s) cannot hold 300 rounds; the JSON line, the table and MLflow say so."""
    main_args = [
        "run",
        "--method",
        "fedavg",
        "--clients",
        "6",
        "--rounds",
        "300",
        "--local-steps",
        "1",
        "--runtime",
        runtime,
        "--time-budget",
        "0.002",
        "--results-dir",
        str(tmp_path / "runs"),
        "--json",
    ]
    with pytest.raises(SystemExit) as info:
        main(main_args)
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by_time_budget"] and 1 <= summary["rounds_completed"] < 300
    assert summary["time_budget_min"] == 0.002
    assert "stopped by the time budget" in err
    import mlflow

    client = mlflow.MlflowClient(summary["tracking_uri"])
    logged = client.get_run(summary["run_id"])
    assert logged.data.tags["stopped_by_time_budget"] == "true"
    assert logged.data.metrics["rounds_completed"] == summary["rounds_completed"]


def test_device_peers_stop_after_the_same_round(small_config):
    """The launcher's clock decides; every peer (and the server peer) stops after step s,
    and the ledger holds the DP releases of exactly the rounds completed."""
    # seeded DP randomness (a marked simulation on devices) so that the simulator can check the epsilon
    config = small_config(
        method="fedavg",
        clients=3,
        rounds=200,
        eval_fraction=0.0,
        noise_multiplier=1.0,
        noise_source="seeded",
        device_simulation=True,
    )
    result = run(
        config.replace(
            runtime="device", time_budget_min=0.02, options={"device_local_peers": 3, **FAST}
        ),
        track=False,
    )
    summary, device = result.summary, result.summary["device"]
    assert not device["dropped"]
    assert all(peer["finished"] for peer in device["peers"].values())
    finish = device["finish"]
    assert summary["stopped_by_time_budget"] and summary["rounds_completed"] < 200
    # the launcher saw the budget spent after step decided_after_step: the rounds before it count
    assert summary["rounds_completed"] == max(finish["decided_after_step"] - 1, 1)
    ran = finish["after_step"]
    assert (
        ran
        == summary["rounds_completed"] + summary["rounds_past_budget"]
        == len(result.outcome.reports)
    )
    assert finish["after_step"] >= finish["decided_after_step"] + 2
    assert finish["consistent"] and set(finish["stopped_after_step"].values()) == {
        finish["after_step"]
    }
    assert set(finish["stopped_after_step"]) == {"0", "1", "2", "server"}
    same_rounds = run(
        config.replace(rounds=ran), track=False
    ).summary  # the releases of every round that ran
    assert summary["epsilon"] == pytest.approx(same_rounds["epsilon"])
    assert f"{summary['rounds_completed']} of 200 rounds" in summary["epsilon_scope"]


def test_the_stop_is_decided_by_one_rule_that_always_asks_the_budget():
    """`stop_reason` serves the simulator's driver and the device launcher alike: the
    method's own rule ends the run (and is judged only where every client is held), the
    stop rule otherwise; the budget is asked even when the method's rule ends the run, so
    the round that overran it is recorded either way."""
    from types import SimpleNamespace

    ticks = iter([0.0, 0.0, 120.0])  # made at 0; round 1 ends at 0; round 2 at 2 minutes
    budget = schedule.TimeBudget(1.0, clock=lambda: next(ticks))
    done = SimpleNamespace(finished=lambda extra: bool(extra.get("done")))
    assert schedule.stop_reason(1, {}, budget, done) is None
    assert schedule.stop_reason(2, {"done": True}, budget, done) == "method"
    assert budget.overran_at == 2
    assert (
        schedule.stop_reason(3, {"done": True}, schedule.never, done, holds_everyone=False) is None
    )
    assert schedule.stop_reason(3, {}, lambda step: True, done) == "stop"
    assert schedule.budget_rule(None) is schedule.never and isinstance(
        schedule.budget_rule(2.0), schedule.TimeBudget
    )
