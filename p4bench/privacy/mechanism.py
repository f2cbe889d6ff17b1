"""The DP-SGD mechanism every method uses: Poisson sampling, per-example gradients,
flat L2 clipping to C across all parameters (`p4bench.privacy.clipping`), Gaussian
noise, division by the expected batch size, and a report of every noisy release to the
privacy ledger.

Every noisy release goes through one entry point, the `Releases` transaction
(`p4bench.privacy.releases`): it checks the budget and records the release, then lets
the caller draw the noise of what it recorded, nothing more. `release`/`step`/`sgd`
here use it, and so do the fast paths that apply noise inside their own kernels.

The neighbouring relation is explicit: `add-remove` adds noise with std sigma*C,
`replace-one` (the P4 paper's eq. 13) std 2*sigma*C.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p4bench.engine.training import PerExampleLoss, cross_entropy, gather_batch, poisson_batches
from p4bench.models import LinearSoftmax, Model, Params
from p4bench.models.stacked import dataset_input_grams, supports_stacked
from p4bench.privacy.clipping import clip_scale, clipped_gradient_sum, logit_gradients
from p4bench.privacy.noise import NoiseStreams
from p4bench.privacy.releases import ReleaseContext, Releases
from p4bench.records import Release  # re-exported: it was defined here

__all__ = [
    "DPMechanism",
    "DPSettings",
    "NEIGHBOURING",
    "NOISE_SOURCES",
    "NoiseStreams",
    "Release",
    "Releases",
    "clip_scale",
    "clipped_gradient_sum",
    "logit_gradients",
]

NEIGHBOURING = ("add-remove", "replace-one")
NOISE_SOURCES = ("seeded", "secure")


@dataclass(frozen=True)
class DPSettings:
    """Clip norm C, noise multiplier sigma and the neighbouring relation of a run."""

    clip: float
    noise_multiplier: float
    neighbouring: str = "add-remove"

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise added to the sum of clipped gradients."""
        factor = 2.0 if self.neighbouring == "replace-one" else 1.0
        return factor * self.noise_multiplier * self.clip


def input_statistics(model: Model, train: Any) -> torch.Tensor | None:
    """What a model's clipping reads of each training sample alone, computed once per
    dataset (C, n, ...), for `clipped_gradient_sum`'s `sq_norms`: squared norms for a
    linear model, first-layer input Grams for a stacked one, else None."""
    if type(model) is LinearSoftmax:
        return train.squared_norms()  # type: ignore[no-any-return]
    if supports_stacked(model):
        return dataset_input_grams(model, train)  # type: ignore[arg-type]
    return None


@dataclass(frozen=True)
class _HostRows:
    """A release context's rows (client ids) read back to the host, and its phase."""

    rows: torch.Tensor
    phase: str


