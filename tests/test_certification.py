"""Every run says whether its epsilon holds: summary, `--json`, MLflow tags, and the
summary table, where an uncertified figure is never shown as a plain number."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.engine import DEFAULT_EPSILON
from p4bench.privacy.certification import certify
from p4bench.run.runner import run


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def test_dp_methods_are_private_by_default_and_certified(small_config, verify_on):
    for method in ("p4", "proxyfl", "dp-dsgt", "dp-dsgd"):
        summary = run(small_config(method=method, rounds=2), track=False).summary
        assert (
            summary["private"]
            and summary["epsilon_certified"]
            and summary["uncertified_reason"] is None
        ), method
        assert 0 < summary["epsilon"] <= DEFAULT_EPSILON and summary["dp_randomness"] == "seeded", (
            method
        )


def test_no_dp_opts_out_and_says_so(small_config):
    summary = run(small_config(method="p4", rounds=1, no_dp=True), track=False).summary
    assert (
        summary["private"] is False
        and summary["epsilon"] is None
        and summary["epsilon_certified"] is False
    )
    assert "non-private" in summary["uncertified_reason"]
    fedavg = run(
        small_config(method="fedavg", rounds=1), track=False
    ).summary  # not a DP method: non-private
    assert fedavg["private"] is False and fedavg["epsilon"] is None


def test_paper_teacher_is_reported_uncertified_in_summary_and_tags(small_config, tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    config = small_config(
        method="p4",
        rounds=2,
        epsilon=8.0,
        tracking_uri=uri,
        options={"teacher": "private", "alpha": 0.5},
    )
    summary = run(config).summary
    assert (
        summary["epsilon_certified"] is False and "teacher=private" in summary["uncertified_reason"]
    )
    tags = MlflowClient(uri).get_run(summary["run_id"]).data.tags
    assert tags["dp.certified"] == "false" and "teacher=private" in tags["dp.uncertified_reason"]
    assert tags["dp.private"] == "true" and tags["dp.randomness"] == "seeded"


def test_certify_names_each_step_outside_the_ledger():
    private = RunConfig(method="fedavg", epsilon=4.0, noise_source="seeded")
    assert certify(private, [], separate_parties=False).certified
    scatter = certify(
        private.replace(features="scatter", feature_norm="client"), [], separate_parties=False
    )
    assert not scatter.certified and "feature_norm=client" in scatter.reason
    assert certify(
        private.replace(features="scatter"), [], separate_parties=False
    ).certified  # per-sample default
    devices = certify(private, [], separate_parties=True)
    assert not devices.certified and "seeded" in devices.reason
    assert certify(private.replace(noise_source="secure"), [], separate_parties=True).certified
    both = certify(private, ["a method step"], separate_parties=True)
    assert both.reasons[0] == "a method step" and len(both.reasons) == 2


def test_cli_shows_uncertified_epsilon_in_red_words(capsys, results_dir, verify_on):
    args = [
        "run",
        "--method",
        "proxyfl",
        "--clients",
        "6",
        "--rounds",
        "1",
        "--epsilon",
        "8",
        "--results-dir",
        results_dir,
    ]
    code, out, _ = invoke([*args, "-o", "teacher=private", "--json"], capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert (
        code == 0
        and summary["epsilon_certified"] is False
        and "teacher=private" in summary["uncertified_reason"]
    )
    code, out, err = invoke(args, capsys)
    assert code == 0 and "certified" in out and "UNCERTIFIED" not in out


def test_no_dp_with_epsilon_exits_2(capsys):
    code, _, err = invoke(["run", "--method", "p4", "--no-dp", "--epsilon", "3"], capsys)
    assert code == 2 and "--no-dp" in err


def test_an_accountant_certifies_only_the_sampling_and_view_it_is_proved_for():
    """noble (the P4 paper's bound) is stated for batches of fixed size drawn without
    replacement and, in its third-party view, for an observer of the aggregate only."""
    from p4bench.privacy.accountants import NobleAccountant
    from p4bench.privacy.pld import PLDAccountant
    from p4bench_baselines.fedavg import FedAvg
    from p4bench_p4.method import P4

    config = RunConfig(method="p4", epsilon=12.0, accountant="noble")
    assert certify(
        config.replace(accountant="pld"), [], False, PLDAccountant, P4.capabilities
    ).certified
    aggregator = certify(config, [], False, NobleAccountant, P4.capabilities)
    assert not aggregator.certified and aggregator.reasons == (
        "accountant noble is proved for fixed-size batches; this run samples poisson batches, so its figure does not "
        "bound the run (the pld epsilon beside it is the tight one)",
    )
    third_party = certify(
        config.replace(options={"noble_view": "third-party"}),
        [],
        False,
        NobleAccountant,
        FedAvg.capabilities,
    )
    assert len(third_party.reasons) == 2 and "sends individual updates" in third_party.reasons[1]


def test_a_noble_run_is_uncertified_with_the_tight_figure_beside_it(capsys, results_dir):
    args = [
        "run",
        "--method",
        "p4",
        "--clients",
        "6",
        "--rounds",
        "2",
        "--epsilon",
        "12",
        "--accountant",
        "noble",
        "-o",
        "noble_view=third-party",
        "--results-dir",
        results_dir,
        "--json",
    ]
    code, out, _ = invoke(args, capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["epsilon_certified"] is False
    assert (
        "poisson" in summary["uncertified_reason"]
        and "noble_view=third-party" in summary["uncertified_reason"]
    )
    assert (
        summary["epsilon_pld"] > 0
    )  # the tight figure, for the run's own sampling, reported beside it


class _SkipsTheMechanism:
    """A third-party method's honest mistake: it trains through `ctx.loss_and_grad`, as
    the method guide shows, and never calls `ctx.dp`, in a private run."""

    @staticmethod
    def build(plan_nothing: bool = False):
        from p4bench_baselines.local import LocalTraining

        class NoDP(LocalTraining):
            name = "test-no-dp"

            def local_update(self, state, train, ctx):
                from p4bench.engine.training import fixed_size_batches, gather_batch

                index, mask = fixed_size_batches(ctx, train)
                loss, grads = ctx.loss_and_grad(
                    state["params"],
                    gather_batch(train.x, index),
                    gather_batch(train.y, index),
                    mask.float(),
                )
                return {
                    **state,
                    "params": {k: v - 0.1 * grads[k] for k, v in state["params"].items()},
                }, loss.double()

            def privacy_plan(self):
                return [] if plan_nothing else super().privacy_plan()

        return NoDP


@pytest.mark.parametrize("plan_nothing", [False, True])
def test_a_method_that_skips_the_dp_mechanism_is_not_certified(
    plan_nothing, results_dir, verify_on
):
    from p4bench.hookspecs import hookimpl
    from p4bench.host.manager import create_plugin_manager

    method = _SkipsTheMechanism.build(plan_nothing)

    class Plugin:
        @hookimpl
        def register_methods(self):
            return [method]

    pm = create_plugin_manager(extra_plugins=(Plugin(),), autoload=False)
    config = RunConfig(
        method="test-no-dp",
        clients=4,
        rounds=2,
        local_steps=2,
        results_dir=results_dir,
        **({"noise_multiplier": 1.0} if plan_nothing else {"epsilon": 4.0}),
    )
    uri = f"sqlite:///{results_dir}.db"
    summary = run(config.replace(tracking_uri=uri), plugin_manager=pm).summary
    assert summary["private"] is True and summary["epsilon_certified"] is False
    tags = (
        MlflowClient(uri).get_run(summary["run_id"]).data.tags
    )  # set at the start, corrected at the end
    assert (
        tags["dp.certified"] == "false"
        and tags["dp.uncertified_reason"] == summary["uncertified_reason"]
    )
    expected = (
        "declares no DP release"
        if plan_nothing
        else "the ledger recorded no release in its 2 round(s)"
    )
    assert expected in summary["uncertified_reason"], summary["uncertified_reason"]
    honest = run(
        config.replace(method="local"), track=False
    ).summary  # the same run through ctx.dp: certified
    assert honest["epsilon_certified"] is True and honest["epsilon"] > 0
