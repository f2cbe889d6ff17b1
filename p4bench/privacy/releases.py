"""The one entry point to DP noise: a transaction of noisy releases.

Every noisy step goes through `Releases`: the generic path (`DPMechanism.release`, so
`step`, `sgd`, `batch_gradient`, `local_sgd`), P4's fused paths and the central-noise
path of the centralized baseline. Entering it

    with Releases(mechanism, ctx, sample_rate, steps) as releases:
        ...  # releases.admitted (K, C): which rows each step may release

asks the ledger which rows of `ctx` can afford each of the `steps` releases and
records them (`DPMechanism.reserve`: the same decisions and ledger entries as one
admit/record round per step; the ledger decides on no data, so deciding up front
changes nothing). Only then can noise be drawn, and only through the transaction, for
at most the releases it recorded; leaving it without having drawn the noise of every
recorded release is an error. So a path cannot add noise the ledger did not count,
nor count releases it forgot to privatise.

The mechanism's noise methods (`add_noise`, `add_scaled_noise`, `draw_noise`) are what
the transaction calls: a subclass may override them (the audit's faulty mechanism
does), methods never call them. `current_releases()` is the innermost open
transaction, for checks that noise is drawn inside one (tests/test_dp_entry_point.py).
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Protocol

import torch

from p4bench.models import Params
from p4bench.privacy.clipping import clip_scale
from p4bench.privacy.tape import current_tape

__all__ = ["ReleaseContext", "Releases", "add_central_noise", "current_releases"]

_OPEN: ContextVar[tuple[Releases, ...]] = ContextVar("p4bench_open_releases", default=())


class ReleaseContext(Protocol):
    """What a release needs of a step context: the client ids of its rows and the phase."""

    @property
    def rows(self) -> torch.Tensor: ...

    @property
    def phase(self) -> str: ...


def current_releases() -> Releases | None:
    """The innermost open transaction in this context, or None."""
    stack = _OPEN.get()
    return stack[-1] if stack else None


class Releases:
    """`steps` consecutive noisy releases by the rows of `ctx` (`.rows`, `.phase`) at
    Poisson rate `sample_rate`, through `mechanism` (a `DPMechanism` or a wrapper of
    one, whose noise methods are then the ones called). See the module docstring."""

    def __init__(
        self, mechanism: Any, ctx: ReleaseContext, sample_rate: float, steps: int = 1
    ) -> None:
        self.mechanism = mechanism
        self.ctx = ctx
        self.sample_rate = sample_rate
        self.steps = steps
        self.drawn = 0  # releases whose noise has been drawn (or delegated)
        self._admitted: torch.Tensor | None = None
        self._bracketed = (
            False  # a fused path that declared the state its releases update (`state_before`)
        )
        self._token: Token[tuple[Releases, ...]] | None = None

    def __enter__(self) -> Releases:
        if self._admitted is not None:
            raise RuntimeError("a release transaction is entered once")
        self._admitted = self.mechanism.reserve(
            self.ctx, self.sample_rate, self.steps
        )  # ledger: recorded here
        self._token = _OPEN.set((*_OPEN.get(), self))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _OPEN.reset(self._token)
            self._token = None
        if kind is None and self.drawn != self.steps:
            raise RuntimeError(f"{self.steps} release(s) recorded, noise drawn for {self.drawn}")

    @property
    def admitted(self) -> torch.Tensor:
        """(steps, C) bool: which rows may release at each step (the ledger's decisions, recorded)."""
        if self._admitted is None:
            raise RuntimeError(
                "the release transaction is not entered: nothing is admitted or recorded yet"
            )
        return self._admitted

    # -- what a path needs to privatise its steps ---------------------------------------
    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise on a sum of clipped gradients (sigma C, or 2 sigma C)."""
        return float(self.mechanism.settings.noise_std)

    def clip_scale(
        self, logit_grads: torch.Tensor, sq_norms: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """(C, b) per-example clipping factors of a linear layer at the run's clip norm (`clip_scale`)."""
        return clip_scale(logit_grads, sq_norms, mask, float(self.mechanism.settings.clip))

    def mean_step(self, lr: float, expected_batch: torch.Tensor) -> torch.Tensor:
        """(steps, C) float64 step sizes lr / E on the noisy sum, E = max(expected batch, 1),
        0 for refused releases: a step W -= lr (S + std N) / E of DP-SGD's mean."""
        return lr * self.admitted.double() / expected_batch.clamp_min(1.0)

    # -- the noise: each call covers some of the recorded releases -------------------------
    def add_noise(self, sums: Params, expected_batch: torch.Tensor) -> Params:
        """One release: (sums + std N) / expected batch, in place (`DPMechanism.add_noise`)."""
        self._take(1)
        noisy: Params = self.mechanism.add_noise(sums, expected_batch)
        _to_tape("add_noise", noisy)
        return noisy

    def privatise(self, sums: Params, scale: torch.Tensor | None) -> Params:
        """One release of `sums`, which hold the release's clipped values and nothing else:
        sums[k][i] += scale[i] std N, in place (`DPMechanism.privatise_sums`, which the
        audit's canaries go through; a stand-in mechanism without it: `add_scaled_noise`).
        The post-processing check forces the result on its replay."""
        self._take(1)
        privatise_sums = getattr(self.mechanism, "privatise_sums", None)
        if privatise_sums is not None:
            privatise_sums(self.ctx, sums, scale, self.sample_rate, self.admitted[self.drawn - 1])
        else:
            self.mechanism.add_scaled_noise(sums, scale)
        _to_tape("add_noise", sums)
        return sums

    def add_scaled_noise(self, targets: Params, scale: torch.Tensor | None) -> None:
        """One release: targets[k][i] += scale[i] std N, in place (`DPMechanism.add_scaled_noise`).
        The draw does not depend on the scale, so a path may fold lr / E into it, and
        apply the step to its state in place (a fused path: the target then holds state
        besides the release, so the post-processing check cannot force it; use
        `privatise` where the target holds the release alone)."""
        self._take(1)
        self.mechanism.add_scaled_noise(targets, scale)
        tape = current_tape()
        if tape is not None and not self._bracketed:
            tape.note_unforceable(
                "add_scaled_noise (a target that may hold state besides the release)"
            )

    def draw(self, parts: list[torch.Tensor]) -> None:
        """Standard normals for all `steps` releases at once into `parts` (`DPMechanism.draw_noise`:
        parts [bias_0, weight_0, ..., bias_K-1, weight_K-1] are the draws of K `add_scaled_noise`)."""
        self._take(self.steps)
        self.mechanism.draw_noise(parts)
        tape = current_tape()
        if tape is not None and not self._bracketed:
            tape.note_unforceable("draw (a fused kernel's noise)")

    def state_before(self, targets: Params) -> None:
        """A fused path's declaration: `targets` is the state this transaction's releases
        update (a proxy's parameters), as it is before the kernel runs. With `state_after`
        it makes the fused releases forceable as a whole: a replay requires the state
        before to be identical (else something read records outside the mechanism) and
        sets the state after to its recorded value. What the kernel computes in between is
        the isolation check's (`p4bench.privacy.isolation`: the kernel reports its kept
        clipped sums with `p4bench.privacy.clipping.kept_linear_sum`)."""
        self._bracketed = True
        tape = current_tape()
        if tape is not None:
            tape.before([targets[k] for k in sorted(targets)])

    def state_after(self, targets: Params) -> None:
        """The state `state_before` declared, after the kernel: recorded, or forced in place
        on a replay (one release of kind "fused")."""
        if not self._bracketed:
            raise RuntimeError(
                "state_after without state_before: declare the state before the kernel runs"
            )
        _to_tape("fused", targets)

    def delegate(self) -> None:
        """All releases get their noise elsewhere, from a trusted party that adds it to the
        sum of the rows' contributions (central DP: the centralized baseline's server,
        which adds it with `add_central_noise`)."""
        self._take(self.steps)
        tape = current_tape()
        if tape is not None:
            tape.delegated += self.steps

    def _take(self, count: int) -> None:
        if self not in _OPEN.get():
            raise RuntimeError(
                "DP noise is drawn inside its open release transaction (`with Releases(...)`)"
            )
        if self.drawn + count > self.steps:
            raise RuntimeError(
                f"noise for {self.drawn + count} releases, only {self.steps} recorded"
            )
        self.drawn += count


def add_central_noise(total: torch.Tensor, std: float, noise: Any) -> torch.Tensor:
    """A trusted server's release of the pooled sum of delegated releases: `total` (1, P)
    plus std N(0, I) from the server's own `NoiseStreams`, as float64 (central DP)."""
    noisy: torch.Tensor = total + noise.normal(total.shape[1]).double() * std
    _to_tape("central", {"total": noisy})
    return noisy


def _to_tape(kind: str, values: Params) -> None:
    """Hand one release's value to the open release tape, if any (`p4bench.privacy.tape`)."""
    tape = current_tape()
    if tape is not None:
        tape.release(kind, [values[k] for k in sorted(values)])
