"""What a device run returns (`DeviceOutcome`) and the error of a run that cannot start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p4bench.engine.runtime import Outcome
from p4bench.engine.state import State
from p4bench.errors import P4BenchError

__all__ = ["DeviceError", "DeviceOutcome"]


class DeviceError(P4BenchError):
    """A device run could not start or lost every peer."""


@dataclass
class DeviceOutcome(Outcome):
    """An Outcome plus the device measurements (``summary["device"]``) and each
    collected peer's final state (node id -> state with one row)."""

    device: dict[str, Any] = field(default_factory=dict)
    peer_states: dict[int, State] = field(default_factory=dict)