class DPMechanism:
    """DP-SGD for the clients of one runtime group, reporting each release.

    `report(release)` sends releases to the ledger (through the `privacy_release` hook);
    `allowed(client_ids, sample_rate, phase)` says which clients can afford one more step under
    their budget. Methods call `sgd`, `step` or `release`, or open a `Releases`
    transaction on it for a fused step, and never compute epsilon.

    The noise and ledger methods below (`admit`, `record`, `reserve`, `add_noise`,
    `add_scaled_noise`, `draw_noise`) are the transaction's building blocks: a subclass
    may override them, methods do not call them.
    """

    decided_on_host: torch.Tensor | None = (
        None  # (steps, C) bool: the last `reserve`'s decisions, on the host
    )
    released_on_host: torch.Tensor  # (C,) bool: which rows the last `release` released, on the host

    def __init__(
        self,
        settings: DPSettings,
        noise: NoiseStreams,
        report: Callable[[Release], None],
        allowed: Callable[[torch.Tensor, float, str], torch.Tensor],
    ) -> None:
        self.settings = settings
        self.noise = noise
        self.report = report
        self.allowed = allowed

    def take(self, positions: torch.Tensor) -> DPMechanism:
        return DPMechanism(self.settings, self.noise.take(positions), self.report, self.allowed)

    def gradient(
        self,
        model: Model,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        expected_batch: torch.Tensor,
        loss: PerExampleLoss = cross_entropy,
        aux: torch.Tensor | None = None,
        sq_norms: torch.Tensor | None = None,
    ) -> tuple[Params, torch.Tensor]:
        """Noisy mean gradient (C, ...) and mean loss (C,): (clipped sum + N(0, std^2)) / expected
        batch, with no ledger (it knows no clients or rate): for tests of the noise itself."""
        sums, losses = clipped_gradient_sum(
            model, params, x, y, mask, self.settings.clip, loss, aux, sq_norms
        )
        mean_loss = (losses * mask).sum(1) / mask.sum(1).clamp_min(1)
        return self.add_noise(sums, expected_batch), mean_loss

    # -- building blocks of `Releases` ----------------------------------------------------
    def add_noise(self, sums: Params, expected_batch: torch.Tensor) -> Params:
        """(clipped sums + N(0, std^2) per coordinate, each row its own stream) / expected batch.

        Works in place on `sums` (the caller's fresh clipped sums): two passes over the
        gradient, no full-size temporaries.
        """
        self.add_scaled_noise(sums, None)
        inverse = 1.0 / expected_batch.to(torch.float32).clamp_min(1.0)
        return {k: v.mul_(inverse.view(-1, *([1] * (v.dim() - 1)))) for k, v in sums.items()}

    def add_scaled_noise(self, targets: Params, scale: torch.Tensor | None) -> None:
        """targets[k][i] += scale[i] * std * N(0, I), in place, row i from its own stream
        (scale None: 1). The draw per row is the same whatever the scale, so a method
        may apply its noisy step W -= lr (S + std N) / E as W -= lr S / E, then this with
        scale = -lr / E: the same release, without materialising the noisy gradient."""
        keys = sorted(targets)
        noise = self.noise.normal_parts([tuple(targets[k].shape[1:]) for k in keys])
        for key, chunk in zip(keys, noise):
            if scale is None:
                targets[key].add_(chunk, alpha=self.settings.noise_std)
            else:
                targets[key].addcmul_(
                    chunk,
                    scale.to(chunk.dtype).view(-1, *([1] * (chunk.dim() - 1))),
                    value=self.settings.noise_std,
                )

    def privatise_sums(
        self,
        ctx: ReleaseContext,
        sums: Params,
        scale: torch.Tensor | None,
        sample_rate: float,
        released: torch.Tensor,
    ) -> None:
        """One release of `sums`, the clipped values of the rows of `ctx` and nothing else
        (`Releases.privatise`): sums[k][i] += scale[i] std N, in place (`add_scaled_noise`).
        `released` (C,) bool: the rows the ledger admitted, recorded at `sample_rate`. The
        sums hold the release alone, so a wrapper may add to them what one more record's
        clipped values would add (the audit's canaries, `p4bench.audit.canaries`)."""
        self.add_scaled_noise(sums, scale)

    def admit(self, ctx: ReleaseContext, sample_rate: float) -> torch.Tensor:
        """(C,) bool: which rows of `ctx` can afford one more release under their budget."""
        return self.allowed(ctx.rows, sample_rate, ctx.phase)

    def record(self, ctx: ReleaseContext, released: torch.Tensor, sample_rate: float) -> None:
        """Report one release by the `released` rows of `ctx` to the ledger."""
        if bool(released.any()):
            self.report(
                Release(
                    tuple(ctx.rows[released].tolist()),
                    sample_rate,
                    self.settings.noise_multiplier,
                    1,
                    ctx.phase,
                )
            )

    def reserve(self, ctx: ReleaseContext, sample_rate: float, steps: int) -> torch.Tensor:
        """(steps, C) bool: admit and record `steps` consecutive releases of the rows of
        `ctx` at once, the same decisions and ledger entries as `steps` rounds of
        `admit`/`record` (the ledger decides on no data)."""
        # The ledger lives on the host: the rows are read back once for the whole
        # transaction (on a GPU every read is a synchronisation), the decisions go back once.
        device = ctx.rows.device
        on_host = _HostRows(ctx.rows.cpu(), ctx.phase)
        admitted = []
        for _ in range(steps):
            admitted.append(self.admit(on_host, sample_rate).cpu())
            self.record(on_host, admitted[-1], sample_rate)
        decided = (
            torch.stack(admitted)
            if admitted
            else torch.zeros(0, len(on_host.rows), dtype=torch.bool)
        )
        self.decided_on_host = (
            decided  # the last transaction's decisions, for checks without a read back
        )
        return decided.to(device)

    def draw_noise(self, parts: list[torch.Tensor]) -> None:
        """Standard normals into `parts`, row i from its own stream (`NoiseStreams.fill`):
        K releases' draws at once as [bias_0, weight_0, ..., bias_K-1, weight_K-1] are
        the draws of K calls to `add_scaled_noise`. The caller scales by `noise_std`."""
        self.noise.fill(parts)

    # -- the generic path -------------------------------------------------------------------
    def release(
        self, ctx: ReleaseContext, sums: Params, sample_rate: float, expected_batch: torch.Tensor
    ) -> tuple[Params, torch.Tensor]:
        """Privatise clipped gradient sums of the rows of `ctx`: one `Releases` transaction
        (budget check, ledger, noise). Returns (noisy mean gradients, released (C,) bool);
        rows that cannot afford the step get zero gradients and are not reported. Works in
        place: the returned gradients are the tensors of `sums`."""
        self.decided_on_host = None  # set by `reserve`; a subclass's own `reserve` may not
        with Releases(self, ctx, sample_rate) as releases:
            released = releases.admitted[0]
            noisy = releases.add_noise(sums, expected_batch)
        decided = self.decided_on_host
        # the host's copy of the decisions where `reserve` kept one: no read back from the device
        self.released_on_host = decided[0] if decided is not None else released.cpu()
        if not bool(self.released_on_host.all()):
            keep = released.to(torch.float32)
            noisy = {k: g.mul_(keep.reshape(-1, *([1] * (g.dim() - 1)))) for k, g in noisy.items()}
        return noisy, released

    def step(
        self,
        ctx: Any,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        sample_rate: float,
        expected_batch: torch.Tensor,
        loss: PerExampleLoss = cross_entropy,
        aux: torch.Tensor | None = None,
        sq_norms: torch.Tensor | None = None,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        """One noisy release for the rows of `ctx` (a step context: `.model`, `.rows`, `.phase`):
        (noisy gradient, mean loss, released).

        Rows whose budget cannot afford the step get a zero gradient and are not
        released (`released` is False for them); the others are reported to the ledger.
        """
        sums, losses = clipped_gradient_sum(
            ctx.model, params, x, y, mask, self.settings.clip, loss, aux, sq_norms
        )
        grads, released = self.release(ctx, sums, sample_rate, expected_batch)
        return grads, (losses * mask).sum(1) / mask.sum(1).clamp_min(1), released

    def sgd(
        self,
        ctx: Any,
        params: Params,
        train: Any,
        steps: int,
        lr: float,
        sample_rate: float | None = None,
    ) -> tuple[Params, torch.Tensor]:
        """`steps` DP-SGD steps with Poisson sampling; a client whose budget cannot afford
        a step stops there. Returns the parameters and each client's mean loss."""
        rate = ctx.config.data_rate if sample_rate is None else sample_rate
        expected = rate * train.n.double()
        total = torch.zeros(len(ctx.rows), dtype=torch.float64)
        taken = torch.zeros(len(ctx.rows), dtype=torch.float64)
        norms = input_statistics(ctx.model, train)  # cached per dataset
        for _ in range(steps):
            index, mask = poisson_batches(ctx.rng, train.n, rate, train.max_count())
            grads, step_loss, released = self.step(
                ctx,
                params,
                gather_batch(train.x, index),
                gather_batch(train.y, index),
                mask.float(),
                rate,
                expected,
                sq_norms=None if norms is None else gather_batch(norms, index),
            )
            if not bool(
                self.released_on_host.any()
            ):  # the ledger refused every row (host copy: no read back)
                break
            params = {k: params[k] - lr * grads[k] for k in params}
            total += step_loss.double() * released
            taken += released
        return params, total / taken.clamp_min(1)
