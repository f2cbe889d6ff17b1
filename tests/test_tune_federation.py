"""Tuning inside the privacy story (#29 item 4): tuning runs train on the evaluation clients
alone by default, so no reported client's record takes part; `tune_on: federation` keeps
the whole federation and says that the tuned values are then not covered by the accounting."""

from __future__ import annotations

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.plugin_manager import default_registry
from p4bench.reproduce import PRESETS, plan_lr_tuning, plan_preset
from p4bench.runner import prepare
from p4bench.tune import TuneSpec, parse_tune, plan_tuning, run_tuning, write_tuned
from p4bench.tune_federation import check_tuning_federation, tuning_config, tuning_note

TINY = {"dataset": "digits", "clients": 10, "rounds": 1, "local_steps": 1, "seed": 3}


def _clients(tensors, index):
    """Each listed client's valid samples and labels (padding dropped)."""
    return [(tensors.x[i, : int(tensors.n[i])], tensors.y[i, : int(tensors.n[i])]) for i in index]


def test_a_tuning_run_holds_exactly_the_evaluation_clients_of_the_reported_partition():
    reported = RunConfig(method="p4", epsilon=15.0, neighbouring="add-remove", **TINY)
    tuning = tuning_config(reported, "evaluation-clients")
    assert (tuning.clients, tuning.federation_clients) == (2, 10)
    registry = default_registry()
    whole, alone = prepare(reported, registry), prepare(tuning, registry)
    evaluation = torch.nonzero(whole.job.data.evaluation).flatten().tolist()
    assert len(evaluation) == 2 and alone.job.data.num_clients == 2 and bool(alone.job.data.evaluation.all())
    for split in ("train", "test"):  # the same tensors, client by client, in the same order
        kept, theirs = _clients(getattr(alone.job.data, split), range(2)), _clients(getattr(whole.job.data, split), evaluation)
        assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kept, theirs))
    held = {int(i) for indices in alone.job.data.client_indices for i in indices}
    reported_records = {int(i) for c in range(10) if c not in evaluation for i in whole.job.data.client_indices[c]}
    assert held == {int(i) for c in evaluation for i in whole.job.data.client_indices[c]}
    assert not held & reported_records  # no reported client's record, train or test
    # the tuning runs' privacy is stated with the reported runs' delta (1/(10 N), N the data set's records)
    assert alone.ledger is not None and whole.ledger is not None and alone.ledger.delta == whole.ledger.delta


def test_plans_say_which_federation_and_tag_it():
    spec = parse_tune({"base": TINY, "grid": {"lr": [0.1, 1.0]}, "methods": ["fedavg"]})
    assert spec.tune_on == "evaluation-clients"
    planned = plan_tuning(spec)
    assert {(r.config.clients, r.config.federation_clients) for _, r in planned} == {(2, 10)}
    assert {r.tags["tune_on"] for _, r in planned} == {"evaluation-clients"}
    old = plan_tuning(parse_tune({"base": TINY, "grid": {"lr": [0.1]}, "methods": ["fedavg"], "tune_on": "federation"}))
    assert [(r.config.clients, r.config.federation_clients, r.tags["tune_on"]) for _, r in old] == [(10, None, "federation")]
    with pytest.raises(UsageError, match="tune_on must be one of"):
        parse_tune({"grid": {"lr": [1]}, "methods": ["fedavg"], "tune_on": "everyone"})
    # reproduce tunes on the evaluation clients of its tuning setting's partition, unless asked otherwise
    plan = plan_preset("heterogeneity", "digits", True, check_data=False, only={"method": ["fedavg"]})
    alone = plan_lr_tuning(PRESETS["heterogeneity"], plan.runs, "x-tune", (0.1, 1.0))
    whole = plan_lr_tuning(PRESETS["heterogeneity"], plan.runs, "x-tune", (0.1,), tune_on="federation")
    assert {(r.config.clients, r.config.federation_clients) for _, r in alone} == {(2, 10)}
    assert [(r.config.clients, r.config.federation_clients) for _, r in whole] == [(10, None)]
    reported_delta = {r.config.delta for r in plan.runs}
    assert {r.config.delta for _, r in alone} == reported_delta  # the runs' delta is not touched by tuning


def test_notes_say_which_mode():
    reported = RunConfig(**TINY)
    line = tuning_note("evaluation-clients", [tuning_config(reported, "evaluation-clients")])
    assert line.startswith("lr tuned on the 2 evaluation clients alone (disjoint from the 8 reported clients): "
                           "tuning spends none of the reported clients' privacy")
    old = tuning_note("federation", [tuning_config(reported, "federation")])
    assert "whole federation" in old and "not covered by the privacy accounting" in old


def test_too_few_evaluation_clients_is_one_clear_usage_error(tmp_path, capsys):
    with pytest.raises(UsageError, match="needs at least 2 of them.*gives 1"):
        tuning_config(RunConfig(**{**TINY, "clients": 5}), "evaluation-clients")
    tuning_config(RunConfig(**{**TINY, "clients": 5}), "federation")  # the whole federation is fine
    with pytest.raises(UsageError, match="p4l on the 2 evaluation clients alone.*at least 3"):
        check_tuning_federation([tuning_config(RunConfig(method="p4l", **TINY), "evaluation-clients")])
    with pytest.raises(SystemExit) as info:
        main(["tune", "--method", "fedavg", "--grid", "lr=0.1", "--set", "clients=5", "--results-dir", str(tmp_path),
              "--output", str(tmp_path / "t.yaml")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "needs at least 2 of them" in err and "Traceback" not in err
    # asked for, the whole federation tunes (and the output and file say what that means)
    with pytest.raises(SystemExit) as info:
        main(["tune", "--method", "fedavg", "--grid", "lr=0.1", "--set", "clients=5", "--set", "rounds=1",
              "--tune-on", "federation", "--results-dir", str(tmp_path), "--output", str(tmp_path / "t.yaml")])
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "not covered by the privacy accounting" in out
    assert yaml.safe_load((tmp_path / "t.yaml").read_text())["selection"]["tune_on"] == "federation"


@pytest.mark.parametrize("tune_on", ["evaluation-clients", "federation"])
def test_both_modes_run_and_record_which(tune_on, tmp_path):
    spec = TuneSpec("tf", {**TINY, "results_dir": str(tmp_path)}, {"fedavg": {"lr": (0.1, 1.0)}}, (3,), tune_on=tune_on)
    result = run_tuning(spec)
    assert set(result.best) == {"fedavg"} and all(p.scores for p in result.points["fedavg"])
    document = yaml.safe_load(write_tuned(result, tmp_path / "tuned.yaml").read_text())
    assert document["selection"]["tune_on"] == tune_on and document["selection"]["federation"] == result.scope
    alone = tune_on == "evaluation-clients"
    assert ("evaluation clients alone" in result.scope) == alone and ("not covered" in result.scope) == (not alone)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tf").experiment_id])
    assert len(runs) == 2 and {r.data.tags["tune_on"] for r in runs} == {tune_on}
    assert {r.data.params["clients"] for r in runs} == {"2" if alone else "10"}
