"""Equal privacy in every study table: one neighbouring relation, certified epsilons, or an
explicit flag that marks the runs. MLflow stores are written with known tags (no training);
studies that would train run on a fake backend."""

from __future__ import annotations

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

import p4bench.run.runner
from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.errors import UsageError
from p4bench.studies.backends import Backend, RunRecord
from p4bench.studies.claims import ClaimCheck
from p4bench.studies.compare import compare_experiment
from p4bench.studies.equal_privacy import (
    RunPrivacy,
    UnequalPrivacyError,
    check_privacy,
    from_config,
    from_row,
    settle_relation,
)
from p4bench.studies.impact import compute_impact
from p4bench.studies.reproduce import (
    PRESETS,
    TUNE_GRID,
    apply_tuned_lr,
    plan_lr_tuning,
    plan_preset,
    quick_claims,
    reproduce,
)
from p4bench.studies.sweep import expand, parse_sweep, run_sweep
from p4bench.studies.tune import TuneSpec, run_tuning

TINY = {"dataset": "digits", "clients": 8, "rounds": 2, "local_steps": 2}


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def no_training(monkeypatch):
    monkeypatch.setattr(p4bench.run.runner, "run", lambda *a, **k: pytest.fail("nothing may train"))


# -- the rule ---------------------------------------------------------------------------------


def test_rule_refuses_mixed_relations_and_uncertified_runs_naming_them():
    ok = [
        RunPrivacy("p4 seed=0", "p4", True, "add-remove"),
        RunPrivacy("fedavg seed=0", "fedavg", True, "add-remove"),
        RunPrivacy("local seed=0", "local", False),
    ]
    verdict = check_privacy(ok)
    assert (
        verdict.ok and verdict.relation == "add-remove" and verdict.needs_column
    )  # non-private runs are marked
    assert [r.mark for r in verdict.runs] == ["add-remove", "add-remove", "non-private"]
    assert verdict.note() == (
        "privacy: private, add-remove neighbouring, certified epsilon: p4, fedavg; "
        "non-private: local"
    )
    assert not check_privacy(ok[:2]).needs_column  # one mark: nothing to mark per row

    mixed = [*ok, RunPrivacy("p4 seed=1", "p4", True, "replace-one")]
    with pytest.raises(
        UnequalPrivacyError,
        match=r"different neighbouring relations \(add-remove: p4 seed=0, "
        r"fedavg seed=0; replace-one: p4 seed=1\).*--allow-mixed-privacy",
    ) as info:
        check_privacy(mixed, what="experiment 'x'")
    assert (
        info.value.exit_code == 2
        and str(info.value).startswith("experiment 'x': refusing")
        and "\n" not in str(info.value)
    )
    uncertified = [
        *ok,
        RunPrivacy(
            "proxyfl seed=0", "proxyfl", True, "add-remove", False, "distils from a non-DP model"
        ),
    ]
    with pytest.raises(
        UsageError,
        match=r"uncertified epsilon: proxyfl seed=0 \{why: distils from a non-DP model\}",
    ):
        check_privacy(uncertified)
    assert check_privacy(uncertified, certification=False).ok  # planned runs: relations only

    allowed = check_privacy(mixed + uncertified[-1:], allow_mixed=True)
    assert not allowed.ok and "--allow-mixed-privacy was given" in allowed.warning
    assert [r.mark for r in allowed.runs][-2:] == ["replace-one", "add-remove UNCERTIFIED"]


def test_rule_refuses_private_runs_under_different_deltas_or_accountants():
    from p4bench.studies.equal_privacy import from_summary

    def summary(method, delta, accountant="pld"):
        return {
            "method": method,
            "seed": 0,
            "private": True,
            "epsilon_certified": True,
            "neighbouring": "add-remove",
            "delta": delta,
            "accountant": accountant,
            "epsilon": 8.0,
        }

    same = [from_summary(summary("feddf", 6.96e-5)), from_summary(summary("pdsl", 6.96e-5))]
    assert check_privacy(same).ok and same[0].delta == 6.96e-5 and same[0].accountant == "pld"
    with pytest.raises(
        UnequalPrivacyError,
        match=r"different delta \(0.000696: pdsl seed=0; 6.96e-05: feddf seed=0\)",
    ):
        check_privacy([same[0], from_summary(summary("pdsl", 6.96e-4))])
    with pytest.raises(UnequalPrivacyError, match="different accountant"):
        check_privacy([same[0], from_summary(summary("p4", 6.96e-5, "noble"))])
    unknown = from_config(
        RunConfig(method="pdsl", epsilon=8.0)
    )  # delta settled by the run: checked once it ran
    assert unknown.delta is None and check_privacy([same[0], unknown]).ok


