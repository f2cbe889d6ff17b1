"""Runtimes: which clients one process holds, and the network between the processes.

Every runtime executes a run with the one `RoundDriver` (p4bench.engine.driver); a
runtime only chooses the groups of clients (one batched group in the simulator, one
client per group in the reference and bytes runtimes), how gradients are computed,
and the `Network` the driver's exchanges go through. All of them run the same method
code and draw the same per-client random streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from p4bench.engine.driver import STREAM_ATTACK, STREAM_TRAINING, RoundDriver, StopAfter
from p4bench.engine.job import Job
from p4bench.engine.network import BytesNetwork, InProcessNetwork, Network
from p4bench.engine.threats import Aggregator
from p4bench.records import Outcome, RoundReport

__all__ = [
    "Runtime",
    "GroupedRuntime",
    "SimulationRuntime",
    "ReferenceRuntime",
    "BytesRuntime",
    "Job",
    "Outcome",
    "RoundReport",
    "STREAM_TRAINING",
    "STREAM_ATTACK",
]


class Runtime(ABC):
    """Base class of runtime plugins."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # Clients are separate parties (devices): DP randomness must then be secret per client.
    separate_parties: ClassVar[bool] = False

    @abstractmethod
    def execute(self, job: Job, on_round: Callable[[RoundReport], None]) -> Outcome:
        """Run every phase of `job.method`, calling `on_round` after each round."""


class GroupedRuntime(Runtime):
    """A runtime whose processes all live here: the driver holds every client, in the
    groups `group_rows` gives, and the server; messages go through `network()`."""

    batched_gradients: ClassVar[bool] = True

    def __init__(self) -> None:
        self.driver: RoundDriver | None = None
        # Set by the runner before `execute`: when to stop besides the schedule (time budget,
        # Ctrl-C), and what to write into the new driver before its first round (a checkpoint).
        self.stop_after: StopAfter | None = None
        self.prepare_driver: Callable[[RoundDriver], None] | None = None

    def group_rows(self, num_clients: int) -> list[torch.Tensor]:
        """Client ids held by each group (one per process in a deployment)."""
        return [torch.arange(num_clients)]

    def network(self) -> Network:
        """The network the run's exchanges go through."""
        return InProcessNetwork()

    def execute(self, job: Job, on_round: Callable[[RoundReport], None]) -> Outcome:
        self.driver = RoundDriver(
            job,
            self.network(),
            self.group_rows(job.data.num_clients),
            holds_server=True,
            batched_gradients=self.batched_gradients,
            separate_parties=self.separate_parties,
        )
        if self.prepare_driver is not None:
            self.prepare_driver(self.driver)
        return self.driver.run(on_round, stop_after=self.stop_after)

    @property
    def aggregator(self) -> Aggregator | None:
        """The run's aggregator (its defense log), once the run has started."""
        return self.driver.aggregator if self.driver is not None else None


class SimulationRuntime(GroupedRuntime):
    """All clients in one batch: stacked parameters, vmapped per-client math."""

    name = "simulation"
    description = "batched simulator: all clients of a round in one vectorised step"


class ReferenceRuntime(GroupedRuntime):
    """One client at a time with plain autograd: slow, obvious, used to check the simulator."""

    name = "reference"
    description = "per-client loop with plain autograd (for tests and benchmarks)"
    batched_gradients = False

    def group_rows(self, num_clients: int) -> list[torch.Tensor]:
        return [torch.tensor([i]) for i in range(num_clients)]


class BytesRuntime(GroupedRuntime):
    """One client per node; every message is encoded to bytes and decoded by its receiver."""

    name = "bytes"
    description = "one node per client, messages serialised to bytes (safetensors) in memory"

    def group_rows(self, num_clients: int) -> list[torch.Tensor]:
        return [torch.tensor([i]) for i in range(num_clients)]

    def network(self) -> Network:
        return BytesNetwork()
