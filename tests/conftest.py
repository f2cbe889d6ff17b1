"""Shared fixtures. Tests never autoload whatever plugins happen to be installed."""

from __future__ import annotations

import os

os.environ["P4BENCH_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("MLFLOW_TRACKING_URI", None)

import pytest  # noqa: E402

from p4bench.config import RunConfig  # noqa: E402


@pytest.fixture
def results_dir(tmp_path):
    return str(tmp_path / "runs")


@pytest.fixture
def small_config(results_dir):
    """A fast digits run: 8 clients, 3 rounds, local SQLite MLflow store in tmp."""

    def make(**changes) -> RunConfig:
        base = dict(method="fedavg", clients=8, rounds=3, local_steps=2, results_dir=results_dir, seed=1)
        base.update(changes)
        return RunConfig(**base)

    return make


@pytest.fixture
def fresh_registry(monkeypatch):
    """The process-wide plugin registry built anew (without autoload) for the test."""
    from p4bench.plugin_manager import reset_default

    monkeypatch.setenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_default()
    yield
    reset_default()