def test_the_default_delta_is_far_below_one_over_n_and_one_per_data_set(tmp_path):
    """delta = 1/(10 N), N the data set's training records: the same for FedDF (which sets
    public records aside) as for FedAvg, and below 1/(10 N') for the records the clients hold."""
    from p4bench.run.runner import run

    summaries = [
        run(
            RunConfig(
                method=m, clients=4, rounds=1, local_steps=1, epsilon=8.0, results_dir=str(tmp_path)
            ),
            track=False,
        ).summary
        for m in ("fedavg", "feddf")
    ]
    assert summaries[0]["delta"] == summaries[1]["delta"] == pytest.approx(1 / (10 * 1437))


def test_runs_read_from_tags_params_and_configs():
    tags = {
        "method": "p4",
        "seed": "0",
        "run_id": "abcdef123456",
        "dp.private": "true",
        "dp.certified": "false",
        "dp.neighbouring": "replace-one",
        "dp.uncertified_reason": "why",
    }
    run = from_row(tags)
    assert (run.private, run.neighbouring, run.certified, run.reason) == (
        True,
        "replace-one",
        False,
        "why",
    )
    assert run.run == "p4 seed=0 (abcdef12)" and run.mark == "replace-one UNCERTIFIED"
    assert not from_row({**tags, "dp.private": "false"}).private
    legacy = from_row({"method": "fedavg", "params.epsilon": "15.0", "params.neighbouring": "none"})
    assert (
        legacy.private and legacy.neighbouring == "add-remove" and not legacy.certified
    )  # nothing certified it
    assert not from_row({"method": "fedavg", "params.epsilon": "none"}).private
    # planned: a DP method is private by default (unless no_dp), P4's default relation is replace-one
    assert from_config(RunConfig(method="p4")).mark == "replace-one"
    assert from_config(RunConfig(method="p4", no_dp=True)).mark == "non-private"
    assert from_config(RunConfig(method="fedavg")).mark == "non-private"
    assert from_config(RunConfig(method="fedavg", epsilon=3.0)).mark == "add-remove"
    configs, relation, defaulted = settle_relation(
        [RunConfig(method="p4"), RunConfig(method="fedavg", epsilon=3.0), RunConfig(method="local")]
    )
    assert (relation, defaulted) == ("add-remove", True)
    assert [c.neighbouring for c in configs] == [
        "add-remove",
        "add-remove",
        None,
    ]  # non-private runs untouched
    configs, relation, _ = settle_relation(
        [
            RunConfig(method="p4"),
            RunConfig(method="fedavg", neighbouring="replace-one", epsilon=3.0),
        ]
    )
    assert relation == "replace-one" and {c.neighbouring for c in configs} == {"replace-one"}


# -- compare and impact, from a store with known tags -------------------------------------------------


