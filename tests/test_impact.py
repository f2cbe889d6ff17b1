"""Attack impact and ideal-defense gap from a real local MLflow store, and the pairing rules."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from p4bench.cli import main
from p4bench.run.runner import run
from p4bench.studies.impact import compute_impact, pair_runs

ATTACK = "byzantine-random"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Eight tiny tracked fedavg runs: 2 seeds x {no attack, attack} x {none, ideal}."""
    from p4bench.config import RunConfig

    folder = tmp_path_factory.mktemp("impact")
    uri = "sqlite:///" + str(folder / "mlflow.db")
    accuracy = {}
    for seed in (1, 2):
        for attack in (None, ATTACK):
            for defense in ("none", "ideal"):
                config = RunConfig(
                    method="fedavg",
                    clients=8,
                    rounds=2,
                    local_steps=2,
                    seed=seed,
                    attack=attack,
                    defense=defense,
                    experiment="impact-test",
                    tracking_uri=uri,
                    results_dir=str(folder / "runs"),
                )
                summary = run(config).summary
                assert summary["tracked"], summary.get("tracking_error")
                accuracy[(seed, attack or "none", defense)] = summary["accuracy_per_client"]
    return uri, folder, accuracy


def benign_mean(per_client: dict[str, float], clients: dict[str, float]) -> float:
    """Mean of `per_client` over the clients reported in `clients` (the attacked run's benign ones)."""
    return sum(per_client[c] for c in clients) / len(clients)


def test_impact_and_ideal_gap_from_mlflow(store):
    uri, _, accuracy = store
    paired, table = compute_impact("impact-test", uri)
    assert len(paired) == 4  # the attacked runs
    impacts = {}
    for _, row in paired.iterrows():
        seed, defense = int(row["seed"]), row["defense"]
        attacked, clean = accuracy[(seed, ATTACK, defense)], accuracy[(seed, "none", defense)]
        assert len(clean) > len(attacked)  # without an attack every client is benign ...
        expected_clean = benign_mean(
            clean, attacked
        )  # ... so both sides average the attacked run's benign clients
        assert row["accuracy"] == pytest.approx(benign_mean(attacked, attacked))
        assert row["clean_accuracy"] == pytest.approx(expected_clean)
        assert row["attack_impact"] == pytest.approx(
            expected_clean - benign_mean(attacked, attacked)
        )
        ideal = accuracy[(seed, ATTACK, "ideal")]
        assert row["ideal_gap"] == pytest.approx(
            benign_mean(ideal, ideal) - benign_mean(attacked, attacked)
        )
        impacts[(seed, defense)] = row["attack_impact"]
    assert list(table["defense"]) == ["ideal", "none"] and (table["seeds"] == 2).all()
    undefended = table[table["defense"] == "none"].iloc[0]
    impacts = [impacts[(s, "none")] for s in (1, 2)]
    assert undefended["attack_impact_mean"] == pytest.approx(sum(impacts) / 2)
    assert undefended["attack_impact_std"] == pytest.approx(pd.Series(impacts).std())
    assert undefended["attack_impact_mean"] > 0.05  # random models hurt plain averaging
    ideal = table[table["defense"] == "ideal"].iloc[0]
    assert ideal["ideal_gap_mean"] == 0.0 and ideal["detection_recall_total_mean"] == 1.0
    assert math.isnan(
        undefended["detection_precision_total_mean"]
    )  # no defense, no detection figures


def test_impact_command_prints_the_table_and_draws_the_chart(store, capsys, tmp_path):
    uri, _, _ = store
    plot, csv = tmp_path / "bars.png", tmp_path / "impact.csv"
    with pytest.raises(SystemExit) as info:
        main(
            [
                "impact",
                "--experiment",
                "impact-test",
                "--tracking-uri",
                uri,
                "--plot",
                str(plot),
                "--csv",
                str(csv),
            ]
        )
    assert info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "attack impact" in out and "ideal gap" in out and ATTACK in out and "±" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(pd.read_csv(csv)) == 2
    with pytest.raises(SystemExit):
        main(
            [
                "impact",
                "--experiment",
                "impact-test",
                "--tracking-uri",
                uri,
                "--plot",
                str(plot),
                "--json",
            ]
        )
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert {r["defense"] for r in rows} == {"none", "ideal"}


def test_impact_command_errors_exit_2(store, capsys):
    uri, _, _ = store
    with pytest.raises(SystemExit) as info:
        main(["impact", "--experiment", "nope", "--tracking-uri", uri])
    assert info.value.code == 2 and "impact-test" in capsys.readouterr().err


def _row(attack="none", defense="none", seed="1", accuracy=0.9, start=0, **params):
    base = {"param.rounds": "3", "param.malicious_fraction": "0.3"}
    base.update({f"param.{k}": v for k, v in params.items()})
    return {
        "run_id": f"r{start}",
        "start_time": start,
        "method": "fedavg",
        "dataset": "digits",
        "seed": seed,
        "attack": attack,
        "defense": defense,
        "accuracy": accuracy,
        "detection_precision_total": float("nan"),
        "detection_recall_total": float("nan"),
        **base,
    }


def test_pairing_rules():
    runs = pd.DataFrame(
        [
            _row(accuracy=0.90, start=1),
            _row(accuracy=0.80, start=2),  # a later re-run of the same config wins
            _row(
                attack="label-flip",
                accuracy=0.60,
                start=3,
                **{"options.label_map": "{3: 9}", "malicious_fraction": "0.5"},
            ),
            _row(
                attack="label-flip",
                defense="ideal",
                accuracy=0.75,
                start=4,
                **{
                    "options.label_map": "{3: 9}",
                    "malicious_fraction": "0.5",
                    "options.krum_m": "3",
                },
            ),
            _row(
                attack="label-flip", accuracy=0.50, start=5, rounds="9"
            ),  # no clean run with 9 rounds
            _row(attack="label-flip", seed="2", accuracy=0.70, start=6),  # no clean run for seed 2
        ]
    )
    paired = pair_runs(
        runs, attack_options={"label_map", "attack_timing"}, defense_options={"krum_m"}
    ).set_index("run_id")
    # attack options and the malicious fraction are ignored on the unattacked side
    assert paired.loc["r3", "attack_impact"] == pytest.approx(0.80 - 0.60)
    # the ideal partner may differ in defense options but not in the attack's
    assert paired.loc["r3", "ideal_gap"] == pytest.approx(0.75 - 0.60)
    assert math.isnan(paired.loc["r4", "attack_impact"])  # no unattacked ideal run
    assert math.isnan(paired.loc["r5", "attack_impact"]) and math.isnan(
        paired.loc["r6", "attack_impact"]
    )
    assert math.isnan(paired.loc["r6", "ideal_gap"])


def test_impact_panels_are_titled_by_what_varies_never_unset():
    from p4bench.studies.impact import panel_title

    assert (
        panel_title(["dataset", "method"], ("digits", "fedavg")) == "dataset digits / method fedavg"
    )
    assert panel_title(["method", "options.malicious_k"], ("p4", "<unset>")) == "method p4"
    assert panel_title(["options.x"], "<unset>") == "all runs"
