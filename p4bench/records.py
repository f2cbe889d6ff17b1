"""Record types: what a run reports to its observers (the arguments of the observation hooks).

This module sits at the bottom of the import graph. `p4bench.hookspecs` annotates with
these types, and the engine, the privacy ledger, trackers and plugins all read them, so
it imports nothing that imports p4bench modules above it: only the run config, the
federated data and the certification verdict. Values that belong to upper layers (a
method's phases, the method itself) are typed here by what records read of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    summary: RunSummary
    method: ArtifactWriter | None = None
    artifact_writers: Sequence[Callable[[Path], list[Path]]] = field(default_factory=list)

    def write_method_artifacts(self, folder: Path) -> list[Path]:
        """Method-specific files (e.g. P4's groups; the run's network DP) written into `folder`."""
        extra = [path for write in self.artifact_writers for path in write(folder)]
        if self.method is None or self.outcome.final_state is None:
            return extra
        return self.method.write_artifacts(self.outcome.final_state, folder) + extra


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


@dataclass(frozen=True)
class PrivacyFigures:
    """A private run's ledger figures (`PrivacyLedger.summary`): epsilon (max and mean over
    the reported clients) under each accountant, the evaluation clients' own, the settings
    and the budget stops; `epsilon_scope`, the rounds a time-budget-stopped run's covers."""

    epsilon: float
    epsilon_mean: float
    epsilon_rdp: float
    epsilon_rdp_mean: float
    epsilon_pld: float | None
    epsilon_pld_mean: float | None
    epsilon_evaluation_clients: float | None
    evaluation_clients: int | None  # None: the ledger was never told who they are
    epsilon_budget: float | None
    accountant: str
    delta: float
    noise_multiplier: float
    clip: float
    neighbouring: str
    clients_stopped: int
    budget_stops: list[dict[str, Any]]
    epsilon_scope: str | None = None

    def fields(self) -> dict[str, Any]:
        """The summary's keys, in the ledger's order (absent where None: pld, counts, scope)."""
        figures: dict[str, Any] = {
            "epsilon": self.epsilon,
            "epsilon_mean": self.epsilon_mean,
            "epsilon_rdp": self.epsilon_rdp,
            "epsilon_rdp_mean": self.epsilon_rdp_mean,
        }
        if self.epsilon_pld is not None:
            figures.update(epsilon_pld=self.epsilon_pld, epsilon_pld_mean=self.epsilon_pld_mean)
        figures["epsilon_evaluation_clients"] = self.epsilon_evaluation_clients
        if self.evaluation_clients is not None:
            figures["evaluation_clients"] = self.evaluation_clients
        return figures | {
            "epsilon_budget": self.epsilon_budget,
            "accountant": self.accountant,
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "neighbouring": self.neighbouring,
            "clients_stopped": self.clients_stopped,
            "budget_stops": self.budget_stops,
        }


