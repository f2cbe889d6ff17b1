"""`p4bench privacy network` as users type it."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from p4bench.cli import main
from p4bench.cli.privacy import app

pytestmark = pytest.mark.usefixtures("fresh_registry")

RING = ["network", "--topology", "ring", "--clients", "8", "--rounds", "3", "--delta", "1e-5"]


def run(args: list[str]) -> dict[str, object]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_ring_muffliato_beside_local_dp(tmp_path) -> None:
    matrix, heatmap = tmp_path / "m.csv", tmp_path / "h.png"
    result = CliRunner().invoke(
        app, [*RING, "--epsilon", "8", "--json", "--csv", str(matrix), "--heatmap", str(heatmap)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["epsilon_local"] <= 8.0
    assert summary["epsilon_network_max"] <= summary["epsilon_local"]
    assert summary["epsilon_network_two_hop_mean"] < summary["epsilon_network_neighbour_mean"]
    assert "single curious node" in result.output and "pld" in result.output
    with matrix.open() as handle:
        rows = list(csv.reader(handle))
    values = np.array([[float(x) for x in row[1:]] for row in rows[1:]])
    assert values.shape == (8, 8) and np.all(np.diag(values) == 0)
    assert values.max() == pytest.approx(summary["epsilon_network_max"], rel=1e-5)
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_more_gossip_and_denser_graphs_leak_more() -> None:
    """Each gossip step adds messages to every view: the two-hop figure grows with K; on
    the complete graph every node is a neighbour (no two-hop pairs)."""
    one = run([*RING, "--noise-multiplier", "2", "--gossip-steps", "1"])
    three = run([*RING, "--noise-multiplier", "2", "--gossip-steps", "3"])
    assert three["epsilon_network_two_hop_mean"] > one["epsilon_network_two_hop_mean"]
    assert three["epsilon_local"] == pytest.approx(one["epsilon_local"])
    complete = run(
        [
            "network",
            "--topology",
            "complete",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--delta",
            "1e-5",
            "--noise-multiplier",
            "2",
        ]
    )
    assert complete["epsilon_network_two_hop_mean"] is None  # no pair at distance 2: null
    assert complete["epsilon_network_mean"] == pytest.approx(complete["epsilon_local"], rel=5e-3)


def test_dp_dsgd_and_exponential_and_coalitions() -> None:
    dsgd = run([*RING, "--noise-multiplier", "2", "--method", "dp-dsgd"])
    muffliato = run([*RING, "--noise-multiplier", "2"])
    # combine-then-adapt never sends the last round's release
    assert dsgd["epsilon_network_max"] < muffliato["epsilon_network_max"]
    expo = run(
        ["network", "--topology", "exponential", "--clients", "8", "--rounds", "3", "--delta", "1e-5",
         "--noise-multiplier", "2", "--mixing", "uniform"]
    )  # fmt: skip
    assert expo["epsilon_network_max"] <= expo["epsilon_local"]
    pair = run([*RING, "--noise-multiplier", "2", "--colluders", "2"])
    assert pair["epsilon_network_mean"] > muffliato["epsilon_network_mean"]
    named = run([*RING, "--noise-multiplier", "2", "--colluding-nodes", "4"])
    assert named["colluders"] == [4]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--noise-multiplier", "1", "--epsilon", "2"], "exactly one"),
        (["--noise-multiplier", "1", "--method", "fedavg"], "method"),
        (
            ["--noise-multiplier", "1", "--method", "dp-dsgd", "--gossip-steps", "3"],
            "once per round",
        ),
        (["--noise-multiplier", "-1"], "noise-multiplier"),
        (["--noise-multiplier", "1", "--colluders", "8"], "coalition"),
        (["--noise-multiplier", "1", "--colluding-nodes", "a,b"], "colluding-nodes"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["privacy", *RING, *extra])
    _, err = capsys.readouterr()
    assert info.value.code == 2
    assert says in err and len(err.strip().splitlines()) == 1


def test_directed_graph_needs_uniform_mixing(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["privacy", "network", "--topology", "exponential", "--clients", "8", "--rounds", "2",
              "--delta", "1e-5", "--noise-multiplier", "1"])  # fmt: skip
    assert info.value.code == 2
    assert "--mixing uniform" in capsys.readouterr().err
