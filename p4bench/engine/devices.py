"""Where a run's tensors live: `--device cpu|cuda|cuda:N|auto`.

A run on an accelerator keeps its data and every client's state there. Code creates
tensors with plain factory calls (`torch.zeros(...)`, `torch.arange(...)`), so the run
executes inside `device_scope`, which makes the run device the default for those calls;
only values that come from the host (numpy arrays, bytes, loaded files) are moved
explicitly, with `to_run_device`. On the CPU no scope is entered at all, so CPU runs
are exactly as before.

Before training, `plan_memory` compares what the run needs on the device with what is
free there: data that does not fit stays in pinned host memory and is streamed to the
device batch by batch (`p4bench.engine.training.gather_batch`) and evaluated in chunks
of clients; a run whose state alone would not fit is refused with the numbers (exit 2),
never an out-of-memory traceback mid-run.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from p4bench.errors import UsageError

__all__ = [
    "DEVICE_FORMS",
    "resolve_device",
    "device_scope",
    "to_run_device",
    "MemoryPlan",
    "plan_memory",
    "free_device_memory",
    "describe_device",
    "register_emulated_type",
    "synchronize",
]

DEVICE_FORMS = "cpu, cuda, cuda:N, auto"
_PATTERN = re.compile(r"^(cpu|cuda|auto)(?::(\d+))?$")
# Device types that tests register (p4bench.testing.emulated_device): an accelerator
# emulated on the CPU, so device handling is exercised where no GPU is.
_EMULATED: set[str] = set()
# Headroom kept free on the device for temporaries (activations, per-example gradients).
WORKSPACE_FRACTION = 0.25


def register_emulated_type(name: str) -> None:
    """Accept `--device NAME` for an emulated accelerator type (tests only)."""
    _EMULATED.add(name)


def resolve_device(spec: str) -> torch.device:
    """The torch device of `--device SPEC`; a `UsageError` (exit 2, one line) for a
    malformed spec or a device this machine does not have."""
    text = str(spec).strip().lower()
    kind = text.split(":", 1)[0]
    if kind in _EMULATED:
        return torch.device(text) if ":" in text else torch.device(kind, 0)
    match = _PATTERN.match(text)
    if match is None or (match.group(1) != "cuda" and match.group(2) is not None):
        raise UsageError(f"--device must be one of {DEVICE_FORMS}, got {spec!r}")
    if kind == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if kind == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device()) if available else torch.device("cpu")
        )
    if not available:
        raise UsageError(
            f"--device {spec}: CUDA is not available on this machine (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu or auto"
        )
    index = int(match.group(2)) if match.group(2) is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise UsageError(
            f"--device {spec}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", index)


@contextlib.contextmanager
def device_scope(device: torch.device) -> Iterator[None]:
    """Make `device` the default of tensor factory calls inside (nothing on the CPU)."""
    if device.type == "cpu":
        yield
        return
    with torch.device(device):
        yield


def to_run_device(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """`tensor` on the run's device (`device`, else the scope's default device)."""
    target = device if device is not None else torch.get_default_device()
    return tensor if tensor.device == target else tensor.to(target)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for timings); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes on a CUDA device; None where the device has no such query."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def describe_device(device: torch.device) -> str:
    """A human name for run records: 'cpu' or 'cuda:0 (NVIDIA H100 80GB HBM3)'."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


@dataclass(frozen=True)
class MemoryPlan:
    """Where a run's client data lives, and the numbers it was decided from."""

    device: torch.device
    data_bytes: int
    state_bytes: int
    free_bytes: int | None
    stream_data: bool  # data in pinned host memory, moved to the device batch by batch

    def summary(self) -> dict[str, object]:
        return {
            "device.data_bytes": self.data_bytes,
            "device.state_bytes": self.state_bytes,
            "device.free_bytes": self.free_bytes,
            "device.data_placement": "streamed" if self.stream_data else "resident",
        }


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def plan_memory(
    device: torch.device, data_bytes: int, state_bytes: int, free: int | None = None
) -> MemoryPlan:
    """Decide whether the data stays resident on the device or is streamed; refuse a run
    whose per-client state (parameters, optimiser and method state, with headroom for
    temporaries) does not fit. `free` defaults to what the device reports."""
    if free is None:
        reported = free_device_memory(device)
        free = reported[0] if reported is not None else None
    if free is None:  # the CPU, or an emulated device: host memory is the limit, as before
        return MemoryPlan(device, data_bytes, state_bytes, None, stream_data=False)
    usable = int(free * (1 - WORKSPACE_FRACTION))
    if state_bytes > usable:
        raise UsageError(
            f"the run does not fit on {device}: its client state needs {_gib(state_bytes)} ({state_bytes} bytes) plus "
            f"{WORKSPACE_FRACTION:.0%} headroom, {_gib(free)} ({free} bytes) are free; "
            "use fewer clients or a smaller model"
        )
    return MemoryPlan(
        device, data_bytes, state_bytes, free, stream_data=state_bytes + data_bytes > usable
    )
