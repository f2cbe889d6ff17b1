"""Record types: what a run reports to its observers (the arguments of the observation hooks).

This module sits at the bottom of the import graph. `p4bench.hookspecs` annotates with
these types, and the engine, the privacy ledger, trackers and plugins all read them, so
it imports nothing that imports p4bench modules above it: only the run config, the
federated data and the certification verdict. Values that belong to upper layers (a
method's phases, the method itself) are typed here by what records read of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from p4bench.config import RunConfig
from p4bench.data.base import PartitionReport
from p4bench.data.federated import FederatedData
from p4bench.privacy.certification import Certification

__all__ = [
    "Release",
    "RunInfo",
    "RunResult",
    "PhaseView",
    "ArtifactWriter",
    "RoundReport",
    "Outcome",
]


@dataclass(frozen=True)
class Release:
    """One noisy release by some clients: `steps` DP steps at Poisson rate `sample_rate`."""

    clients: tuple[int, ...]
    sample_rate: float
    noise_multiplier: float
    steps: int = 1
    phase: str = ""


class PhaseView(Protocol):
    """What records read of a method's phase (`p4bench.engine.Phase`, a layer above)."""

    @property
    def name(self) -> str: ...

    @property
    def rounds(self) -> int: ...


class ArtifactWriter(Protocol):
    """What records call on a method (`p4bench.engine.Method`, a layer above)."""

    def write_artifacts(self, state: Any, folder: Path) -> list[Path]: ...


@dataclass
class RunInfo:
    """What observers know about a run once it is set up."""

    run_id: str
    config: RunConfig
    evaluation: np.ndarray  # (M,) bool
    malicious: np.ndarray  # (M,) bool
    phases: Sequence[PhaseView]  # the method's `Phase` values, in order
    num_parameters: int
    defense: str | None
    started_at: float
    data: FederatedData | None = None
    tracking: dict[str, Any] = field(default_factory=dict)  # filled by trackers
    certification: Certification | None = None  # whether the run's epsilon holds
    # Hash of the config as requested: resolution (`resolve_run_config`) is a pure function
    # of it, and sweeps find finished runs by it.
    config_hash: str = ""
    # {kind: {name, distribution, version}} of every plugin the run uses (provenance)
    plugins: dict[str, dict[str, str]] = field(default_factory=dict)
    # {kind: {option: value}}: every used plugin's declared options, resolved (p4bench.options)
    plugin_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the unlabeled public data the method reads besides the clients' records (threat model), or None
    public_data: str | None = None
    # the partitioner's statistics and artifacts (`partition.*` metrics, e.g. cbds's matrix)
    partition_report: PartitionReport = field(default_factory=PartitionReport)

    @property
    def reported(self) -> np.ndarray:
        """Clients whose results are reported: benign and not used for tuning."""
        reported: np.ndarray = ~self.evaluation & ~self.malicious
        return reported

    @property
    def total_rounds(self) -> int:
        return sum(p.rounds for p in self.phases)


@dataclass
class RunResult:
    """A finished run: its info, the runtime's outcome, wall time and headline summary."""

    info: RunInfo
    outcome: Outcome
    wall_time_s: float
    summary: dict[str, Any]
    method: ArtifactWriter | None = None

    def write_method_artifacts(self, folder: Path) -> list[Path]:
        """Method-specific files (e.g. P4's groups) written into `folder`."""
        if self.method is None or self.outcome.final_state is None:
            return []
        return self.method.write_artifacts(self.outcome.final_state, folder)


@dataclass
class RoundReport:
    """Metrics of one finished round (or, with `round` = -1, of a phase's setup steps)."""

    phase: str
    round: int
    step: int  # rounds finished so far over all phases
    accuracy: np.ndarray  # (M,) each client's deployed model on its own test split
    train_loss: float  # mean loss over the round's local updates (nan if none)
    seconds: float  # the round's steps (computation and communication), evaluation excluded
    bytes_sent: int  # all clients (and the server), this round, self-messages excluded
    metrics: dict[str, float] = field(default_factory=dict)
    client_bytes_sent: np.ndarray | None = None  # (M,) communication ledger, this round
    client_bytes_received: np.ndarray | None = None
    extra_accuracy: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. {"proxy": (M,)}
    bytes_received: int = 0  # by the nodes of this process, self-messages excluded
    losses: np.ndarray | None = None  # each local update's mean loss, this round


def display_round(phases: Sequence[Any], phase: str, round_index: int) -> int:
    """The round a plot and MLflow show for round `round_index` of `phase`: the last
    phase's rounds are 1..T, as every method's, and earlier phases' rounds (P4's grouping)
    count down to 0 before them, so that methods compare round for round."""
    names = [p.name for p in phases]
    if not names or phase == names[-1] or phase not in names:
        return round_index + 1
    position = names.index(phase)
    before = sum(
        int(p.rounds) for p in phases[:position]
    )  # earlier rounds of the phases before this one
    earlier = sum(int(p.rounds) for p in phases[:-1])
    return before + round_index - earlier + 1


# Per-client values a round reports besides accuracies (`RoundReport.extra_accuracy`
# entries named with one of these prefixes): logged as `<name>_mean`, not `accuracy_<name>_mean`.
VALUE_PREFIXES = ("test_", "count_")
GLOBAL_ACCURACY = (
    "global"  # the extra accuracy of each client's deployed model on the global test set (`--eval`)
)


def extra_metric_name(name: str) -> str:
    """The run metric of an extra per-client value: `accuracy_<name>_mean` for accuracies
    (extra models, method-measured accuracies), `<name>_mean` for `VALUE_PREFIXES` values."""
    return f"{name}_mean" if name.startswith(VALUE_PREFIXES) else f"accuracy_{name}_mean"


@dataclass
class Outcome:
    """What a runtime returns for one run."""

    accuracy: np.ndarray
    extra_accuracy: dict[str, np.ndarray]
    reports: list[RoundReport]
    final_params: dict[str, torch.Tensor]  # (M, ...) deployed parameters, for cross-runtime checks
    bytes_sent: int
    final_state: dict[str, Any] | None = None  # every client's state, rows in client order
    budget_overran_at: int | None = (
        None  # the step of the first round that ended past the time budget
    )