def _log(
    client,
    experiment,
    method,
    seed,
    accuracy,
    *,
    private=True,
    relation="add-remove",
    certified=True,
    attack="none",
    reason=None,
):
    tags = {
        "method": method,
        "attack": attack,
        "defense": "none",
        "dataset": "digits",
        "seed": str(seed),
        "config_hash": f"{method}-{seed}-{attack}-{relation}-{certified}-{private}",
        "dp.private": str(private).lower(),
        "dp.certified": str(certified and private).lower(),
    }
    if private:
        tags["dp.neighbouring"] = relation
    if private and not certified:
        tags["dp.uncertified_reason"] = reason or "a step outside the ledger"
    run_id = client.create_run(experiment, tags=tags).info.run_id
    params = {
        "method": method,
        "seed": str(seed),
        "rounds": "3",
        "malicious_fraction": "0.3",
        "epsilon": "15.0" if private else "none",
    }
    client.log_batch(
        run_id,
        params=[Param(k, v) for k, v in params.items()],
        metrics=[
            Metric("final_accuracy_mean", accuracy, 0, 0),
            Metric("accuracy_mean", accuracy, 0, 1),
        ],
    )
    client.set_terminated(run_id, "FINISHED")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('privacy') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    equal, mixed, uncertified, attacks = (
        client.create_experiment(n) for n in ("equal", "mixed", "uncertified", "attacks")
    )
    for seed in (0, 1):
        _log(client, equal, "p4", seed, 0.8)
        _log(client, equal, "fedavg", seed, 0.7)
        _log(client, equal, "local", seed, 0.6, private=False)
        _log(client, mixed, "p4", seed, 0.8, relation="replace-one")
        _log(client, mixed, "fedavg", seed, 0.7)
        _log(
            client,
            uncertified,
            "p4",
            seed,
            0.8,
            certified=False,
            reason="distils from the non-DP private model",
        )
        _log(client, uncertified, "fedavg", seed, 0.7)
        for attack, accuracy in (("none", 0.8), ("label-flip", 0.6)):
            _log(client, attacks, "p4", seed, accuracy, attack=attack, relation="replace-one")
            _log(client, attacks, "fedavg", seed, accuracy - 0.1, attack=attack)
    return uri


def test_compare_marks_non_private_runs_and_refuses_unequal_privacy(store, capsys):
    comparison = compare_experiment(store, "equal", ["method"])
    assert comparison.group_by == ["method", "privacy"]
    assert dict(zip(comparison.table["method"], comparison.table["privacy"])) == {
        "fedavg": "add-remove",
        "local": "non-private",
        "p4": "add-remove",
    }
    with pytest.raises(
        UnequalPrivacyError,
        match=r"experiment 'mixed': .*add-remove: fedavg seed=\d \(\w+\), fedavg "
        r"seed=\d \(\w+\); replace-one: p4 seed=\d",
    ):
        compare_experiment(store, "mixed")
    code, _, err = invoke(
        ["compare", "--experiment", "uncertified", "--tracking-uri", store], capsys
    )
    assert (
        code == 2
        and "uncertified epsilon: p4 seed=" in err
        and "distils from the non-DP private model" in err
    )
    code, out, err = invoke(
        [
            "compare",
            "--experiment",
            "mixed",
            "--tracking-uri",
            store,
            "--format",
            "markdown",
            "--allow-mixed-privacy",
        ],
        capsys,
    )
    assert code == 0, err
    assert "| fedavg | add-remove | 0.7000 |" in out and "| p4 | replace-one | 0.8000 |" in out
    assert "warning:" in err and "--allow-mixed-privacy was given" in err
    code, out, _ = invoke(
        [
            "compare",
            "--experiment",
            "uncertified",
            "--tracking-uri",
            store,
            "--format",
            "csv",
            "--allow-mixed-privacy",
        ],
        capsys,
    )
    assert code == 0 and "p4,add-remove UNCERTIFIED,0.8" in out


def test_impact_refuses_unequal_privacy_unless_asked(store, capsys, tmp_path):
    with pytest.raises(UnequalPrivacyError, match="experiment 'attacks'.*replace-one: p4"):
        compute_impact("attacks", store)
    code, _, err = invoke(
        [
            "impact",
            "--experiment",
            "attacks",
            "--tracking-uri",
            store,
            "--plot",
            str(tmp_path / "i.png"),
        ],
        capsys,
    )
    assert code == 2 and "different neighbouring relations" in err
    paired, table = compute_impact("attacks", store, allow_mixed_privacy=True)
    assert dict(zip(table["method"], table["privacy"])) == {
        "fedavg": "add-remove",
        "p4": "replace-one",
    }
    assert table["attack_impact_mean"].round(6).tolist() == [0.2, 0.2]
    code, out, err = invoke(
        [
            "impact",
            "--experiment",
            "attacks",
            "--tracking-uri",
            store,
            "--plot",
            str(tmp_path / "i.png"),
            "--allow-mixed-privacy",
        ],
        capsys,
    )
    assert code == 0 and "privacy" in out and "replace-one" in out and "warning:" in err


