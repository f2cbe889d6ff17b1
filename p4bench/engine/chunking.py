"""A DP step in bounded memory: the clients of one clipped-gradient call in chunks.

The generic clipping path materialises every per-example gradient of the call, (C, b, P)
values; for a CNN at thousands of clients that is far more than any machine holds. The
clients' clipped sums are independent of each other, so `clipped_gradient_sum` computes
them for at most `clients_per_chunk` clients at a time, a count chosen so that the
per-example work of one chunk fits the run's memory budget:

- `--memory-budget GB` (`RunConfig.memory_budget_gb`) sets it for a run (the runner enters
  `memory_budget`);
- otherwise half of the memory the device has free (CUDA: `mem_get_info`; the CPU:
  MemAvailable of /proc/meminfo; 4 GiB where neither is known).

A chunk holds at least one client: a budget below one client's per-example gradients
still runs, one client at a time. Before training, `plan_work` checks that the budget fits
beside the run's data, client state and the method's own exchanges (`Method.working_bytes`)
in the memory the device has free, and refuses the run with the bytes (exit 2) otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from p4bench.errors import UsageError

__all__ = [
    "WORK_FACTOR",
    "available_bytes",
    "clients_per_chunk",
    "default_budget",
    "dp_step_bytes",
    "memory_budget",
    "per_client_bytes",
    "plan_work",
]

# Per-example gradients, their squares for the norms and the scaled copy summed: about
# three times the gradients' own bytes are alive at once in the generic path.
WORK_FACTOR = 3
_FALLBACK = 4 << 30
_SMALL = 64 << 20  # per-example work this small never needs chunks under the default budget
_BUDGET: ContextVar[int | None] = ContextVar("p4bench_memory_budget", default=None)


@contextmanager
def memory_budget(nbytes: int | None) -> Iterator[None]:
    """Within the block, clipped-gradient calls keep their per-example work under `nbytes`
    (None: the default, half the free memory)."""
    token = _BUDGET.set(nbytes)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def default_budget(device: torch.device) -> int:
    """Half the memory `device` has free now."""
    free = available_bytes(device)
    return free // 2 if free is not None else _FALLBACK


def per_client_bytes(params_per_client: int, width: int, element_size: int) -> int:
    """Bytes of one client's per-example work: `width` examples x its parameters."""
    return WORK_FACTOR * max(width, 1) * max(params_per_client, 1) * element_size


def dp_step_bytes(
    model: object, params_per_client: int, width: int, classes: int, element_size: int = 4
) -> int:
    """One client's per-example work in the DP step: the linear model's clipping holds
    per-example logit gradients only (`width` x `classes`), other models per-example
    gradients of every parameter."""
    from p4bench.models import LinearSoftmax  # the engine's models, imported where needed

    if type(model) is LinearSoftmax:
        return WORK_FACTOR * max(width, 1) * classes * element_size
    return per_client_bytes(params_per_client, width, element_size)


def clients_per_chunk(
    clients: int, params_per_client: int, width: int, element_size: int, device: torch.device
) -> int:
    """How many of `clients` one call handles at once under the budget (at least 1)."""
    need = clients * per_client_bytes(params_per_client, width, element_size)
    budget = _BUDGET.get()
    if budget is None:
        if need <= _SMALL:  # the usual case: no query of the free memory on every step
            return clients
        budget = default_budget(device)
    return max(1, min(clients, budget // per_client_bytes(params_per_client, width, element_size)))


def plan_work(
    device: torch.device,
    fixed_bytes: int,
    one_client_bytes: int,
    requested: int | None,
    free: int | None = None,
    headroom: float = 0.25,
) -> int | None:
    """The per-example budget (bytes) of a run, checked against the memory `device` has
    free: `fixed_bytes` (data, client state, the method's exchanges) must leave room for
    one client's per-example work at least, and a `requested` budget (--memory-budget)
    must fit beside it. A UsageError (exit 2, one line with the bytes) otherwise; None
    where the free memory is unknown (the default budget then applies per call)."""
    if free is None:
        free = available_bytes(device)
    if free is None:
        return requested
    usable = int(free * (1 - headroom))
    room = usable - fixed_bytes
    if room < one_client_bytes:
        raise UsageError(
            f"the run does not fit in {device} memory: data, client state and the method's exchanges need "
            f"{_gib(fixed_bytes)}, one client's DP step {_gib(one_client_bytes)} more, and {_gib(free)} are free "
            f"({headroom:.0%} kept as headroom); use fewer clients or a smaller model"
        )
    if requested is not None and requested > room:
        raise UsageError(
            f"--memory-budget {requested / 2**30:g} GB does not fit in {device} memory: {_gib(free)} are free, "
            f"{_gib(fixed_bytes)} of it taken by data, client state and the method's exchanges ({headroom:.0%} kept "
            f"as headroom); at most {room / 2**30:.2f} GB is left for the DP step"
        )
    return requested if requested is not None else min(room, free // 2)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, or the host's available memory for the CPU; None
    where neither is known (an emulated accelerator, a host without /proc/meminfo)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
