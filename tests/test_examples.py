"""The example files of `examples/` are valid and do what their comments say: a run config
(`run.yaml`), a sweep grid (`grid.yaml`) and a device peers file (`peers.yaml`).

The README's command blocks also run them (`tests/test_readme_commands.py`): `run.yaml`
at its full size for the expected-accuracy table, the whole grid at one round and
`p4bench device init` on the peers file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p4bench.cli import main
from p4bench.config import load_config_file, resolve_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def test_run_yaml_is_a_run_config_and_runs(verify_full, capsys, results_dir):
    path = EXAMPLES / "run.yaml"
    assert set(load_config_file(path)) >= {"method", "dataset", "partitioner", "epsilon", "options"}
    config = resolve_config(path)
    assert (config.method, config.dataset, config.partitioner, config.epsilon) == (
        "p4",
        "digits",
        "alpha",
        8,
    )
    assert dict(config.options) == {"group_size": 4, "teacher": "none"}
    # command-line options win over the file: a small run of the same config
    code, out, err = invoke(
        [
            "run",
            "--config",
            path,
            "--rounds",
            "2",
            "--clients",
            "8",
            "--seed",
            "3",
            "--results-dir",
            results_dir,
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["method"] == "p4" and summary["partitioner"] == "alpha" and summary["seed"] == 3
    assert summary["clients"] == 8 and summary["epsilon_certified"] is True
    assert 7 < summary["epsilon"] <= 8.0 + 1e-9


def test_grid_yaml_expands_to_six_runs_at_equal_privacy_and_a_cell_runs(capsys, results_dir):
    from p4bench.host.manager import default_registry
    from p4bench.run.runner import run
    from p4bench.studies.sweep import expand, load_sweep

    spec = load_sweep(EXAMPLES / "grid.yaml")
    assert spec.name == "grid"  # the README's `p4bench compare --experiment grid` reads it
    planned = expand(spec, registry=default_registry())
    cells = {(p.config.method, p.config.attack) for p in planned}
    assert cells == {(m, a) for m in ("local", "fedavg", "p4") for a in (None, "label-flip")}
    assert all(p.config.epsilon == 8 and p.config.neighbouring == "add-remove" for p in planned)
    assert all(p.config.options.get("group_size") == 4 for p in planned if p.config.method == "p4")
    # every run is checked before the first starts: the dry run lists all six
    code, out, err = invoke(
        ["sweep", EXAMPLES / "grid.yaml", "--dry-run", "--results-dir", results_dir], capsys
    )
    assert code == 0, err
    assert "6 runs" in out + err
    # one cell, P4 under the label-flip attack, at a small size
    cell = next(p for p in planned if p.config.method == "p4" and p.config.attack == "label-flip")
    result = run(cell.config.replace(rounds=1, clients=8, results_dir=results_dir), track=False)
    assert 0 < result.summary["accuracy_mean"] <= 1


def test_peers_yaml_is_a_valid_peers_file_for_device_init(capsys, tmp_path):
    from p4bench_device.peers import PeersFile

    peers = PeersFile.load(EXAMPLES / "peers.yaml")
    assert peers.num_clients == 4 and peers.server is None
    assert [p.id for p in peers.peers] == ["peer-0", "peer-1", "peer-2", "peer-3"]
    assert {p.host for p in peers.peers} == {"127.0.0.1"}
    assert len({p.port for p in peers.peers}) == 4
    assert sorted(p.node for p in peers.peers) == [0, 1, 2, 3]
    # the launching machine's first step: the run's CA and one certificate per peer
    tls = tmp_path / "tls"
    code, out, err = invoke(
        ["device", "init", "--peers", EXAMPLES / "peers.yaml", "--tls-dir", tls], capsys
    )
    assert code == 0, err
    for name in ["ca", "launcher", *[p.id for p in peers.peers]]:
        assert (tls / f"{name}.pem").is_file() and (tls / f"{name}.key").is_file(), name
    assert (tls / "peer-0.key").stat().st_mode & 0o077 == 0  # private keys are 0600