# -- planned studies: sweep and tune --------------------------------------------------------------


class FakeBackend(Backend):
    """Answers every task without training: finished, with a chosen privacy and an
    evaluation accuracy that is a function of the config."""

    def __init__(self, certified=True, score=lambda config: 0.5):
        self.tasks, self.certified, self.score = [], certified, score

    def map(self, tasks, on_done):
        for index, task in enumerate(tasks):
            self.tasks.append(task)
            config = task.run_config()
            private = (
                config.private
                or config.method in ("p4", "proxyfl", "dp-dsgt", "dp-dsgd")
                and not config.no_dp
            )
            summary = {
                "method": config.method,
                "seed": config.seed,
                "private": private,
                "accuracy_mean": 0.5,
                "epsilon_certified": private and self.certified,
                "uncertified_reason": None if self.certified else "a step outside the ledger",
                "neighbouring": config.neighbouring or "replace-one",
            }
            on_done(
                index,
                RunRecord(
                    config.config_hash(),
                    "finished",
                    summary=summary,
                    evaluation_accuracy=self.score(config),
                    tags=dict(task.tags),
                ),
            )


def test_sweep_sets_one_relation_or_refuses_before_training(tmp_path, capsys, monkeypatch):
    no_training(monkeypatch)
    spec = parse_sweep(
        {
            "name": "eq",
            "base": {**TINY, "epsilon": 5.0},
            "axes": {"method": ["p4", "fedavg", "local"]},
            "per_method": {"local": {"epsilon": "none"}},
        }
    )
    planned = expand(spec)
    assert [(p.config.method, p.config.neighbouring) for p in planned] == [
        ("p4", "add-remove"),
        ("fedavg", "add-remove"),
        ("local", None),
    ]  # the study default, not P4's replace-one
    report = run_sweep(spec, FakeBackend(), results_dir=str(tmp_path), track=False)
    assert report.count("finished") == 3
    assert any(
        "one neighbouring relation for every private run of this study: add-remove (the study default"
        in n
        for n in report.notices
    )

    mixed = parse_sweep(
        {
            "name": "mixed",
            "base": {**TINY, "method": "p4"},
            "axes": {"neighbouring": ["add-remove", "replace-one"]},
        }
    )
    backend = FakeBackend()
    with pytest.raises(
        UnequalPrivacyError, match=r"sweep 'mixed'.*add-remove: p4 seed=0; replace-one: p4 seed=0"
    ):
        run_sweep(mixed, backend, results_dir=str(tmp_path), track=False)
    assert backend.tasks == []  # refused before anything ran
    report = run_sweep(
        mixed, backend, results_dir=str(tmp_path), track=False, allow_mixed_privacy=True
    )
    assert report.count("finished") == 2 and any(
        "--allow-mixed-privacy was given" in n for n in report.notices
    )

    path = tmp_path / "mixed.yaml"
    path.write_text(
        "name: mixed\nbase: {dataset: digits, clients: 8, rounds: 2, method: p4}\n"
        "axes: {neighbouring: [add-remove, replace-one]}\n"
    )
    code, _, err = invoke(["sweep", str(path), "--results-dir", str(tmp_path / "runs")], capsys)
    assert (
        code == 2
        and "refusing to compare runs under unequal privacy" in err
        and "replace-one: p4" in err
    )
    code, out, err = invoke(
        [
            "sweep",
            str(path),
            "--dry-run",
            "--allow-mixed-privacy",
            "--results-dir",
            str(tmp_path / "runs"),
        ],
        capsys,
    )
    assert code == 0 and "2 runs" in out and "--allow-mixed-privacy was given" in err


def test_uncertified_sweep_runs_are_named_in_a_notice(tmp_path):
    spec = parse_sweep(
        {"name": "u", "base": {**TINY, "epsilon": 5.0}, "axes": {"method": ["fedavg"]}}
    )
    report = run_sweep(spec, FakeBackend(certified=False), results_dir=str(tmp_path), track=False)
    assert any(
        n.startswith("uncertified epsilon: fedavg seed=0 {why: a step outside the ledger}")
        for n in report.notices
    )


