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
still runs, one client at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

__all__ = ["WORK_FACTOR", "clients_per_chunk", "default_budget", "memory_budget", "per_client_bytes"]

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
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) // 2
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return _FALLBACK


def per_client_bytes(params_per_client: int, width: int, element_size: int) -> int:
    """Bytes of one client's per-example work: `width` examples x its parameters."""
    return WORK_FACTOR * max(width, 1) * max(params_per_client, 1) * element_size


def clients_per_chunk(clients: int, params_per_client: int, width: int, element_size: int,
                      device: torch.device) -> int:
    """How many of `clients` one call handles at once under the budget (at least 1)."""
    need = clients * per_client_bytes(params_per_client, width, element_size)
    budget = _BUDGET.get()
    if budget is None:
        if need <= _SMALL:  # the usual case: no query of the free memory on every step
            return clients
        budget = default_budget(device)
    return max(1, min(clients, budget // per_client_bytes(params_per_client, width, element_size)))
