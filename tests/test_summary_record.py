"""The run summary is a typed record (`p4bench.records.RunSummary`): each figure one field,
written once by `p4bench.run.summary.summarize`; summary.json (`as_dict`) and MLflow's tags
are rendered from it, and it reads as summary.json's mapping too."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from p4bench.records import PrivacyFigures, RunSummary
from p4bench.run.artifacts import final_metrics, final_tags


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """A private and a non-private fedavg run (10 clients, 2 rounds; no tracking)."""
    from p4bench.config import RunConfig
    from p4bench.run.runner import run

    folder = str(tmp_path_factory.mktemp("summary-record"))
    base = dict(method="fedavg", clients=10, rounds=2, local_steps=1, seed=1, results_dir=folder)
    return (
        run(RunConfig(**base, epsilon=8.0), track=False, verify=False),
        run(RunConfig(**base), track=False, verify=False),
    )


def test_the_summary_is_a_typed_record_read_as_its_json(summaries):
    private, plain = (r.summary for r in summaries)
    for summary in (private, plain):
        assert isinstance(summary, RunSummary)
        rendered = summary.as_dict()
        assert list(summary) == list(rendered) and dict(summary) == rendered
        assert json.loads(json.dumps(rendered)) == rendered  # JSON as it is
        assert summary["accuracy_mean"] == summary.accuracy_mean
        assert summary["rounds_completed"] == summary.rounds_completed == 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            summary.accuracy_mean = 1.0  # type: ignore[misc]
        assert not hasattr(summary, "update") and not hasattr(summary, "__setitem__")
    assert isinstance(private.privacy, PrivacyFigures)
    assert private.epsilon == private["epsilon"] == private.privacy.epsilon <= 8.0 + 1e-6
    assert private.delta == private["delta"] and private.private and private["private"]
    assert plain.privacy is None and plain.epsilon is None and not plain.private
    assert "epsilon" in plain and plain["epsilon"] is None  # null, never 0.0
    assert "delta" not in plain


def test_summary_json_keeps_its_key_order(summaries):
    keys = list(summaries[1].summary)
    assert keys[:7] == ["run_id", "method", "attack", "defense", "dataset", "partitioner", "seed"]
    head = keys.index("accuracy_per_client")
    assert keys[head + 1 : head + 5] == [
        "eval_set",
        "accuracy",
        "epsilon",
        "epsilon_evaluation_clients",
    ]
    assert keys.index("rejections") < keys.index("private") < keys.index("compute_device")


def test_mlflow_tags_and_metrics_come_from_the_record(summaries):
    private, plain = summaries
    tags = final_tags(private.summary)
    assert tags["stopped_by_time_budget"] == "false"
    assert tags["dp.delta"] == str(private.summary.delta)
    assert tags["dp.certified"] == str(private.summary.certification.certified).lower()
    assert not any(key.startswith("dp.delta") for key in final_tags(plain.summary))
    assert final_metrics(private)["epsilon"] == private.summary.epsilon
    assert not any(key.startswith("epsilon") for key in final_metrics(plain))


def test_a_tuning_run_withholds_the_reported_accuracy(summaries):
    summary = summaries[1].summary
    withheld = summary.without_reported_accuracy()
    assert math.isnan(withheld.accuracy_mean) and math.isnan(withheld["accuracy_max"])
    assert withheld.accuracy_per_client == {} and withheld["accuracy_per_client"] == {}
    assert withheld.accuracy == summary.accuracy  # as summary.json has always had it
    assert summary.accuracy_per_client  # the record itself is unchanged