def test_tune_refuses_mixed_relations_up_front_and_uncertified_candidates(
    tmp_path, capsys, monkeypatch
):
    no_training(monkeypatch)
    mixed = TuneSpec(
        "t",
        {**TINY, "results_dir": str(tmp_path)},
        {"p4": {"neighbouring": ("add-remove", "replace-one")}},
    )
    backend = FakeBackend()
    with pytest.raises(UnequalPrivacyError, match="different neighbouring relations"):
        run_tuning(mixed, backend, track=False)
    assert backend.tasks == []
    spec = TuneSpec(
        "t", {**TINY, "results_dir": str(tmp_path), "epsilon": 5.0}, {"fedavg": {"lr": (0.1, 1.0)}}
    )
    with pytest.raises(
        UnequalPrivacyError, match=r"tuning 't'.*uncertified epsilon: fedavg lr=0.1 seed=0"
    ):
        run_tuning(spec, FakeBackend(certified=False), track=False)
    result = run_tuning(
        spec,
        FakeBackend(certified=False, score=lambda c: c.lr),
        track=False,
        allow_mixed_privacy=True,
    )
    assert (
        result.best == {"fedavg": {"lr": 1.0}}
        and result.points["fedavg"][0].privacy == "add-remove UNCERTIFIED"
    )
    code, _, err = invoke(
        [
            "tune",
            "--method",
            "p4",
            "--grid",
            "neighbouring=add-remove,replace-one",
            "--set",
            "clients=8",
            "--results-dir",
            str(tmp_path / "runs"),
            "--output",
            str(tmp_path / "t.yaml"),
        ],
        capsys,
    )
    assert code == 2 and "tuning 'tune-digits': refusing" in err and "replace-one: p4" in err


# -- reproduce ------------------------------------------------------------------------------------


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "empty"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_use_one_relation_and_no_defense_without_attack(name, no_data):
    plan = plan_preset(name, quick=True)
    private = [r.config for r in plan.runs if from_config(r.config).private]
    if name in (
        "karras",
        "p4l",
    ):  # the papers use no DP: every run non-private, no epsilon to equalise
        assert not private
    else:
        assert private and {c.neighbouring for c in private} == {"add-remove"}
    assert (
        len({c.epsilon for c in private if name in ("heterogeneity", "defense", "malicious")}) <= 1
    )
    unattacked = [r.config for r in plan.runs if r.config.attack is None]
    assert all(c.defense == "none" for c in unattacked)  # P4 runs without its secure aggregation
    for config in (r.config for r in plan.runs if r.config.method in ("local", "centralized")):
        assert not from_config(config).private


def test_reproduce_plans_lr_tuning_on_the_tuning_setting(no_data):
    plan = plan_preset("heterogeneity", quick=False, only={"method": ["p4", "local", "fedavg"]})
    tuning = plan_lr_tuning(
        PRESETS["heterogeneity"], plan.runs, "x-tune", TUNE_GRID, rounds=20, scope="preset"
    )
    assert [key for key, _ in tuning] == [m for m in ("p4", "fedavg", "local") for _ in TUNE_GRID]
    assert {run.tags["variant"] for _, run in tuning} == {"alpha 50%"}
    assert {(run.config.seed, run.config.rounds, run.config.experiment) for _, run in tuning} == {
        (0, 20, "x-tune")
    }
    assert [run.config.lr for key, run in tuning if key == "p4"] == list(TUNE_GRID)
    assert all(
        run.config.defense == "none" and run.config.neighbouring == "add-remove"
        for key, run in tuning
        if key == "p4"
    )
    tuned = apply_tuned_lr(plan.runs, {"p4": 0.2, "local": 2.0})
    assert {(r.config.method, r.config.lr) for r in tuned} == {
        ("p4", 0.2),
        ("local", 2.0),
        ("fedavg", 0.5),
    }
    privacy = plan_preset("privacy", quick=True)  # local runs with raw and HC features: tuned apart
    keys = {
        key
        for key, _ in plan_lr_tuning(PRESETS["privacy"], privacy.runs, "y", (0.1,), scope="preset")
    }
    assert keys == {"p4", "local (raw)", "local (scatter)", "centralized"}  # and the ceiling
    assert {
        run.config.epsilon
        for key, run in plan_lr_tuning(PRESETS["privacy"], privacy.runs, "y", (0.1,))
        if key.startswith("p4 @")
    } == {15.0}  # per partition too: at the tuning setting within it


