"""The command line as users type it."""

from __future__ import annotations

import json

import pytest

from p4bench.cli import main


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def test_run_json_last_line(capsys, results_dir):
    code, out, err = invoke(
        [
            "run",
            "--method",
            "local",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--results-dir",
            results_dir,
            "--json",
        ],
        capsys,
    )
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    for key in (
        "run_id",
        "method",
        "attack",
        "defense",
        "dataset",
        "seed",
        "rounds",
        "accuracy_mean",
        "accuracy_per_client",
        "epsilon",
        "wall_time_s",
        "tracking_uri",
    ):
        assert key in summary
    assert summary["method"] == "local" and summary["epsilon"] is None and summary["rounds"] == 2
    assert "local rounds" in err  # the progress bar goes to stderr


def test_unknown_method_exits_2_listing_methods(capsys):
    code, out, err = invoke(["run", "--method", "nope"], capsys)
    assert code == 2
    assert "unknown method 'nope'" in err and "fedavg" in err and "local" in err


def test_bad_config_value_exits_2_naming_the_field(capsys, tmp_path):
    code, _, err = invoke(["run", "--clients", "1"], capsys)
    assert code == 2 and "'clients'" in err and "[2, 1_000_000]" in err
    config = tmp_path / "bad.yaml"
    config.write_text("client_rate: 1.5\n")
    code, _, err = invoke(["run", "--config", str(config)], capsys)
    assert code == 2 and "'client_rate'" in err


def test_list_json_has_distribution_and_version(capsys):
    code, out, _ = invoke(["list", "--json"], capsys)
    listing = json.loads(out)
    assert code == 0
    assert any(
        e["name"] == "fedavg" and e["distribution"] == "p4bench" and e["version"]
        for e in listing["method"]
    )
    assert set(listing) >= {
        "method",
        "attack",
        "defense",
        "dataset",
        "partitioner",
        "topology",
        "accountant",
        "runtime",
    }
