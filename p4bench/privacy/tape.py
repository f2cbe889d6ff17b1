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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["ReleaseTape", "ReplayDiverged", "current_tape", "using_tape"]

_TAPE: ContextVar[ReleaseTape | None] = ContextVar("p4bench_release_tape", default=None)


class ReplayDiverged(RuntimeError):
    """The replay's sequence of releases differs from the recorded run's: which
    releases a method makes depends on records outside the DP mechanism."""


class ReleaseTape:
    """The values of one run's releases, in the order they were made.

    A tape without `recorded` records; one with `recorded` (another tape's `values`)
    replays: each release must match the recorded one in kind and shapes, and takes its
    value.
    """

    def __init__(self, recorded: list[tuple[str, list[torch.Tensor]]] | None = None,
                 clean: list[list[torch.Tensor]] | None = None) -> None:
        self.replaying = recorded is not None
        self.values: list[tuple[str, list[torch.Tensor]]] = list(recorded or [])
        self.position = 0
        # the releases' values before noise: recorded, or (given `clean`) compared on the replay
        self.clean_values: list[list[torch.Tensor]] = list(clean or [])
        self.comparing = clean is not None
        self.clean_position = 0
        self.clean_differences: list[str] = []
        self.unforceable: list[str] = []  # kinds of release that a replay could not force
        self.delegated = 0  # releases whose noise a trusted server adds (central DP)

    def release(self, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        """One release of `kind`: record clones of `tensors`, or overwrite them in place
        with the recorded values."""
        if not self.replaying:
            self.values.append((kind, [t.detach().clone() for t in tensors]))
            return
        index = self.position
        if index >= len(self.values):
            raise ReplayDiverged(f"release {index + 1} ({kind}) was made on the replay only: the recorded run made "
                                 f"{len(self.values)}")
        recorded_kind, recorded = self.values[index]
        shapes = [tuple(t.shape) for t in tensors]
        expected = [tuple(t.shape) for t in recorded]
        if recorded_kind != kind or shapes != expected:
            raise ReplayDiverged(f"release {index + 1} is {kind} of shapes {shapes} on the replay, {recorded_kind} of "
                                 f"shapes {expected} in the recorded run")
        for target, value in zip(tensors, recorded):
            target.copy_(value.to(target.device))
        self.position += 1

    def clean(self, kind: str, tensors: Sequence[torch.Tensor], rows: torch.Tensor | None, phase: str) -> None:
        """A release's value before noise: recorded, or compared with the recorded one
        (the isolation replay, `p4bench.privacy.isolation`): a row that differs is noted
        with its client id (`rows`; None: the server's pooled sum)."""
        if not self.replaying:
            self.clean_values.append([t.detach().clone() for t in tensors])
            return
        if not self.comparing:
            return
        index = self.clean_position
        self.clean_position += 1
        if index >= len(self.clean_values):
            return  # a release made on the replay only: ReplayDiverged names it
        gaps = [(t.detach().double() - r.to(t.device).double()).abs().nan_to_num(float("inf")).reshape(len(t), -1)
                for t, r in zip(tensors, self.clean_values[index]) if t.shape == r.shape and len(t)]
        if not gaps:
            return
        per_row = torch.cat(gaps, dim=1).amax(dim=1) if gaps[0].shape[1] else torch.zeros(len(gaps[0]))
        for row in torch.nonzero(per_row > 0).flatten().tolist():
            who = "the server's pooled sum" if rows is None else f"client {int(rows[row])}"
            self.clean_differences.append(f"release {index + 1} (phase '{phase}', {kind}), {who}: the clipped sum "
                                          f"before noise differs by up to {float(per_row[row]):.3g}")

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
