"""Per-node measurements: wall time split into compute and communication, CPU time,
peak resident memory, and an optional power meter sampled in the background."""

from __future__ import annotations

import importlib
import logging
import re
import resource
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from p4bench.errors import UsageError

log = logging.getLogger("p4bench.device")

__all__ = ["peak_rss_mb", "PowerMeter", "RoundClock"]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (2**20 bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


class PowerMeter:
    """Samples watts every `interval_s` seconds in a daemon thread.

    `source` is either ``python:package.module:function`` (a callable returning watts)
    or a command line run without a shell whose output's first number is watts (for a
    smart plug: a script that queries it). Failed readings are logged once and skipped.
    """

    def __init__(self, source: str, interval_s: float = 1.0, timeout_s: float = 5.0) -> None:
        if not source.strip():
            raise UsageError("the power meter command is empty")
        self.source, self.interval_s, self.timeout_s = (
            source,
            max(float(interval_s), 0.01),
            timeout_s,
        )
        self._read = self._resolve(source)
        self.samples: deque[tuple[float, float]] = deque(maxlen=1_000_000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def _resolve(self, source: str) -> Callable[[], float]:
        if source.startswith("python:"):
            target = source[len("python:") :]
            module_name, _, function_name = target.partition(":")
            try:
                function = getattr(importlib.import_module(module_name), function_name)
            except (ImportError, AttributeError, ValueError) as exc:
                raise UsageError(f"power meter {source!r} cannot be loaded: {exc}") from None
            return lambda: float(function())
        argv = shlex.split(source)

        def run_command() -> float:
            out = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, check=True
            ).stdout
            match = _NUMBER.search(out)
            if match is None:
                raise ValueError(f"no number in the output {out[:80]!r}")
            return float(match.group())

        return run_command

    def read(self) -> float | None:
        try:
            return self._read()
        except Exception as exc:  # noqa: BLE001 - a flaky meter must not stop a run
            if not self._warned:
                log.warning(
                    "power meter %r failed: %r (further failures are not logged)", self.source, exc
                )
                self._warned = True
            return None

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                watts = self.read()
                if watts is not None:
                    self.samples.append((time.perf_counter(), watts))
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name="p4bench-power", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1)

    def mean(self, start: float, end: float) -> float | None:
        """Mean watts of the samples taken in [start, end]; for a stretch shorter than the
        sampling interval, the latest reading before `end` (None without any)."""
        samples = list(self.samples)
        values = [w for t, w in samples if start <= t <= end]
        if values:
            return sum(values) / len(values)
        before = [w for t, w in samples if t <= end]
        return before[-1] if before else None


@dataclass
class RoundClock:
    """Timings of one round (or a phase's setup steps) on one node."""

    started: float = field(default_factory=time.perf_counter)
    cpu_started: float = field(default_factory=time.process_time)
    compute_s: float = 0.0
    between_rounds_s: float = 0.0  # since the previous round's steps ended (its evaluation, report)
    exchanges: dict[str, dict[str, float]] = field(default_factory=dict)
    # Compute time between consecutive exchanges, in order (the last entry: after the last
    # one). Every exchange waits for all its peers' end markers, so with communication free
    # a round of the group takes the sum over segments of the slowest peer's segment: the
    # critical path that `device.critical_compute_s` reports.
    segments: list[float] = field(default_factory=list, init=False)
    _segment_started_at: float = field(default=0.0, init=False)

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time spent in method code (training, building and handling messages)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - start

    def barrier(self) -> None:
        """Close the current compute segment (called as an exchange starts)."""
        self.segments.append(self.compute_s - self._segment_started_at)
        self._segment_started_at = self.compute_s

    def exchange(self, name: str, **values: float) -> None:
        """Add one exchange's figures (summed over repeated exchanges of the same name)."""
        entry = self.exchanges.setdefault(name, {})
        for key, value in values.items():
            entry[key] = entry.get(key, 0) + value

    def finish(self, meter: PowerMeter | None) -> dict[str, Any]:
        wall = time.perf_counter() - self.started
        figures: dict[str, Any] = {
            "wall_s": wall,
            "compute_s": self.compute_s,
            "comm_s": max(wall - self.compute_s, 0.0),
            "cpu_s": time.process_time() - self.cpu_started,
            "peak_rss_mb": peak_rss_mb(),
            "exchanges": self.exchanges,
            "between_rounds_s": self.between_rounds_s,
            "compute_segments": [*self.segments, self.compute_s - self._segment_started_at],
        }
        if meter is not None:
            figures["power_w"] = meter.mean(self.started, self.started + wall)
        return figures
