"""The plugin host: registries, duplicates, autoload switch, every hook exercised."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import typer

from p4bench import hookimpl, hookspecs
from p4bench.data import Partitioner
from p4bench.data.digits import DigitsDataset
from p4bench.engine import Attack, Defense
from p4bench.engine.runtime import SimulationRuntime
from p4bench.errors import DuplicateNameError, UnknownNameError
from p4bench.host.loading import load_entry_points
from p4bench.host.manager import BUILTIN_PLUGINS, KINDS, Registry, create_plugin_manager
from p4bench.models import LinearSoftmax
from p4bench.privacy.accountants import Accountant
from p4bench.run.runner import run
from p4bench.topology.graphs import Topology


class TinyDigits(DigitsDataset):
    name = "tiny-digits"


class FirstHalf(Partitioner):
    name = "first-half"

    def partition(self, labels, num_classes, num_clients, samples_per_client, rng, config):
        size = len(labels) // (2 * num_clients)
        return [list(range(i * size, (i + 1) * size)) for i in range(num_clients)]


class WideLinear(LinearSoftmax):
    name = "wide-linear"


class Ring(Topology):
    name = "test-ring"
    description = "a ring"


class Counting(Accountant):
    name = "test-accountant"
    description = "counts releases"


class ZeroUpdates(Attack):
    name = "test-zero"

    def tamper(self, exchange, messages, rng, reference=None):
        return messages.__class__(
            messages.src,
            messages.dst,
            {k: torch.zeros_like(v) for k, v in messages.payload.items()},
        )


class Recorder(Defense):
    name = "test-recorder"
    seen: list = []

    def select(self, updates, weights, mask):
        Recorder.seen.append(updates[mask].clone())
        return mask


class EchoRuntime(SimulationRuntime):
    name = "test-echo"


class AllHooksPlugin:
    """Implements every hook of the contract."""

    def __init__(self):
        self.calls: list[str] = []

    @hookimpl
    def register_datasets(self):
        return [TinyDigits]

    @hookimpl
    def register_partitioners(self):
        return [FirstHalf]

    @hookimpl
    def register_models(self):
        return [WideLinear]

    @hookimpl
    def register_topologies(self):
        return [Ring]

    @hookimpl
    def register_accountants(self):
        return [Counting]

    @hookimpl
    def register_methods(self):
        return []

    @hookimpl
    def register_attacks(self):
        return [ZeroUpdates]

    @hookimpl
    def register_defenses(self):
        return [Recorder]

    @hookimpl
    def register_runtimes(self):
        return [EchoRuntime]

    @hookimpl
    def register_commands(self, app):
        @app.command("hello")
        def hello():
            typer.echo("hello from a plugin")

    @hookimpl
    def run_started(self, run):
        self.calls.append(f"run_started:{run.total_rounds}")

    @hookimpl
    def round_finished(self, run, report):
        self.calls.append(f"round_finished:{report.step}")

    @hookimpl
    def run_finished(self, run, result):
        self.calls.append(f"run_finished:{result.summary['rounds']}")


def test_builtins_are_registered_through_the_hooks():
    registry = Registry(create_plugin_manager(autoload=False))
    assert {"local", "fedavg"} <= set(registry.names("method"))
    assert "digits" in registry.names("dataset")
    assert {"iid", "alpha"} <= set(registry.names("partitioner"))
    assert {"simulation", "reference", "bytes"} <= set(registry.names("runtime"))
    entry = registry.entries("method")[0]
    assert entry.distribution == "p4bench" and entry.version


def test_registration_hooks_of_every_kind():
    # register_datasets register_partitioners register_models register_topologies
    # register_accountants register_methods register_attacks register_defenses register_runtimes
    registry = Registry(create_plugin_manager(extra_plugins=(AllHooksPlugin(),), autoload=False))
    expected = {
        "dataset": "tiny-digits",
        "partitioner": "first-half",
        "model": "wide-linear",
        "topology": "test-ring",
        "accountant": "test-accountant",
        "attack": "test-zero",
        "defense": "test-recorder",
        "runtime": "test-echo",
    }
    for kind, name in expected.items():
        assert name in registry.names(kind), kind
    assert set(KINDS) == set(expected) | {"method"}


def test_unknown_name_lists_registered_names():
    registry = Registry(create_plugin_manager(autoload=False))
    with pytest.raises(UnknownNameError) as info:
        registry.get("method", "nope")
    assert "fedavg" in str(info.value) and "local" in str(info.value)


def test_duplicate_names_name_both_sources():
    class Shadow(DigitsDataset):
        name = "digits"

    class Clash:
        @hookimpl
        def register_datasets(self):
            return [Shadow]

    with pytest.raises(DuplicateNameError) as info:
        Registry(create_plugin_manager(extra_plugins=(Clash(),), autoload=False))
    message = str(info.value)
    assert "DigitsDataset" in message and "Shadow" in message


def test_autoload_switch(monkeypatch):
    seen = []
    real = load_entry_points

    def spy(pm, group="p4bench", *, only_distribution=None):
        seen.append(only_distribution)
        real(pm, group, only_distribution=only_distribution)

    monkeypatch.setattr("p4bench.host.manager.load_entry_points", spy)
    monkeypatch.setenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = create_plugin_manager()
    assert seen == ["p4bench"]  # p4bench's own plugin packages only: they load as entry points too
    assert {name for name, _ in pm.list_name_plugin()} >= set(BUILTIN_PLUGINS)
    monkeypatch.delenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD")
    create_plugin_manager()
    assert seen == ["p4bench", None]


def test_observation_hooks_and_plugin_parts_in_a_run(small_config):
    # run_started round_finished run_finished, and a plugin attack, defense, dataset,
    # partitioner, model and runtime taking part in a real run.
    plugin = AllHooksPlugin()
    pm = create_plugin_manager(extra_plugins=(plugin,), autoload=False)
    Recorder.seen = []
    config = small_config(
        dataset="tiny-digits",
        partitioner="first-half",
        model="wide-linear",
        runtime="test-echo",
        attack="test-zero",
        defense="test-recorder",
        malicious_fraction=0.25,
    )
    result = run(config, plugin_manager=pm, track=False)
    assert plugin.calls == [
        "run_started:3",
        "round_finished:1",
        "round_finished:2",
        "round_finished:3",
        "run_finished:3",
    ]
    malicious = torch.from_numpy(result.info.malicious)
    assert int(malicious.sum()) == 2
    assert Recorder.seen, "the defense saw the uploads"
    # every upload round: exactly the malicious senders' updates are all zero
    zero_rows = sum(int((u.abs().sum(dim=1) == 0).sum()) for u in Recorder.seen)
    assert zero_rows == 2 * len(Recorder.seen)


def test_a_misspelt_hook_is_a_problem_naming_it_not_silence():
    # issue 45: `register_method` (for `register_methods`) registered and was never called
    class Misspelt:
        @hookimpl
        def register_method(self):
            return [TinyDigits]

    assert (
        create_plugin_manager(autoload=False).problems == []
    )  # the built-ins implement no unknown hook
    registry = Registry(create_plugin_manager(extra_plugins=(Misspelt(),), autoload=False))
    (problem,) = registry.problems
    assert problem.kind == "hook" and "\n" not in problem.line()
    assert (
        "Misspelt implements unknown hook 'register_method' (did you mean 'register_methods'?)"
        in problem.line()
    )


def test_register_commands_adds_cli_commands(capsys):
    from p4bench.cli import build_app

    pm = create_plugin_manager(extra_plugins=(AllHooksPlugin(),), autoload=False)
    app = typer.Typer()
    app.command("noop")(lambda: None)
    pm.hook.register_commands(app=app)
    assert "hello" in [c.name for c in app.registered_commands]
    assert callable(build_app)


def test_every_hook_is_documented_and_tested():
    tests_text = "\n".join(
        p.read_text()
        for p in Path(__file__).parent.glob("test_*.py")
        if p.name != Path(__file__).name
    ) + inspect.getsource(AllHooksPlugin)
    for name in hookspecs.HOOK_NAMES:
        spec = getattr(hookspecs, name)
        assert (spec.__doc__ or "").strip(), f"hook {name} has no docstring"
        assert name in tests_text, f"hook {name} has no test"
    declared = {n for n, f in vars(hookspecs).items() if callable(f) and hasattr(f, "p4bench_spec")}
    assert declared == set(hookspecs.HOOK_NAMES)
