"""Declared sizes: what the receive gate holds a sender's declared record count to.

Methods that average by record count (FedAvg, SCAFFOLD, FedDF; Centralized's batch
shares) have each message declare its ``weight``. The receiver cannot count another
party's records, so a declaration is bounded by what the receiver knows for certain,
in this order:

1. **the partition**: each client's training records as the harness built them. The
   partition is a function of the public run seed, partitioner and data set, and every
   process builds the same one (a device peer too: `p4bench.run.runner.prepare` builds
   every client's partition on every peer), so each sender is held to its own
   partition's size (a count of 1 is always allowed: uniform weighting declares 1);
2. **a declared cap** (method option `max_declared_records`) where the partition is not
   known; with the partition, the smaller of the two;
3. **uniform** where neither is known: the declared weight is ignored and every message
   counts 1 (the gate rewrites it and logs it once), so a count nobody can check carries
   no influence.

A message above its sender's bound is rejected as ``declared records above partition``
(or ``... above cap``) naming the sender. FedAvg then pins the first weight a sender
declared (`p4bench.engine.method_kit.pinned_declarations`): an inflated first upload is
rejected before it can be pinned, and a later inflation before it reaches the method.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from p4bench.options import Option, resolve_options
from p4bench.rng import SERVER_ID

__all__ = ["MAX_DECLARED_RECORDS", "DeclaredSizes"]

log = logging.getLogger("p4bench.engine")

MAX_DECLARED_RECORDS = Option(
    "max_declared_records",
    int,
    None,
    "the most records any sender may declare as its aggregation weight; the receive gate also "
    "holds each sender to its own partition's size (public: built from the seed)",
    low=1,
)


class DeclaredSizes:
    """Per sender, the largest record count it may declare (module docstring)."""

    def __init__(
        self,
        partition: torch.Tensor | None,
        cap: float | None = None,
        public_records: int | None = None,
    ) -> None:
        self.partition = partition.double().clamp_min(1.0) if partition is not None else None
        self.cap = float(cap) if cap is not None else None
        # the server declares no records of its own: held to the data set's, where known
        self.server_bound = float(public_records) if public_records is not None else float("inf")
        self._told = False

    @classmethod
    def of_run(
        cls,
        partition: torch.Tensor | None,
        options: Mapping[str, Any] | None,
        public_records: int | None,
    ) -> DeclaredSizes:
        """The bounds a run knows: its partition (`Job.public_partition`) and the method's
        `max_declared_records` option among the run's `options`."""
        cap = resolve_options((MAX_DECLARED_RECORDS,), options or {})[MAX_DECLARED_RECORDS.name]
        return cls(partition, cap, public_records)

    @property
    def uniform(self) -> bool:
        """Whether no bound is known: weights are ignored, every message counts 1."""
        return self.partition is None and self.cap is None

    @property
    def reason(self) -> str:
        """The rejection reason of a declaration above its bound."""
        return (
            "declared records above partition"
            if self.partition is not None
            else "declared records above cap"
        )

    def bounds(self, senders: torch.Tensor) -> torch.Tensor:
        """(n,) float64: the largest count each sender may declare (inf: unbounded)."""
        device = senders.device
        if self.partition is not None:
            partition = self.partition.to(device)
            high = partition[senders.clamp(0, len(partition) - 1)]
        else:
            high = torch.full((len(senders),), float("inf"), dtype=torch.float64, device=device)
        if self.cap is not None:
            high = high.clamp_max(self.cap)
        return torch.where(senders == SERVER_ID, torch.full_like(high, self.server_bound), high)

    def within(self, senders: torch.Tensor, declared: torch.Tensor) -> torch.Tensor:
        """(n,) bool: every element of each message's declared count is at most its
        sender's bound (NaN fails; the lower bound 0 is checked with the others)."""
        flat = declared.reshape(len(declared), -1).double()
        if not flat.shape[1]:
            return torch.ones(len(declared), dtype=torch.bool, device=senders.device)
        largest = flat.max(dim=1).values.to(senders.device)
        return largest <= self.bounds(senders)

    def ignore(self, weights: torch.Tensor) -> torch.Tensor:
        """Uniform: every declared weight replaced by 1 (said once in the log)."""
        if not self._told:
            log.warning(
                "declared record counts cannot be bounded (no partition or max_declared_records "
                "known): every sender's weight counts 1"
            )
            self._told = True
        return torch.ones_like(weights)
