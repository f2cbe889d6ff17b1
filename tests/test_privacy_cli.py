"""`p4bench privacy ...` and `p4bench topology show` as users type them."""

from __future__ import annotations

import json

import pytest

from p4bench.cli import main

pytestmark = pytest.mark.usefixtures("fresh_registry")


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# The P4 paper's setting: noble's own (replace-one) relation and the third-party view,
# both spelled out since the CLI defaults are add-remove and the aggregator view.
NOBLE_ARGS = [
    "--view",
    "third-party",
    "--neighbouring",
    "replace-one",
    "--clients",
    "100",
    "--client-rate",
    "0.2",
    "--data-rate",
    "0.2",
    "--local-steps",
    "50",
    "--rounds",
    "100",
    "--delta",
    "2.5e-6",
]


def test_epsilon_rdp_json(capsys):
    code, out, _ = invoke(
        [
            "privacy",
            "epsilon",
            "--accountant",
            "rdp",
            "--noise-multiplier",
            "1.0",
            "--data-rate",
            "0.25",
            "--local-steps",
            "1",
            "--rounds",
            "1200",
            "--delta",
            "1e-3",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    result = last_json(out)
    assert result["epsilon"] == pytest.approx(86.78, abs=0.05)
    assert result["accountant"] == "rdp" and result["steps"] == 1200 and result["delta"] == 1e-3
    assert result["noise_multiplier"] == 1.0 and result["data_rate"] == 0.25


def test_epsilon_rdp_counts_rounds_times_local_steps(capsys):
    args = [
        "privacy",
        "epsilon",
        "--accountant",
        "rdp",
        "--noise-multiplier",
        "1.0",
        "--data-rate",
        "0.25",
        "--delta",
        "1e-3",
        "--json",
    ]
    _, out, _ = invoke(args + ["--local-steps", "4", "--rounds", "300"], capsys)
    assert last_json(out)["steps"] == 1200
    assert last_json(out)["epsilon"] == pytest.approx(86.78, abs=0.05)


def test_default_accountant_is_pld_as_in_runs(capsys):
    _, out, _ = invoke(
        [
            "privacy",
            "epsilon",
            "--noise-multiplier",
            "1.0",
            "--data-rate",
            "0.25",
            "--rounds",
            "1200",
            "--delta",
            "1e-3",
            "--json",
        ],
        capsys,
    )
    result = last_json(out)
    assert result["accountant"] == "pld" and result["neighbouring"] == "add-remove"
    assert result["epsilon"] == pytest.approx(
        80.80, abs=0.05
    )  # below rdp's 86.78 for the same schedule


def test_epsilon_noble_json_reports_floor(capsys):
    code, out, _ = invoke(
        [
            "privacy",
            "epsilon",
            "--accountant",
            "noble",
            "--noise-multiplier",
            "60",
            *NOBLE_ARGS,
            "--json",
        ],
        capsys,
    )
    assert code == 0
    result = last_json(out)
    assert result["epsilon"] == pytest.approx(8.19, abs=0.01)
    assert result["epsilon_floor"] == pytest.approx(8.188, abs=1e-3)
    assert (
        result["view"] == "third-party"
        and result["clients"] == 100
        and result["client_rate"] == 0.2
    )
    assert result["neighbouring"] == "replace-one" and "without replacement" in result["caveat"]
    assert (
        "never goes below" in out
        and "fixed-size sampling without replacement" in out
        and "Poisson" in out
    )


def test_noble_defaults_to_aggregator_view_and_add_remove(capsys):
    base = [
        "privacy",
        "epsilon",
        "--accountant",
        "noble",
        "--noise-multiplier",
        "60",
        "--clients",
        "100",
        "--client-rate",
        "0.2",
        "--data-rate",
        "0.2",
        "--local-steps",
        "50",
        "--rounds",
        "100",
        "--delta",
        "2.5e-6",
        "--json",
    ]
    _, out, _ = invoke(base, capsys)
    default = last_json(out)
    assert default["view"] == "aggregator" and default["neighbouring"] == "add-remove"
    # add-remove noise std sigma*C is noble's replace-one multiplier sigma/2 (std / 2C)
    _, out, _ = invoke(
        [
            *base,
            "--view",
            "aggregator",
            "--neighbouring",
            "replace-one",
            "--noise-multiplier",
            "30",
        ],
        capsys,
    )
    assert last_json(out)["epsilon"] == pytest.approx(default["epsilon"], rel=1e-12)
    # the aggregator sees individual updates: no sqrt(l M) noise amplification, so a larger epsilon
    _, out, _ = invoke([*base, "--view", "third-party"], capsys)
    assert default["epsilon"] > last_json(out)["epsilon"]


def test_neighbouring_flag_converts_rdp_by_group_privacy(capsys):
    args = [
        "privacy",
        "epsilon",
        "--accountant",
        "rdp",
        "--noise-multiplier",
        "1.0",
        "--data-rate",
        "0.01",
        "--rounds",
        "1200",
        "--delta",
        "1e-5",
        "--json",
    ]
    _, out, _ = invoke(args, capsys)
    add_remove = last_json(out)
    _, out, _ = invoke([*args, "--neighbouring", "replace-one"], capsys)
    replace_one = last_json(out)
    assert (
        add_remove["neighbouring"] == "add-remove" and replace_one["neighbouring"] == "replace-one"
    )
    assert "group privacy" in out and replace_one["epsilon"] != add_remove["epsilon"]
    code, _, err = invoke([*args, "--neighbouring", "swap"], capsys)
    assert code == 2 and "'--neighbouring'" in err


def test_noise_noble_round_trip(capsys):
    code, out, _ = invoke(
        ["privacy", "noise", "--accountant", "noble", "--epsilon", "9", *NOBLE_ARGS, "--json"],
        capsys,
    )
    assert code == 0
    result = last_json(out)
    assert 8.99 <= result["epsilon"] <= 9.0 and result["target_epsilon"] == 9.0
    assert result["noise_multiplier"] > 0


def test_noise_below_noble_floor_exits_2(capsys):
    code, _, err = invoke(
        ["privacy", "noise", "--accountant", "noble", "--epsilon", "5", *NOBLE_ARGS], capsys
    )
    assert code == 2 and "floor" in err and "8.188" in err


def test_unknown_accountant_exits_2_listing_names(capsys):
    code, _, err = invoke(
        [
            "privacy",
            "epsilon",
            "--accountant",
            "moments",
            "--noise-multiplier",
            "1",
            "--data-rate",
            "0.1",
            "--rounds",
            "10",
            "--delta",
            "1e-5",
        ],
        capsys,
    )
    assert code == 2
    assert "unknown accountant 'moments'" in err and all(
        name in err for name in ("rdp", "prv", "pld", "noble")
    )


@pytest.mark.parametrize(
    "bad,field",
    [
        (["--noise-multiplier", "-1"], "noise_multiplier"),
        (["--delta", "2"], "delta"),
        (["--rounds", "-5"], "--rounds"),
    ],
)
def test_bad_numbers_exit_2_naming_the_field(bad, field, capsys):
    args = {"--noise-multiplier": "1", "--data-rate": "0.1", "--rounds": "10", "--delta": "1e-5"}
    args.update(dict(zip(bad[::2], bad[1::2])))
    code, _, err = invoke(["privacy", "epsilon", *[x for kv in args.items() for x in kv]], capsys)
    assert code == 2 and f"'{field}'" in err


def test_topology_show_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "torus.png"
    code, out, _ = invoke(
        ["topology", "show", "torus", "--clients", "12", "--plot", str(plot), "--json"], capsys
    )
    assert code == 0
    stats = last_json(out)
    assert stats["out_min"] == stats["out_max"] == stats["in_mean"] == 4
    assert (
        stats["spectral_gap_mh"] == pytest.approx(0.4)
        and stats["connected"]
        and not stats["directed"]
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "spectral gap" in out


def test_topology_show_directed_and_options(capsys):
    code, out, _ = invoke(
        ["topology", "show", "exponential", "--clients", "8", "--round", "1", "--json"], capsys
    )
    assert code == 0
    stats = last_json(out)
    assert stats["directed"] and stats["time_varying"] and stats["spectral_gap_mh"] is None
    assert stats["edges"] == 8 and stats["in_max"] == stats["out_max"] == 1
    # at round 2 the hop is 4 = M/2: pairs swap both ways, so the round is symmetric
    # (a perfect matching: MH mixes nothing across pairs, gap 0)
    code, out, _ = invoke(
        ["topology", "show", "exponential", "--clients", "8", "--round", "2", "--json"], capsys
    )
    stats = last_json(out)
    assert stats["directed"] and stats["spectral_gap_mh"] == pytest.approx(0.0, abs=1e-12)
    code, out, _ = invoke(
        ["topology", "show", "k-regular", "--clients", "10", "-o", "k=3", "--json"], capsys
    )
    assert code == 0 and last_json(out)["out_max"] == 3


def test_topology_unknown_name_and_bad_clients_exit_2(capsys):
    code, _, err = invoke(["topology", "show", "star", "--clients", "5"], capsys)
    assert code == 2 and "unknown topology 'star'" in err and "ring" in err
    code, _, err = invoke(["topology", "show", "torus", "--clients", "13"], capsys)
    assert code == 2 and "prime" in err
