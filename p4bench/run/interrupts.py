"""Ctrl-C (SIGINT) as a request to stop cleanly.

A command that trains installs `graceful_interrupts()` in the main thread. While a run
trains, the first SIGINT only sets a flag: the round driver asks `stop_requested()`
after every round (the same hook as the time budget), the runner writes a checkpoint,
marks the MLflow run KILLED and raises `RunInterrupted`. A second SIGINT raises
`KeyboardInterrupt` at once (the run is marked KILLED on the way out), and any further
one, or one while the command exits, ends the process with exit code 130 without
unwinding. Outside training (start-up) the first SIGINT already raises
`KeyboardInterrupt`, unless the command asked to be graceful throughout (a sweep, whose
current run then stops after its round and whose next runs do not start).

Library callers may ask for the same clean stop without a signal: `request_stop()`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "RunInterrupted",
    "graceful_interrupts",
    "install_in_worker",
    "stop_requested",
    "request_stop",
    "clear_stop",
    "training",
    "installed",
]


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a stop request after a completed round. `where` says how far it
    got ("round 3 of 30"); `results_dir` is its local folder (None when the run kept
    none) and holds the checkpoint to resume from when `resumable`.

    A `KeyboardInterrupt`, so code that does not know about checkpoints still treats the
    run as interrupted, never as finished."""

    def __init__(
        self,
        where: str,
        results_dir: Path | None,
        resumable: bool,
        mlflow_run_id: str | None = None,
        why_not: str = "",
    ) -> None:
        self.where, self.results_dir, self.mlflow_run_id, self.why_not = (
            where,
            results_dir,
            mlflow_run_id,
            why_not,
        )
        self.resumable = resumable and results_dir is not None
        super().__init__(self.line())

    def resume_command(self) -> str:
        """The shell command that continues the run."""
        import shlex

        return f"p4bench run --resume {shlex.quote(str(self.results_dir))}"

    def line(self) -> str:
        """One line for the user: where the results are and how to resume."""
        if not self.resumable:
            kept = f"; results so far in {self.results_dir}" if self.results_dir is not None else ""
            return f"interrupted {self.where}{kept}; no checkpoint to resume from{self.why_not}"
        return f"interrupted {self.where}; results so far in {self.results_dir}; resume with: {self.resume_command()}"


class _State:
    def __init__(self) -> None:
        self.requested = False  # a stop was asked for (first SIGINT or `request_stop`)
        self.signals = 0  # SIGINTs received while installed
        self.raised = False  # one of them raised KeyboardInterrupt
        self.graceful = False  # the first SIGINT only asks to stop (else it raises at once)
        self.always_graceful = False
        self.installed = False
        self.previous: Any = None
        self.notice: Callable[[str], None] | None = None


_state = _State()


def stop_requested() -> bool:
    """Whether a clean stop after the current round was requested."""
    return _state.requested


def request_stop() -> None:
    """Ask the current run to stop after its current round (as the first Ctrl-C does)."""
    _state.requested = True


def clear_stop() -> None:
    """Forget a stop request (after the run that honoured it, when no command owns the flag)."""
    _state.requested = False


def installed() -> bool:
    """Whether a command installed the graceful SIGINT handler in this process."""
    return _state.installed


def _handle(signum: int, frame: Any) -> None:
    _state.signals += 1
    if _state.raised:
        _exit_at_once(
            signum, frame
        )  # the KeyboardInterrupt of an earlier one is still being handled
    if _state.requested or not (_state.graceful or _state.always_graceful):
        _state.raised = True
        raise KeyboardInterrupt
    _state.requested = True
    if _state.notice is not None:
        _state.notice(
            "stopping after the current round (writing a checkpoint); press Ctrl-C again to quit at once"
        )


def _exit_at_once(signum: int, frame: Any) -> None:
    """Exit 130 now, without unwinding (the process is ending after an interrupt anyway)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is sys.stderr and stream.isatty():
                stream.write("\x1b[?25h")  # a progress bar may have hidden the cursor
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(130)


def _restore() -> None:
    if _state.installed:
        # After a Ctrl-C the command is on its way out with exit 130: a further one during
        # the exit (interpreter shutdown) must not print a traceback or change the code.
        signal.signal(signal.SIGINT, _exit_at_once if _state.signals else _state.previous)
        _state.installed = False


@contextmanager
def graceful_interrupts(
    always: bool = False, notice: Callable[[str], None] | None = None
) -> Iterator[bool]:
    """Install the SIGINT handler for the duration (main thread only; a SIGINT that is
    ignored, as in a background job, stays ignored). `always`: graceful outside training
    too. `notice` gets one line when the first SIGINT is taken as a stop request. Yields
    whether the handler was installed; the previous handler is restored afterwards."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield False
        return
    _state.previous, _state.requested, _state.always_graceful, _state.notice = (
        previous,
        False,
        always,
        notice,
    )
    _state.signals, _state.raised = 0, False
    signal.signal(signal.SIGINT, _handle)
    _state.installed = True
    try:
        yield True
    finally:
        _restore()
        _state.requested, _state.always_graceful, _state.notice = False, False, None


def install_in_worker() -> None:
    """In a sweep's worker process: the terminal's Ctrl-C reaches the workers too, so each
    worker stops its run after the current round as the parent does (never restored)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    ):
        _state.previous, _state.always_graceful, _state.notice = (
            signal.getsignal(signal.SIGINT),
            True,
            None,
        )
        signal.signal(signal.SIGINT, _handle)
        _state.installed = True


@contextmanager
def training() -> Iterator[None]:
    """Marks the rounds of a run: the first SIGINT now asks for a stop after the round."""
    before = _state.graceful
    _state.graceful = True
    try:
        yield
    finally:
        _state.graceful = before


def say(line: str) -> None:
    """Print one line on stderr (the default notice)."""
    print(line, file=sys.stderr, flush=True)
