"""`Job`: everything a runtime needs to execute one run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p4bench.engine.method import Method
from p4bench.engine.threats import Attack, Defense
from p4bench.models import Model

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data import FederatedData
    from p4bench.privacy.mechanism import DPMechanism, DPSettings
    from p4bench.records import Release

__all__ = ["Job", "MechanismFactory"]

# (rows, secret) -> the DP mechanism of a group of clients: their noise streams (secret
# per client where `secret`) wired to the run's ledger. Built by the privacy harness, so
# that the engine never constructs privacy objects itself.
MechanismFactory = Callable[[torch.Tensor, bool], "DPMechanism"]


def _report_nothing(release: Release) -> None:
    """Default `Job.report_release`: nobody listens (runs without a ledger)."""


def _allow_all(clients: torch.Tensor, rate: float, phase: str) -> torch.Tensor:
    """Default `Job.release_allowed`: no budget to enforce."""
    return torch.ones(len(clients), dtype=torch.bool, device=clients.device)


@dataclass
class Job:
    """Everything a runtime needs to execute one run."""

    config: RunConfig
    method: Method
    model: Model
    data: FederatedData
    attack: Attack | None = None
    defense: Defense | None = None
    malicious: torch.Tensor | None = None  # (M,) bool, known to the harness only
    dp: DPSettings | None = None
    report_release: Callable[[Release], None] = _report_nothing
    release_allowed: Callable[[torch.Tensor, float, str], torch.Tensor] = _allow_all
    # Replaces each group's DP mechanism by a wrapper around it (the privacy audit's canaries).
    wrap_mechanism: Callable[[DPMechanism], DPMechanism] | None = None
    # Builds each group's DP mechanism; set with `dp` (p4bench.privacy.mechanism.attach_mechanisms).
    dp_factory: MechanismFactory | None = None
    # N, the training records of the data set: public (the default delta is 1/(10 N)), the
    # receive gate's bound on a declared aggregation weight. None: not known, not bounded.
    public_records: int | None = None
    # (M,) each client's training records: public, since every process builds the partition
    # from the seed (a device peer too); the receive gate holds each sender's declared
    # record count to its own (`p4bench.engine.declared_sizes`). None: not known.
    public_partition: torch.Tensor | None = None
    # Bytes the DP step's per-example work may take at once (`p4bench.engine.chunking`),
    # as the runner's memory plan set it; None: --memory-budget, else the default.
    memory_budget: int | None = None
