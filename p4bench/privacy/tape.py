"""The release tape: every DP release of a run, recorded, and forced on a replay.

The post-processing check (`p4bench.privacy.post_processing`) runs a method twice:
once recording the value of every noisy release, once with other private records and
every release forced to its recorded value. Whatever the method computes from the
releases alone is then identical in both runs; anything else it sends read the records
outside the DP mechanism.

`Releases` (the one entry point to DP noise) hands each release's value to the tape
open in this context, if any:

- `add_noise` (and `privatise`): the noisy sums or means, after the mechanism has
  drawn its noise;
- `central`: a trusted server's noisy pooled sum (`add_central_noise`);
- `add_scaled_noise` and `draw` (fused paths) cannot be forced: the first's target may
  hold state besides the release (forcing it would force that state too and hide what
  it read), the second's draws are turned into the release in the method's own kernel.
  The tape notes them, and the check says the method is not verifiable on that path.

On a replay the mechanism still draws its noise (every random stream advances as in
the recorded run) before the value is overwritten.

A run verified at its own size releases as much as it trains: the recorded values stay
in memory up to `P4BENCH_TAPE_MEMORY_MB` (default 256) and go to a temporary file beyond
it, read back in order by the replay. The kept clipped sums of the isolation check
(`p4bench.privacy.isolation`) are kept as row fingerprints only (`p4bench.privacy.fingerprint`):
they are compared, never forced.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO

import numpy as np
import numpy.typing as npt
import torch

from p4bench.privacy.fingerprint import row_fingerprints, row_norms

__all__ = ["ReleaseStore", "ReleaseTape", "ReplayDiverged", "current_tape", "using_tape"]

_TAPE: ContextVar[ReleaseTape | None] = ContextVar("p4bench_release_tape", default=None)
MEMORY_ENV = "P4BENCH_TAPE_MEMORY_MB"


class ReplayDiverged(RuntimeError):
    """The replay's sequence of releases differs from the recorded run's: which
    releases a method makes depends on records outside the DP mechanism."""


def _memory_limit() -> int:
    try:
        return int(float(os.environ.get(MEMORY_ENV, "256")) * (1 << 20))
    except ValueError:
        return 256 << 20


# one stored tensor: its bytes in memory (None: in the file, at the offset), dtype and shape
_Stored = tuple[npt.NDArray[np.uint8] | None, int, torch.dtype, tuple[int, ...]]


class ReleaseStore:
    """The recorded releases, in order: `(kind, [tensors])` each, on the CPU; in memory
    up to `P4BENCH_TAPE_MEMORY_MB`, in a temporary file (deleted with the store) beyond.
    Values in memory are kept as numpy byte arrays: many small torch tensors held for a
    whole run fragment the allocator's heap (the resident set grew by many times the
    values' size)."""

    def __init__(self, values: Sequence[tuple[str, list[torch.Tensor]]] = ()) -> None:
        self._entries: list[tuple[str, list[_Stored]]] = []
        self._in_memory = 0
        self._limit = _memory_limit()
        self._file: IO[bytes] | None = None
        self.spilled_bytes = 0
        for kind, tensors in values:
            self.append(kind, tensors)

    def append(self, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        kept: list[_Stored] = []
        for tensor in tensors:
            value = tensor.detach().to("cpu").contiguous()
            raw: npt.NDArray[np.uint8] = (
                value.reshape(-1).view(torch.uint8).numpy()
                if value.numel()
                else np.zeros(0, np.uint8)
            )
            if self._in_memory + raw.nbytes <= self._limit:
                self._in_memory += raw.nbytes
                kept.append((raw.copy(), 0, value.dtype, tuple(value.shape)))
                continue
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="p4bench-tape-")
            offset = self._file.seek(0, os.SEEK_END)
            self._file.write(raw.tobytes())
            self.spilled_bytes += raw.nbytes
            kept.append((None, offset, value.dtype, tuple(value.shape)))
        self._entries.append((kind, kept))

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> tuple[str, list[torch.Tensor]]:
        kind, kept = self._entries[index]
        return kind, [self._load(*item) for item in kept]

    def shapes(self, index: int) -> tuple[str, list[tuple[int, ...]]]:
        kind, kept = self._entries[index]
        return kind, [shape for *_, shape in kept]

    def _load(
        self,
        raw: npt.NDArray[np.uint8] | None,
        offset: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        if raw is None:
            assert self._file is not None
            self._file.seek(offset)
            raw = np.frombuffer(bytearray(self._file.read(size)), dtype=np.uint8)
        flat = torch.from_numpy(raw) if size else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:
        self.close()


class ReleaseTape:
    """The values of one run's releases, in the order they were made.

    A tape without `recorded` records; one with `recorded` (another tape's `values`)
    replays: each release must match the recorded one in kind and shapes, and takes its
    value. With `clean` (another tape's `clean_values`) the replay also compares the
    kept clipped sums of the isolation check with the recorded ones.
    """

    def __init__(
        self,
        recorded: ReleaseStore | Sequence[tuple[str, list[torch.Tensor]]] | None = None,
        clean: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] | None = None,
    ) -> None:
        self.replaying = recorded is not None
        self.values = (
            recorded if isinstance(recorded, ReleaseStore) else ReleaseStore(recorded or ())
        )
        self.position = 0
        # the kept clipped sums' row fingerprints and norms: recorded, or (given `clean`) compared on the replay
        self.clean_values: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = list(
            clean or []
        )
        self.comparing = clean is not None
        self.clean_position = 0
        self.clean_differences: list[str] = []
        self.unforceable: list[str] = []  # kinds of release that a replay could not force
        self.delegated = 0  # releases whose noise a trusted server adds (central DP)
        self.before_values: list[
            npt.NDArray[np.int64]
        ] = []  # fused releases' states before: row fingerprints
        self.before_position = 0
        self.before_differences: list[str] = []
        self.kept_checked: list[
            bool
        ] = []  # per recorded release: whether a kept clipped sum came before it
        self._kept_since_release = False
        self.where = (
            ""  # the round being run (set by whoever observes the run's network), for findings
        )
        # shown every release's value once it is final (the network mixing check)
        self.observers: list[Callable[[str, Sequence[torch.Tensor]], None]] = []

    def release(self, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        """One release of `kind`: record copies of `tensors`, or overwrite them in place
        with the recorded values."""
        if not self.replaying:
            self.values.append(kind, tensors)
            self.kept_checked.append(self._kept_since_release)
            self._kept_since_release = False
        else:
            self._force(kind, tensors)
        for observer in self.observers:
            observer(kind, tensors)

    def _force(self, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        index = self.position
        if index >= len(self.values):
            raise ReplayDiverged(
                f"release {index + 1} ({kind}) was made on the replay only: the recorded run made "
                f"{len(self.values)}"
            )
        recorded_kind, expected = self.values.shapes(index)
        shapes = [tuple(t.shape) for t in tensors]
        if recorded_kind != kind or shapes != expected:
            raise ReplayDiverged(
                f"release {index + 1} is {kind} of shapes {shapes} on the replay, {recorded_kind} of "
                f"shapes {expected} in the recorded run"
            )
        for target, value in zip(tensors, self.values[index][1]):
            target.copy_(value.to(target.device))
        self.position += 1

    def clean(self, tensors: Sequence[torch.Tensor]) -> None:
        """One clipped sum without the changed records' own terms (`p4bench.privacy.isolation`):
        recorded, or compared with the recorded one; a batch row that differs is noted."""
        if not tensors:
            return
        self._kept_since_release = True
        prints = np.concatenate([row_fingerprints(t) for t in tensors], axis=1)
        norms = np.sqrt(np.sum([row_norms(t) ** 2 for t in tensors], axis=0))
        if not self.replaying:
            self.clean_values.append((prints, norms))
            return
        if not self.comparing:
            return
        index = self.clean_position
        self.clean_position += 1
        if index >= len(self.clean_values):
            self.clean_differences.append(
                f"clipped sum {index + 1} ({self.where}) was computed on the replay only"
            )
            return
        recorded, recorded_norms = self.clean_values[index]
        if recorded.shape != prints.shape:
            self.clean_differences.append(
                f"clipped sum {index + 1} ({self.where}) has {tuple(prints.shape)} row "
                f"fingerprints on the replay, {tuple(recorded.shape)} recorded"
            )
            return
        for row in np.flatnonzero((recorded != prints).any(axis=1)).tolist():
            self.clean_differences.append(
                f"clipped sum {index + 1} ({self.where}), batch row {row}: the kept records' clipped sum before noise "
                f"differs (norm {float(recorded_norms[row]):.6g} recorded, {float(norms[row]):.6g} on the replay)"
            )

    def before(self, tensors: Sequence[torch.Tensor]) -> None:
        """The state a fused release updates, before its kernel (`Releases.state_before`):
        recorded as row fingerprints, or compared on a replay."""
        prints = (
            np.concatenate([row_fingerprints(t) for t in tensors], axis=1)
            if tensors
            else np.zeros((0, 2), np.int64)
        )
        if not self.replaying:
            self.before_values.append(prints)
            return
        index = self.before_position
        self.before_position += 1
        if index >= len(self.before_values):
            return  # a release made on the replay only: `release` names it
        recorded = self.before_values[index]
        if recorded.shape != prints.shape or bool((recorded != prints).any()):
            rows = (
                []
                if recorded.shape != prints.shape
                else np.flatnonzero((recorded != prints).any(axis=1)).tolist()
            )
            self.before_differences.append(
                f"fused release {index + 1} ({self.where}): the state it updates differs before the release"
                + (f" in batch row {rows[0]}" if rows else "")
                + ": it was computed from records outside the mechanism"
            )

    def note_unforceable(self, kind: str) -> None:
        """A release whose value the tape cannot see (a fused kernel's draws)."""
        if kind not in self.unforceable:
            self.unforceable.append(kind)

    @property
    def finished(self) -> bool:
        """A replay has forced every recorded release."""
        return not self.replaying or self.position == len(self.values)


def current_tape() -> ReleaseTape | None:
    """The tape open in this context, or None (every ordinary run)."""
    return _TAPE.get()


@contextmanager
def using_tape(tape: ReleaseTape) -> Iterator[ReleaseTape]:
    """Open `tape` for the releases made inside the block."""
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)