@dataclass(frozen=True)
class RunSummary(Mapping[str, Any]):
    """A finished run's headline figures, one field per figure, each written once: the
    runner builds it (`p4bench.run.summary.build_summary`) from the run's sections; a
    `run_finished` hook that adds to it replaces a field (`dataclasses.replace`), the
    tracker's fields come last. `as_dict` is summary.json (and the `--json` line), in its
    key order; MLflow's metrics and tags are rendered from it (`p4bench.run.artifacts`). It
    reads as that mapping too (`summary["epsilon"]`), for code that reads summary.json."""

    run_id: str
    method: str
    attack: str | None
    defense: str | None
    dataset: str
    partitioner: str
    seed: int
    rounds: int  # of the method's last phase
    rounds_completed: int
    phases: dict[str, dict[str, int]]  # {phase: {rounds, completed}}
    time_budget_min: float | None
    stopped_by_time_budget: bool
    stopped_by_method: bool  # its own stopping rule (`Method.finished`) ended the run
    rounds_past_budget: int | None  # with a time budget that cut the run short
    rounds_within_budget: int | None
    clients: int
    reported_clients: int
    evaluation_clients: int  # reserved for tuning; they train too
    accuracy_mean: float  # over the reported clients' own test splits
    accuracy_min: float
    accuracy_max: float
    accuracy_std: float  # population std (ddof 0) over the reported clients
    accuracy_p10: float  # their bottom decile: the 10th percentile, numpy's linear method
    accuracy_per_client: dict[str, float]
    extra_accuracy: dict[str, float]  # accuracy_<name>_mean of the method's other figures
    eval_set: str
    accuracy: float  # the headline: personal or global (`eval_set`)
    accuracy_global_min: float | None
    accuracy_global_max: float | None
    accuracy_global_std: float | None  # std and p10 of the global test set's, as above
    accuracy_global_p10: float | None
    unseen: dict[str, Any]  # `--unseen-fraction`: the unseen clients' figures (empty without)
    bytes_sent: int
    bytes_per_phase: dict[str, int]
    seconds_per_phase: dict[str, float]
    client_bytes_sent: dict[str, float]  # mean and max over clients
    client_bytes_received: dict[str, float]
    wall_time_s: float
    config_hash: str
    plugins: dict[str, dict[str, str]]
    public_data: str | None
    partition_stats: dict[str, Any] | None
    method_figures: dict[str, float]  # `Method.derived_metrics` and a client gate's gate.*
    rejections: dict[str, int]
    rejected_messages: int
    privacy: PrivacyFigures | None  # None: not private (epsilon null, never 0.0)
    privacy_context: dict[str, Any]  # who observes the releases (`Method.privacy_context`)
    certification: Certification | None
    verification: dict[str, Any]  # `p4bench.run.verify.RunVerification.summary`
    compute_device: str
    memory: dict[str, object]  # a GPU run's data placement (`DataPlacement.summary`)
    resumed_from_step: int | None
    device: dict[str, Any] | None = None  # the device runtime's measurements (its hook)
    threads: int | None = None  # torch threads the run computed on (`p4bench.run.threads`)
    tracking: dict[str, Any] = field(default_factory=dict)  # the trackers' (`RunInfo.tracking`)

    @property
    def epsilon(self) -> float | None:
        return self.privacy.epsilon if self.privacy is not None else None

    @property
    def delta(self) -> float | None:
        return self.privacy.delta if self.privacy is not None else None

    @property
    def private(self) -> bool:
        if self.certification is not None:
            return self.certification.private
        return self.privacy is not None

    def as_dict(self) -> dict[str, Any]:
        """summary.json's keys and values, in its order."""
        return dict(self._rendered)

    @functools.cached_property
    def _rendered(self) -> dict[str, Any]:
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = {k: flat[k] for k in _HEAD}
        if self.rounds_past_budget is not None:
            out.update(
                rounds_past_budget=self.rounds_past_budget,
                rounds_within_budget=self.rounds_within_budget,
            )
        out |= {k: flat[k] for k in _CLIENTS} | self.extra_accuracy
        out.update(eval_set=self.eval_set, accuracy=self.accuracy)
        if self.accuracy_global_min is not None:
            out.update(
                accuracy_global_min=self.accuracy_global_min,
                accuracy_global_max=self.accuracy_global_max,
                accuracy_global_std=self.accuracy_global_std,
                accuracy_global_p10=self.accuracy_global_p10,
            )
        out |= self.unseen
        out.update(epsilon=None, epsilon_evaluation_clients=None)  # a private run's: below
        out |= {k: flat[k] for k in _COSTS}
        if self.partition_stats is not None:
            out["partition_stats"] = self.partition_stats
        out |= self.method_figures
        out.update(rejections=self.rejections, rejected_messages=self.rejected_messages)
        if self.privacy is not None:
            out |= self.privacy.fields()
        out |= self.privacy_context
        if self.privacy is not None and self.privacy.epsilon_scope:
            out["epsilon_scope"] = self.privacy.epsilon_scope
        if self.certification is not None:
            out |= self.certification.summary_fields() | self.verification
        out["compute_device"] = self.compute_device
        if self.threads is not None:
            out["threads"] = self.threads
        out |= self.memory
        if self.resumed_from_step is not None:
            out["resumed_from_step"] = self.resumed_from_step
        if self.device is not None:
            out["device"] = self.device
        return out | self.tracking

    def __getitem__(self, key: str) -> Any:
        return self._rendered[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rendered)

    def __len__(self) -> int:
        return len(self._rendered)

    def without_reported_accuracy(self) -> RunSummary:
        """The summary of a tuning run, whose reported clients were not evaluated: their
        accuracy_* figures NaN (not 0), no per-client figures; the evaluation clients' stay
        (and `accuracy`, which the summary.json of such runs has always kept)."""
        nan = float("nan")
        held = None if self.accuracy_global_min is None else nan
        return dataclasses.replace(
            self,
            accuracy_mean=nan,
            accuracy_min=nan,
            accuracy_max=nan,
            accuracy_std=nan,
            accuracy_p10=nan,
            accuracy_global_min=held,
            accuracy_global_max=held,
            accuracy_global_std=held,
            accuracy_global_p10=held,
            accuracy_per_client={},
            extra_accuracy={
                k: (v if k == "accuracy_evaluation_mean" else nan)
                for k, v in self.extra_accuracy.items()
            },
        )


# summary.json's flat keys, in its order (the sections between them: `RunSummary._rendered`)
_HEAD = """run_id method attack defense dataset partitioner seed rounds rounds_completed phases
time_budget_min stopped_by_time_budget stopped_by_method""".split()
_CLIENTS = """clients reported_clients evaluation_clients accuracy_mean accuracy_min accuracy_max
accuracy_std accuracy_p10 accuracy_per_client""".split()
_COSTS = """bytes_sent bytes_per_phase seconds_per_phase client_bytes_sent client_bytes_received
wall_time_s config_hash plugins public_data""".split()
