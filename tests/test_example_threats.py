"""The example attack, defense and dataset package (examples/p4bench-threats): discovered
through its entry point, passing `check-plugin`, and run through the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from p4bench.host.manager import Registry, create_plugin_manager, reset_default

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "p4bench-threats"


@pytest.fixture
def installed_threats(install_example):
    install_example(EXAMPLE)
    yield
    for name in [m for m in sys.modules if m.startswith("p4bench_threats")]:
        sys.modules.pop(name)
    reset_default()


def _main(argv: list[str]) -> int:
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0)


def test_each_kind_is_discovered_from_the_distribution(installed_threats):
    registry = Registry(create_plugin_manager())
    for kind, name in (
        ("attack", "boosted-update"),
        ("defense", "median-norm-clip"),
        ("dataset", "blobs"),
    ):
        assert registry.entry(kind, name).distribution == "p4bench-threats"


def test_the_package_passes_check_plugin(installed_threats, capsys):
    code = _main(["check-plugin", "p4bench-threats", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and report["problems"] == [], captured.err
    checked = " | ".join(report["checked"])
    for label in (
        "attack 'boosted-update'",
        "defense 'median-norm-clip'",
        "dataset 'blobs': loaded 1000 + 200",
    ):
        assert label in checked


def test_the_defense_bounds_every_update_by_the_median_norm():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from p4bench_threats.defense import MedianNormClip
    finally:
        sys.path.remove(str(EXAMPLE))
    updates = torch.tensor(
        [[[3.0, 4.0], [0.0, 1.0], [0.0, 100.0], [9.0, 9.0]]], dtype=torch.float64
    )
    mask = torch.tensor([[True, True, True, False]])  # the last row is padding
    weights = torch.ones(1, 4, dtype=torch.float64)
    from p4bench.config import RunConfig

    mean, kept = MedianNormClip(RunConfig(defense="median-norm-clip")).aggregate(
        updates, weights, mask
    )
    # norms 5, 1, 100 (median 5): (3, 4) and (0, 1) stay, (0, 100) becomes (0, 5)
    torch.testing.assert_close(mean, torch.tensor([[1.0, 10.0 / 3]], dtype=torch.float64))
    assert kept.tolist() == mask.tolist()


def test_a_run_with_all_three(installed_threats, capsys, results_dir):
    code = _main(
        [
            "run",
            "--method",
            "fedavg",
            "--dataset",
            "blobs",
            "--attack",
            "boosted-update",
            "--defense",
            "median-norm-clip",
            "--clients",
            "8",
            "--rounds",
            "3",
            "--results-dir",
            results_dir,
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert (summary["dataset"], summary["attack"], summary["defense"]) == (
        "blobs",
        "boosted-update",
        "median-norm-clip",
    )
    assert summary["accuracy_mean"] > 0.5
