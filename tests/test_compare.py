"""`p4bench compare` on an MLflow store written with known numbers (no training)."""

from __future__ import annotations

import csv
import io
import statistics

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from p4bench.cli import main
from p4bench.errors import UsageError
from p4bench.studies.claims import run_values
from p4bench.studies.compare import compare_experiment, default_group_by, format_table
from p4bench.studies.compare_plot import plot_comparison

# (method, similarity, seed, final accuracy); each run also logs a 3-round curve ending there
RUNS = [
    ("p4", "0.25", 0, 0.60),
    ("p4", "0.25", 1, 0.64),
    ("p4", "0.25", 2, 0.62),
    ("p4", "0.5", 0, 0.70),
    ("p4", "0.5", 1, 0.72),
    ("local", "0.25", 0, 0.50),
    ("local", "0.25", 1, 0.40),
    ("local", "0.5", 0, 0.55),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('compare') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("known")
    clock = iter(
        range(1_000_000, 2_000_000, 1000)
    )  # distinct start times: the latest run of a config wins

    def log(method, similarity, seed, final, status="FINISHED", config_hash=None):
        tags = {
            "method": method,
            "attack": "none",
            "defense": "none",
            "dataset": "digits",
            "seed": str(seed),
            "config_hash": config_hash or f"{method}-{similarity}-{seed}",
        }
        run_id = client.create_run(experiment, start_time=next(clock), tags=tags).info.run_id
        params = {
            "method": method,
            "similarity": similarity,
            "seed": str(seed),
            "rounds": "3",
            "results_dir": f"/r{seed}",
        }
        curve = [final / 3, final / 2, final]
        client.log_batch(
            run_id,
            params=[Param(k, v) for k, v in params.items()],
            metrics=[Metric("accuracy_mean", v, 0, step) for step, v in enumerate(curve, 1)]
            + [Metric("final_accuracy_mean", final, 0, 0)],
        )
        client.set_terminated(run_id, status)

    log("local", "0.5", 0, 0.10)  # superseded by the next run of the same config
    for row in RUNS:
        log(*row)
    log("p4", "0.5", 2, 0.0, status="FAILED")  # failed runs are not compared
    return uri


def _expected(method, similarity):
    values = [acc for m, s, _, acc in RUNS if (m, s) == (method, similarity)]
    return (
        statistics.fmean(values),
        (statistics.stdev(values) if len(values) > 1 else float("nan")),
        len(values),
    )


def test_groups_aggregate_over_seeds_with_duplicates_and_failures_left_out(store):
    comparison = compare_experiment(store, "known")
    assert comparison.group_by == ["method", "similarity"]  # what varies; never the seed or paths
    table = comparison.table
    assert len(table) == 4
    for row in table.to_dict("records"):
        mean, std, n = _expected(row["method"], row["similarity"])
        assert row["mean"] == pytest.approx(mean) and row["n"] == n
        assert (row["std"] != row["std"]) if n == 1 else row["std"] == pytest.approx(std)
    assert list(zip(table["method"], table["similarity"])) == [
        ("local", "0.25"),
        ("local", "0.5"),
        ("p4", "0.25"),
        ("p4", "0.5"),
    ]


def test_group_by_and_metric_choices(store):
    by_method = compare_experiment(store, "known", ["method"]).table.set_index("method")
    assert by_method.loc["p4", "n"] == 5 and by_method.loc["local", "n"] == 3
    assert (
        compare_experiment(store, "known", ["method"], metric="accuracy_mean").table["n"].sum() == 8
    )
    with pytest.raises(UsageError, match="unknown group key 'colour'.*similarity"):
        compare_experiment(store, "known", ["colour"])
    with pytest.raises(UsageError, match="metric 'loss'.*final_accuracy_mean"):
        compare_experiment(store, "known", metric="loss")
    with pytest.raises(UsageError, match="no MLflow experiment"):
        compare_experiment(store, "absent")


def test_markdown_csv_and_plot(store, tmp_path):
    comparison = compare_experiment(store, "known")
    markdown = format_table(comparison, "markdown").splitlines()
    assert (
        markdown[0] == "| method | similarity | final_accuracy_mean mean | 95% (t) | std | n |"
        and len(markdown) == 6
    )
    # the interval beside each mean: t(0.975, 2) * 0.02 / sqrt(3) for p4 at 0.25; none for n = 1
    assert "| p4 | 0.25 | 0.6200 | +-0.0497 | 0.0200 | 3 |" in markdown
    assert "| local | 0.5 | 0.5500 | n=1: none | - | 1 |" in markdown
    rows = list(csv.DictReader(io.StringIO(format_table(comparison, "csv"))))
    assert [r["n"] for r in rows] == ["2", "1", "3", "2"]
    assert rows[1]["ci95_half"] == "" and float(rows[2]["ci95_half"]) == pytest.approx(
        0.04968, abs=1e-5
    )
    out = plot_comparison(comparison, tmp_path / "plots" / "cmp.png")
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_default_group_by_falls_back_to_method():
    import pandas as pd

    frame = pd.DataFrame(
        {"method": ["p4", "p4"], "params.seed": ["0", "1"], "params.rounds": ["3", "3"]}
    )
    assert default_group_by(frame) == ["method"]


def test_cli_table_and_plot(store, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "compare",
                "--experiment",
                "known",
                "--tracking-uri",
                store,
                "--format",
                "markdown",
                "--plot",
                str(tmp_path / "c.png"),
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "| p4 | 0.25 | 0.6200 | +-0.0497 | 0.0200 | 3 |" in out
    assert (tmp_path / "c.png").exists() and "plot written" in err
    with pytest.raises(SystemExit) as info:
        main(["compare", "--experiment", "known", "--tracking-uri", store, "--format", "xml"])
    assert info.value.code == 2


def test_numbers_sort_numerically_and_before_text():
    import pandas as pd

    from p4bench.studies.compare import aggregate

    runs = pd.DataFrame(
        {
            "params.epsilon": ["15.0", "none", "3.0", "3.0"],
            "metrics.final_accuracy_mean": [0.7, 0.5, 0.6, 0.4],
        }
    )
    table = aggregate(runs, ["epsilon"])
    assert list(table["epsilon"]) == ["3.0", "15.0", "none"] and list(table["n"]) == [2, 1, 1]
    assert table["mean"].iloc[0] == pytest.approx(0.5)


def test_private_runs_add_epsilon_over_rounds_and_accuracy_against_epsilon(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    uri = f"sqlite:///{tmp_path / 'private.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("private")
    for method, final in (("p4", 0.7), ("fedavg", 0.6)):
        tags = {
            "method": method,
            "attack": "none",
            "defense": "none",
            "dataset": "digits",
            "seed": "0",
            "config_hash": method,
        }
        run_id = client.create_run(experiment, tags=tags).info.run_id
        metrics = [Metric("accuracy_mean", final * step / 3, 0, step) for step in (1, 2, 3)]
        metrics += [Metric("epsilon_max", 8.0 * step / 3, 0, step) for step in (1, 2, 3)]
        client.log_batch(
            run_id,
            params=[Param("method", method), Param("seed", "0")],
            metrics=metrics + [Metric("final_accuracy_mean", final, 0, 0)],
        )
        client.set_terminated(run_id, "FINISHED")
    figures = []
    original = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1]
    )
    plot_comparison(compare_experiment(uri, "private"), tmp_path / "cmp.png")
    axes = figures[0].axes
    assert len(axes) == 4 and axes[2].get_ylabel().startswith("epsilon spent")
    assert axes[3].get_xlabel().startswith("epsilon at the end")
    points = [container.lines[0] for container in axes[3].containers]  # one errorbar per group
    assert sorted(float(p.get_ydata()[0]) for p in points) == pytest.approx([0.6, 0.7])
    assert [float(p.get_xdata()[0]) for p in points] == pytest.approx([8.0, 8.0])


def _private_store(tmp_path, runs, name="eps"):
    """A store of private (or non-private) runs: (method, epsilon or None, seed, final,
    extra dp tags, extra params); epsilon None with `private` False is a non-private run."""
    uri = f"sqlite:///{tmp_path / f'{name}.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment(name)
    for method, epsilon, seed, final, dp, params in runs:
        private = dp.get("dp.private", "true") == "true"
        tags = {
            "method": method,
            "attack": "none",
            "defense": "none",
            "dataset": "digits",
            "seed": str(seed),
            "config_hash": f"{method}-{epsilon}-{seed}-{sorted(dp.items())}-{sorted(params.items())}",
            "dp.private": "true",
            "dp.certified": "true" if private else "false",
            "dp.neighbouring": "add-remove",
            "dp.delta": "1e-05",
            "dp.accountant": "pld",
            **dp,
        }
        if not private:
            tags = {
                k: v
                for k, v in tags.items()
                if k not in ("dp.neighbouring", "dp.delta", "dp.accountant")
            }
        run_id = client.create_run(experiment, tags=tags).info.run_id
        logged = {"method": method, "seed": str(seed), "epsilon": str(epsilon), **params}
        metrics = [Metric("accuracy_mean", final * step / 3, 0, step) for step in (1, 2, 3)]
        metrics += [Metric("final_accuracy_mean", final, 0, 0)]
        spent = dp.get("spent", epsilon)
        if private and spent is not None:
            metrics += [
                Metric("epsilon_max", float(spent) * step / 3, 0, step) for step in (1, 2, 3)
            ]
            metrics += [Metric("epsilon", float(spent), 0, 0)]
        client.log_batch(run_id, params=[Param(k, v) for k, v in logged.items()], metrics=metrics)
        client.set_terminated(run_id, "FINISHED")
    return uri


def test_group_by_method_keeps_one_epsilon_per_row(tmp_path, capsys):
    """#44: `--group-by method` over fedavg at epsilon 1 and 8 gave one row, their mean."""
    uri = _private_store(
        tmp_path,
        [
            ("fedavg", 1.0, 0, 0.2, {}, {}),
            ("fedavg", 1.0, 1, 0.3, {}, {}),
            ("fedavg", 8.0, 0, 0.8, {}, {}),
            ("fedavg", 8.0, 1, 0.9, {}, {}),
        ],
    )
    comparison = compare_experiment(uri, "eps", ["method"])
    assert comparison.group_by == ["method", "epsilon"] and comparison.split_by == ["epsilon"]
    table = comparison.table
    assert list(zip(table["method"], table["epsilon"], table["n"])) == [
        ("fedavg", "1.0", 2),
        ("fedavg", "8.0", 2),
    ]
    assert list(table["mean"]) == pytest.approx([0.25, 0.85])
    with pytest.raises(SystemExit) as info:
        main(
            [
                "compare",
                "--experiment",
                "eps",
                "--tracking-uri",
                uri,
                "--group-by",
                "method",
                "--format",
                "markdown",
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "| method | epsilon | final_accuracy_mean mean | 95% (t) | std | n |" in out
    assert "| fedavg | 1.0 | 0.2500 |" in out and "| fedavg | 8.0 | 0.8500 |" in out
    assert "rows also split by epsilon" in err


def test_one_epsilon_per_row_in_the_plot_too(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    uri = _private_store(
        tmp_path, [("fedavg", 1.0, 0, 0.2, {}, {}), ("fedavg", 8.0, 0, 0.8, {}, {})]
    )
    figures = []
    original = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1]
    )
    plot_comparison(compare_experiment(uri, "eps", ["method"]), tmp_path / "cmp.png")
    points = [
        container.lines[0] for container in figures[0].axes[3].containers
    ]  # accuracy against epsilon
    assert sorted(float(p.get_xdata()[0]) for p in points) == pytest.approx(
        [1.0, 8.0]
    )  # never their mean, 4.5
    assert len(figures[0].axes[0].get_lines()) == 2  # a curve per epsilon


def test_epsilon_of_runs_without_a_target_and_of_non_private_runs(tmp_path):
    """A run given a noise multiplier (no target) counts at the epsilon its ledger reported;
    a non-private one at `none`, in a row of its own (the privacy column marks it)."""
    uri = _private_store(
        tmp_path,
        [
            ("fedavg", None, 0, 0.5, {"spent": 2.0}, {"noise_multiplier": "2.0"}),
            ("fedavg", None, 0, 0.7, {"spent": 6.5}, {"noise_multiplier": "0.9"}),
            ("fedavg", 8.0, 0, 0.8, {}, {}),
            ("fedavg", None, 0, 0.9, {"dp.private": "false"}, {}),
        ],
        name="mixed",
    )
    comparison = compare_experiment(uri, "mixed", ["method"])
    rows = comparison.table.to_dict("records")
    assert [(r["privacy"], r["epsilon"]) for r in rows] == [
        ("add-remove", "2"),
        ("add-remove", "6.5"),
        ("add-remove", "8.0"),
        ("non-private", "none"),
    ]
    # asked for by name, `epsilon` is the same setting (a non-private run's is `none`, not a blank)
    by_name = compare_experiment(uri, "mixed", ["epsilon"])
    assert by_name.split_by == [] and sorted(by_name.table["epsilon"]) == [
        "2",
        "6.5",
        "8.0",
        "none",
    ]


def test_mixed_delta_and_accountant_split_rows_when_allowed(tmp_path):
    uri = _private_store(
        tmp_path,
        [
            ("fedavg", 8.0, 0, 0.8, {}, {}),
            ("fedavg", 8.0, 1, 0.6, {"dp.delta": "1e-06"}, {}),
            ("fedavg", 8.0, 2, 0.7, {"dp.accountant": "rdp"}, {}),
        ],
        name="deltas",
    )
    with pytest.raises(UsageError, match="different delta"):
        compare_experiment(uri, "deltas", ["method"])
    comparison = compare_experiment(uri, "deltas", ["method"], allow_mixed_privacy=True)
    assert comparison.split_by == ["delta", "accountant"] and list(comparison.table["n"]) == [
        1,
        1,
        1,
    ]
    assert sorted(zip(comparison.table["delta"], comparison.table["accountant"])) == [
        ("1e-05", "pld"),
        ("1e-05", "rdp"),
        ("1e-06", "pld"),
    ]


def test_no_split_where_every_group_has_one_setting(store):
    comparison = compare_experiment(
        store, "known", ["method"]
    )  # non-private runs: epsilon `none` everywhere
    assert comparison.split_by == [] and comparison.group_by == ["method"]


def test_the_privacy_presets_table_reads_its_epsilons(tmp_path):
    """`reproduce privacy` groups by (variant, epsilon): P4 at each target, local training
    (non-private) at `none`; its claims read the table as before."""
    from p4bench.studies.claims import ClaimContext
    from p4bench.studies.reproduce import PRESETS

    runs = [
        ("p4", eps, seed, acc, {"variant": "p4 (HC)"}, {})
        for eps, seed, acc in ((3.0, 0, 0.60), (3.0, 1, 0.62), (15.0, 0, 0.70), (15.0, 1, 0.72))
    ]
    runs += [
        ("local", None, seed, 0.5, {"dp.private": "false", "variant": label}, {"features": label})
        for label in ("local", "local (HC)")
        for seed in (0, 1)
    ]
    uri = _private_store(tmp_path, runs, name="privacy-preset")
    preset = PRESETS["privacy"]
    comparison = compare_experiment(uri, "privacy-preset", list(preset.group_by))
    assert comparison.split_by == []
    rows = [(r["variant"], r["epsilon"], r["n"]) for r in comparison.table.to_dict("records")]
    assert sorted(rows) == [
        ("local", "none", 2),
        ("local (HC)", "none", 2),
        ("p4 (HC)", "15.0", 2),
        ("p4 (HC)", "3.0", 2),
    ]
    runs = run_values(comparison)
    checks = preset.claims(comparison.table, ClaimContext("digits", False, (), runs))
    # two seeds: at epsilon 3 P4 - local is +10 and +12 points, an interval of about +-12.7
    # (t with 1 degree of freedom) that covers 0; one of two epsilons is not "most" of them
    assert [c.status for c in checks] == ["inconclusive", "yes"]
    assert "eps 15.0: p4 - local" in checks[0].detail and "about 3 seeds" in checks[0].detail
    assert checks[0].seeds_needed == 3


def _figures(monkeypatch):
    """The figures `plot_comparison` saves, kept for their matplotlib objects."""
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1]
    )
    return figures


