"""Shared fixtures. Tests never autoload whatever plugins happen to be installed."""

from __future__ import annotations

import os

os.environ["P4BENCH_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("MLFLOW_TRACKING_URI", None)
# The runner's post-processing check (p4bench.privacy.verification) costs seconds per new
# run (the run and one replay); tests of it switch it on (`verify_on`), others run uncertified ("not verified").
os.environ["P4BENCH_VERIFY"] = "0"

import pytest  # noqa: E402

# Registers the emulated accelerator `emu` now, before any test's backward pass: autograd sizes
# its per-device queues at its first one, so a later registration fails in whatever test runs
# the conformance kit's accelerator run after another test trained (order-dependent).
import p4bench.testing.emulated_device  # noqa: E402, F401
from p4bench.config import RunConfig  # noqa: E402


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` skip where torch sees no CUDA device (CI, this project's CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test that needs the emulated accelerator skips on a machine with CUDA, where it
    cannot be registered (p4bench.testing.emulated_device); the `cuda` tests run there."""
    outcome = yield
    from p4bench.testing.emulated_device import EmulationUnavailable

    if outcome.excinfo is not None and isinstance(outcome.excinfo[1], EmulationUnavailable):
        outcome.force_exception(
            pytest.skip.Exception(f"needs the emulated accelerator: {outcome.excinfo[1]}")
        )


@pytest.fixture
def verify_on(monkeypatch, tmp_path):
    """The runner's post-processing check on, with a cache of this test's own."""
    monkeypatch.setenv("P4BENCH_VERIFY", "1")
    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "post_processing.json"


@pytest.fixture
def verify_full(monkeypatch):
    """Runs verified at their own size, as a user's are (the shared verdict cache: a verdict
    is reused only for the same configuration and code)."""
    monkeypatch.setenv("P4BENCH_VERIFY", "full")


@pytest.fixture
def results_dir(tmp_path):
    return str(tmp_path / "runs")


@pytest.fixture
def small_config(results_dir):
    """A fast digits run: 8 clients, 3 rounds, local SQLite MLflow store in tmp."""

    def make(**changes) -> RunConfig:
        base = dict(
            method="fedavg", clients=8, rounds=3, local_steps=2, results_dir=results_dir, seed=1
        )
        base.update(changes)
        return RunConfig(**base)

    return make


@pytest.fixture
def fresh_registry(monkeypatch):
    """The process-wide plugin registry built anew (without autoload) for the test."""
    from p4bench.host.manager import reset_default

    monkeypatch.setenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_default()
    yield
    reset_default()


@pytest.fixture
def install_example(tmp_path, monkeypatch):
    """`install_example(folder, subprocesses=False)`: see `_install_example`."""
    return lambda example, subprocesses=False: _install_example(
        example, tmp_path, monkeypatch, subprocesses=subprocesses
    )


def _install_example(example, tmp_path, monkeypatch, *, subprocesses: bool = False) -> None:
    """Make an `examples/` package importable with the distribution metadata and entry
    points `pip install` would write (from its pyproject.toml), without touching the
    environment; with `subprocesses`, also for child processes (device peers)."""
    import tomllib

    from p4bench.host.manager import reset_default

    project = tomllib.loads(example.joinpath("pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    dist_info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = [f"{key} = {target}" for key, target in project["entry-points"]["p4bench"].items()]
    (dist_info / "entry_points.txt").write_text("[p4bench]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(example))
    if subprocesses:
        paths = [str(tmp_path), str(example), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.delenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reset_default()