def test_quick_claims_are_not_verdicts():
    checks = [
        ClaimCheck("a", "yes", "80%"),
        ClaimCheck("b", "no", ""),
        ClaimCheck("c", "not checked", "why"),
    ]
    assert [(c.status, c.detail) for c in quick_claims(checks)] == [
        ("not tested", "quick smoke run; figures: 80%"),
        ("not tested", "quick smoke run"),
        ("not checked", "why"),
    ]


def test_reproduce_runs_every_method_at_its_tuned_lr(no_data, tmp_path):
    best = {"p4": 0.2, "fedavg": 1.0, "local": 0.05}
    backend = FakeBackend(score=lambda c: 1.0 - abs(c.lr - best[c.method]))
    report = reproduce(
        "heterogeneity",
        quick=True,
        backend=backend,
        results_dir=str(tmp_path),
        only={"method": list(best)},
        tune_grid=(0.05, 0.2, 1.0),
    )
    tuning = [t for t in backend.tasks if t.tuning]
    runs = [t for t in backend.tasks if not t.tuning]
    # every method tuned on each of the 6 partitions; P4 as its paper runs it (teacher=private,
    # a reference row at every level) runs at the certified P4's lr, tuned on its partition
    assert len(tuning) == 3 * 3 * 6 and len(runs) == 3 * 6 + 6
    assert {name.split(" @ ")[0]: lr for name, lr in report.tuned_lr.items()} == best and len(
        report.tuned_lr
    ) == 18
    assert {(t.config["method"], t.config["lr"]) for t in runs} == set(best.items())
    assert all(t.config["defense"] == "none" for t in runs)
    assert {t.config["neighbouring"] for t in runs} == {"add-remove"}
    assert any("non-private (local" in line for line in report.privacy)
    assert any(
        "one neighbouring relation for the preset: add-remove; target epsilon 15" in line
        for line in report.privacy
    )
    with pytest.raises(UnequalPrivacyError, match="uncertified epsilon: p4"):
        reproduce(
            "heterogeneity",
            quick=True,
            backend=FakeBackend(certified=False),
            results_dir=str(tmp_path),
            only={"method": ["p4"]},
            tune_grid=(0.1,),
        )


def test_compare_digits_bench_runs_at_equal_privacy_without_defense():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "compare_digits.py"
    spec = importlib.util.spec_from_file_location("compare_digits", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    common = {"epsilon": 15.0, "neighbouring": "add-remove", "clients": 8}
    configs = {
        m: RunConfig(method=m, **bench.method_options(m, common, private_baselines=False))
        for m in bench.METHODS
    }
    assert all(
        c.defense == "none" for c in configs.values()
    )  # nobody attacks: P4 without its secure aggregation
    assert {m for m, c in configs.items() if from_config(c).private} == set(bench.METHODS) - {
        "local",
        "centralized",
    }
    assert {from_config(c).mark for c in configs.values() if from_config(c).private} == {
        "add-remove"
    }
    assert (
        from_config(RunConfig(method="local", **bench.method_options("local", common, True))).mark
        == "add-remove"
    )
    rows = {
        "p4": [
            {
                "method": "p4",
                "seed": 0,
                "lr": 0.1,
                "private": True,
                "epsilon_certified": True,
                "neighbouring": "replace-one",
            }
        ],
        "fedavg": [
            {
                "method": "fedavg",
                "seed": 0,
                "lr": 0.1,
                "private": True,
                "epsilon_certified": True,
                "neighbouring": "add-remove",
            }
        ],
    }
    with pytest.raises(
        UnequalPrivacyError, match="bench/compare_digits.py.*replace-one: p4 lr=0.1 seed=0"
    ):
        bench.privacy_check(rows, allow_mixed=False)
