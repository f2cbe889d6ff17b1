"""How many torch threads a run uses: chosen by the run, never inherited.

torch's default (one thread per core, or `OMP_NUM_THREADS`) is right for one process alone
on a machine and wrong for several at once: a sweep's workers, each with as many threads as
the machine has cores, fight for them and run 5-20x slower on a busy machine. So a run sets
its own number before it builds anything (`using_threads`): `RunConfig.threads` where the
config gives it, else the cores this run may use (`default_threads`):

- all the cores this process may run on (its CPU affinity) when it runs alone;
- its share, `cores // jobs`, inside a worker of a sweep, tuning or reproduction with
  `--jobs` (`p4bench.studies.backends` gives each worker its share: `set_process_share`);
- never more than `OMP_NUM_THREADS` where the user's environment sets it: that is the
  user's statement of what a process may take (on a busy machine, `OMP_NUM_THREADS=1`
  kept runs 5-20x faster than two threads each), so the run keeps it as a ceiling. It is
  no longer what decides: without it the run takes its cores, not torch's own default.

A run's verification replay (`p4bench.run.verify`) runs in the run's own process, after
the run's rounds (or before them, at the run's size), never beside them: it takes the run's
number, which its config carries.

On a Ray cluster, Ray sets `OMP_NUM_THREADS` to a task's CPUs (`cpus_per_run`): the ceiling.

The run records the number it used (the config `run` receives from `on_chosen_threads`
carries it: the summary's `threads`, the `--json` line and the MLflow parameter). Importing this module
does not import torch: the command line checks its options before torch is loaded.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:
    from p4bench.config import RunConfig

Params = ParamSpec("Params")
Result = TypeVar("Result")

__all__ = [
    "default_threads",
    "environment_ceiling",
    "on_chosen_threads",
    "process_share",
    "set_process_share",
    "share_of",
    "usable_cores",
    "using_threads",
]

_process_share: int | None = None  # a worker's share of the cores (None: the process is alone)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one (a
    container or `taskset` limits it), else every core of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def set_process_share(threads: int | None) -> None:
    """Give this process `threads` of the machine's cores (a worker among several; None:
    the process runs alone again)."""
    global _process_share
    if threads is not None and threads < 1:
        raise ValueError(f"a process's share of the cores must be at least 1, got {threads}")
    _process_share = threads


def process_share() -> int | None:
    """This process's share of the cores, where it is one of several workers."""
    return _process_share


def share_of(jobs: int) -> int:
    """Each of `jobs` processes' share of this process's cores (at least one)."""
    return max(1, usable_cores() // max(1, jobs))


def default_threads() -> int:
    """The threads a run takes when its config names none: a worker's share among
    several, else every core this process may use; at most `OMP_NUM_THREADS` where set."""
    cores = _process_share if _process_share is not None else usable_cores()
    ceiling = environment_ceiling()
    return min(cores, ceiling) if ceiling is not None else cores


def environment_ceiling() -> int | None:
    """`OMP_NUM_THREADS` where it is a positive integer (OpenMP's own syntax allows a list
    per nesting level: its first entry); None where unset or unreadable."""
    text = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


@contextmanager
def using_threads(threads: int) -> Iterator[int]:
    """torch's intra-op threads set to `threads` inside the block, and set back after it
    (a run inside a longer process, a test or a sweep in this process, leaves the
    process's number as it found it). Yields the number torch reports it now uses.

    The inter-op pool can be sized only before torch's first parallel work; where that has
    happened already torch refuses, and the pool keeps its size (it runs only
    `torch.jit.fork` tasks, which a run does not use)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already started: see above
        pass
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def on_chosen_threads(
    run: Callable[Concatenate[RunConfig, Params], Result],
) -> Callable[Concatenate[RunConfig, Params], Result]:
    """`run(config, ...)` on `config.threads` torch threads, or on `default_threads()` where
    the config names none; the config it receives records the number."""

    def on_threads(config: RunConfig, /, *args: Params.args, **kwargs: Params.kwargs) -> Result:
        threads = config.threads if config.threads is not None else default_threads()
        with using_threads(threads):
            return run(config.replace(threads=threads), *args, **kwargs)

    functools.update_wrapper(on_threads, run)  # its name, docstring and signature
    return on_threads
