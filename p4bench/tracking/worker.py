"""A process beside `p4bench run` that writes its MLflow run, so that MLflow's import
(about 1.8 s, most of a run's start-up) runs on another core while the run imports torch
and prepares its data.

`p4bench run` calls `prestart()` before anything heavy is imported; the tracker then
`take()`s the worker instead of opening MLflow in its own process. Requests go to the
worker's stdin as pickled tuples and are carried out in order; only those that return a
value are answered (`WorkerBackend.ask`), so the run never waits for a write. As in the
run's own process, the first failure is kept and every later request skipped; `close()`
waits for the queue and returns that failure, if any.

Ctrl-C does not reach the worker (its own session; it ignores SIGINT too): the run's
interrupt handler still has to mark the MLflow run KILLED through it. The worker ends
when its stdin closes: if the run's process dies, the worker still writes everything
sent before, then exits.

`python -m p4bench.tracking.worker` is the worker; `P4BENCH_TRACKING_WORKER=0` turns
prestarting off (=1 turns it on where `run` would not use it: outside the console script).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections import deque
from typing import IO, Any

from p4bench.tracking.ops import MlflowOps, Reply, failure_line, open_failure_line

__all__ = ["WorkerBackend", "discard_prestarted", "prestart", "take"]

ENV = "P4BENCH_TRACKING_WORKER"

_prestarted: WorkerBackend | None = None


class WorkerBackend:
    """The tracker's side of a worker process (same interface as `LocalBackend`)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "p4bench.tracking.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # out of the terminal's process group: Ctrl-C reaches the run, not its writer
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._to: IO[bytes] = self.process.stdin
        self._from: IO[bytes] = self.process.stdout
        self._sent = 0
        self._waiting: deque[_WorkerReply] = deque()  # asked, not read yet, in the order asked
        self.error: str | None = None
        self.closed = False

    def _send(self, message: tuple[Any, ...]) -> bool:
        if self.closed:
            return False
        try:
            pickle.dump(message, self._to, protocol=pickle.HIGHEST_PROTOCOL)
            self._to.flush()
        except (OSError, ValueError) as exc:  # the worker is gone
            self._lost(exc)
            return False
        return True

    def _lost(self, exc: BaseException | None = None) -> None:
        self.error = (
            self.error
            or f"MLflow tracking worker ended unexpectedly ({type(exc).__name__ if exc else 'EOF'})"
        )
        self.closed = True
        for waiting in self._waiting:
            waiting.resolved = True
        self._waiting.clear()

    def open(self, uri: str) -> None:
        """Open the store (the worker has imported MLflow meanwhile); the environment's
        `MLFLOW_*` settings go with it (the worker's copy is from before the run set them)."""
        settings = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
        self._send(("open", uri, settings))

    def ask(self, action: str, op: str, *args: Any) -> Reply:
        reply = _WorkerReply(self)
        if self._send(("ask", action, op, args)):
            self._waiting.append(reply)
        else:
            reply.resolved = True
        return reply

    def call(self, action: str, op: str, *args: Any) -> None:
        self._send(("call", action, op, args))

    def _read_next(self) -> None:
        """Read the oldest outstanding answer."""
        reply = self._waiting.popleft()
        try:
            value, error = pickle.load(self._from)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self._lost(exc)
            reply.resolved = True
            return
        reply.result, reply.resolved = value, True
        self.error = self.error or error

    def close(self) -> str | None:
        """Wait until every request is written; the first failure, if any. The worker ends."""
        if not self.closed and self._send(("close",)):
            while self._waiting:
                self._read_next()
            self._waiting.append(_WorkerReply(self))
            self._read_next()
            self.closed = True
            self._to.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return self.error

    def discard(self) -> None:
        """End a worker no run used (its stdin closes; it exits)."""
        self.closed = True
        try:
            self._to.close()
        except OSError:
            pass


class _WorkerReply(Reply):
    def __init__(self, backend: WorkerBackend) -> None:
        super().__init__(None)
        self.backend, self.resolved, self.result = backend, False, None

    def value(self) -> Any:
        while not self.resolved and self.backend._waiting:
            self.backend._read_next()
        return self.result


def prestart(enabled: bool) -> None:
    """Start the worker now (where `enabled`, or `P4BENCH_TRACKING_WORKER=1`; never with =0)."""
    global _prestarted
    choice = os.environ.get(ENV)
    if _prestarted is not None or choice == "0" or not (enabled or choice == "1"):
        return
    try:
        _prestarted = WorkerBackend()
    except OSError:  # no process to spare: the tracker opens MLflow in the run's process
        _prestarted = None


def take(uri: str) -> WorkerBackend | None:
    """The prestarted worker, opened on `uri` (once), or None."""
    global _prestarted
    worker, _prestarted = _prestarted, None
    if worker is not None:
        worker.open(uri)
    return worker


def discard_prestarted() -> None:
    """End a prestarted worker that no tracker took (the run failed before it started)."""
    global _prestarted
    worker, _prestarted = _prestarted, None
    if worker is not None:
        worker.discard()


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The worker's loop: carry out requests in order until `close` or the end of input."""
    ops: MlflowOps | None = None
    error: str | None = None
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            return
        kind = message[0]
        if kind == "close":
            _answer(answers, None, error)
            return
        if kind == "open":
            _, uri, settings = message
            os.environ.update(settings)
            try:
                ops = MlflowOps(uri)
            except Exception as exc:  # noqa: BLE001 - reported to the run as one line
                error = open_failure_line(uri, exc)
            continue
        _, action, op, args = message
        value = None
        if ops is not None and error is None:
            try:
                value = getattr(ops, op)(*args)
            except Exception as exc:  # noqa: BLE001 - tracking must never end a run
                error = failure_line(action, exc)
        if kind == "ask":
            _answer(answers, value, error)


def _answer(answers: IO[bytes], value: Any, error: str | None) -> None:
    pickle.dump((value, error), answers, protocol=pickle.HIGHEST_PROTOCOL)
    answers.flush()


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run's Ctrl-C handler still needs the worker
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(
        sys.stderr.fileno(), sys.stdout.fileno()
    )  # anything MLflow prints stays off the answers
    from p4bench.tracking.ops import import_mlflow

    try:
        import_mlflow()  # now, while the run imports torch
    except ImportError:  # MLflow missing or broken: `open` fails on it and reports it as one line
        pass
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    _main()
