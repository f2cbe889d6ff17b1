"""The plugin contract of p4bench, ordered by lifecycle.

Every hook is implemented with ``@p4bench.hookimpl``. Built-in methods, datasets and
runtimes are registered through exactly these hooks, like third-party plugins, which
are discovered through the ``p4bench`` entry-point group.

Registration hooks are *collect-all*: pluggy calls every implementation and the
plugin manager merges the returned lists into one registry per kind, refusing
duplicate names. Each registered class carries a class attribute ``name`` (the name
users type, for example ``p4`` or ``m-krum``) and a one-line ``description``.

Observation hooks are *collect-all* too and their return values are ignored: they let
trackers and displays listen to a run without touching its control flow.
"""

# A hook specification is a signature with a docstring: pluggy never calls its body.
# mypy: disable-error-code="empty-body"

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # annotations only: the contract stays import-light, its records sit below it
    import typer

    from p4bench.records import Release, RoundReport, RunInfo, RunResult

hookspec = pluggy.HookspecMarker("p4bench")
hookimpl = pluggy.HookimplMarker("p4bench")

# --- registration, called once when the plugin manager is built -------------------


@hookspec
def register_datasets() -> list[type]:
    """Return dataset classes (subclasses of ``p4bench.data.Dataset``).

    A dataset loads train and test arrays with class names; the runner pools and
    partitions them over clients.
    """


@hookspec
def register_partitioners() -> list[type]:
    """Return partitioner classes (subclasses of ``p4bench.data.Partitioner``).

    A partitioner assigns sample indices of a pooled dataset to clients.
    """


@hookspec
def register_models() -> list[type]:
    """Return model classes (subclasses of ``p4bench.models.Model``): functional
    architectures whose parameters the engine stacks along a client axis.
    """


@hookspec
def register_topologies() -> list[type]:
    """Return topology classes: communication graphs between clients (for example
    complete, ring, ProxyFL's exponential graph). Each has ``name``, ``description``.
    """


@hookspec
def register_accountants() -> list[type]:
    """Return privacy accountant classes that turn a client's record of noisy releases
    into (epsilon, delta). Each has ``name``, ``description``.
    """


@hookspec
def register_methods() -> list[type]:
    """Return method classes (subclasses of ``p4bench.engine.Method``).

    A method is per-client logic plus an exchange schedule; every runtime executes it.
    """


@hookspec
def register_attacks() -> list[type]:
    """Return attack classes (subclasses of ``p4bench.engine.Attack``) acting on a
    malicious client's data or on its outgoing messages.
    """


@hookspec
def register_defenses() -> list[type]:
    """Return defense classes (subclasses of ``p4bench.engine.Defense``) acting where
    messages are received and aggregated.
    """


@hookspec
def register_runtimes() -> list[type]:
    """Return runtime classes (subclasses of ``p4bench.engine.Runtime``) that execute a
    method: the batched simulator, the per-client reference loop, byte transports,
    devices.
    """


@hookspec
def register_commands(app: typer.Typer) -> None:
    """Add commands to the ``p4bench`` command-line app (a ``typer.Typer``).

    Called once while the CLI is built; the return value is ignored.
    """


@hookspec
def register_presets() -> list[Any]:
    """Return `p4bench.studies.presets.Preset` records: a paper's experiments as `p4bench reproduce
    NAME` runs them (variants, claims, report, per-method settings). Write them beside the
    paper's method plugins; the claim helpers are in `p4bench.studies.claims`."""


# --- observation, called while a run executes --------------------------------------


@hookspec
def run_started(run: RunInfo) -> None:
    """Called after the run's data, method and runtime are set up, before round one.

    ``run`` holds the resolved config, run id, client roles and the phase plan.
    """


@hookspec
def round_finished(run: RunInfo, report: RoundReport) -> None:
    """Called after every round of every phase with that round's metrics."""


@hookspec
def privacy_release(run: RunInfo, release: Release) -> None:
    """Called for every noisy release (one DP step of some clients), in any phase.

    ``release`` names the clients, the Poisson sampling rate, the noise multiplier and
    the number of steps. The privacy ledger listens here; methods never compute epsilon.
    """


@hookspec
def run_finished(run: RunInfo, result: RunResult) -> None:
    """Called once with the final result (per-client accuracies, summary, timings)."""


HOOK_NAMES: tuple[str, ...] = (
    "register_datasets",
    "register_partitioners",
    "register_models",
    "register_topologies",
    "register_accountants",
    "register_methods",
    "register_attacks",
    "register_defenses",
    "register_runtimes",
    "register_commands",
    "register_presets",
    "run_started",
    "round_finished",
    "privacy_release",
    "run_finished",
)

__all__ = ["hookspec", "hookimpl", "HOOK_NAMES"]