def test_the_plot_draws_95_percent_error_bars_and_none_for_one_run(store, tmp_path, monkeypatch):
    from matplotlib.collections import LineCollection

    figures = _figures(monkeypatch)
    comparison = compare_experiment(store, "known")  # n = 2, 1, 3, 2
    plot_comparison(comparison, tmp_path / "cmp.png")
    fig = figures[0]
    curves, bars = fig.axes
    (errorbar,) = bars.containers[1:]  # the bars, then one error bar set: n >= 2 only
    segments = next(c for c in errorbar.lines[2] if isinstance(c, LineCollection)).get_segments()
    assert len(segments) == 3  # local 0.5 ran once: no bar
    p4_low = next(s for s in segments if s[0][0] == 2)  # p4 0.25: 0.62 +- 0.0497
    assert sorted(p4_low[:, 1]) == pytest.approx([0.62 - 0.04968, 0.62 + 0.04968], abs=1e-4)
    assert [t.get_text() for t in bars.texts] == ["n=1"]
    assert "n=1, no error bar: 1 of 4 groups" in bars.get_title()
    # titles name the attack and defense; the legend stands outside every panel
    assert "attack none, defense none" in fig._suptitle.get_text()
    assert curves.get_legend() is None and len(fig.legends) == 1
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert all(legend.x0 >= ax.get_window_extent().x1 for ax in fig.axes)


