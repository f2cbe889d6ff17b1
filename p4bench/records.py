"""Record types at the bottom of the import graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["RoundReport", "Outcome"]


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


@dataclass
class Outcome:
    """What a runtime returns for one run."""

    accuracy: np.ndarray
    extra_accuracy: dict[str, np.ndarray]
    reports: list[RoundReport]
    final_params: dict[str, torch.Tensor]  # (M, ...) deployed parameters, for cross-runtime checks
    bytes_sent: int
    final_state: dict[str, Any] | None = None  # every client's state, rows in client order