def test_epsilons_that_differ_by_accounting_noise_get_a_sensible_axis(tmp_path, monkeypatch):
    """#46: the accuracy-vs-epsilon axis spanned 7.9928-7.9942 (offset ticks) for one target."""
    uri = _private_store(
        tmp_path,
        [
            ("fedavg", 8.0, 0, 0.6, {"spent": 7.9928}, {}),
            ("p4", 8.0, 0, 0.7, {"spent": 7.9942}, {}),
        ],
        name="noise",
    )
    figures = _figures(monkeypatch)
    plot_comparison(compare_experiment(uri, "noise", ["method"]), tmp_path / "cmp.png")
    tradeoff = figures[0].axes[3]
    low, high = tradeoff.get_xlim()
    assert low <= 7.2 and high >= 8.7  # +-10% around the one setting, not a 0.0014-wide window
    assert "accounting noise" in tradeoff.get_xlabel()
    figures[0].canvas.draw()
    assert tradeoff.xaxis.get_offset_text().get_text() == ""  # no "+7.99e0" offset
    ticks = [t for t in tradeoff.get_xticks() if low <= t <= high]
    assert ticks and max(ticks) - min(ticks) >= 1.0


def test_group_by_method_and_attack_keeps_the_defense_apart(tmp_path, capsys):
    """#46: `--group-by method,attack` pooled the runs of every defense into one row."""
    uri = f"sqlite:///{tmp_path / 'threats.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("threats")
    for defense, final in (("none", 0.5), ("m-krum", 0.7)):
        for seed in (0, 1):
            tags = {
                "method": "p4",
                "attack": "label-flip",
                "defense": defense,
                "seed": str(seed),
                "config_hash": f"{defense}-{seed}",
            }
            run_id = client.create_run(experiment, tags=tags).info.run_id
            client.log_batch(
                run_id,
                params=[Param("method", "p4"), Param("seed", str(seed))],
                metrics=[Metric("final_accuracy_mean", final + seed / 100, 0, 0)],
            )
            client.set_terminated(run_id, "FINISHED")
    comparison = compare_experiment(uri, "threats", ["method", "attack"])
    assert comparison.group_by == ["method", "attack", "defense"]
    assert comparison.split_by == ["defense"]
    assert sorted(zip(comparison.table["defense"], comparison.table["n"])) == [
        ("m-krum", 2),
        ("none", 2),
    ]
    with pytest.raises(SystemExit) as info:
        main(["compare", "-e", "threats", "--tracking-uri", uri, "--group-by", "method,attack"])
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    assert "rows also split by defense" in err and "attacks or defenses" in err
