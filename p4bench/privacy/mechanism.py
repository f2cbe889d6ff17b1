"""The DP-SGD mechanism every method uses: Poisson sampling, per-example gradients,
flat L2 clipping to C across all parameters, Gaussian noise, division by the expected
batch size, and a report of every noisy release to the privacy ledger.

Per-example gradients are batched across clients and examples. For the linear model
the clipped sum is computed from per-example logit gradients without materialising
per-example weight gradients (||g_i x_i^T||^2 = ||g_i||^2 ||x_i||^2), so a DP step costs
two GEMMs; other models use nested vmap.

The neighbouring relation is explicit: `add-remove` adds noise with std sigma*C,
`replace-one` (the P4 paper's eq. 13) std 2*sigma*C.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.func import grad, vmap

from p4bench.data.federated import squared_norms
from p4bench.engine.training import PerExampleLoss, cross_entropy, gather_batch, poisson_batches
from p4bench.models import LinearSoftmax, Model, Params
from p4bench.privacy.noise import NoiseStreams

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


@dataclass(frozen=True)
class Release:
    """One noisy release by some clients: `steps` DP steps at Poisson rate `sample_rate`."""

    clients: tuple[int, ...]
    sample_rate: float
    noise_multiplier: float
    steps: int = 1
    phase: str = ""


def clipped_gradient_sum(
    model: Model, params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, clip: float,
    loss: PerExampleLoss = cross_entropy, aux: torch.Tensor | None = None, sq_norms: torch.Tensor | None = None,
) -> tuple[Params, torch.Tensor]:
    """Sum over each client's batch of per-example gradients clipped to L2 norm `clip`
    (one norm across all parameters). Returns (sums (C, ...), per-example losses (C, b)).

    `sq_norms` (C, b), the squared norms of the flattened inputs, saves the linear
    path a pass over the batch when the caller has them precomputed.
    """
    if type(model) is LinearSoftmax:
        return _linear_clipped_sum(params, x, y, mask, clip, loss, aux, sq_norms)
    return _generic_clipped_sum(model, params, x, y, mask, clip, loss, aux)


def logit_gradients(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, loss: PerExampleLoss, aux: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example dloss/dlogits (C, b, L), per-example losses (C, b)) for a per-example loss."""
    logits = logits.detach().requires_grad_(True)
    count, width, classes = logits.shape
    flat_aux = None if aux is None else aux.reshape(count * width, *aux.shape[2:])
    losses = loss(logits.reshape(count * width, classes), y.reshape(-1), flat_aux).reshape(count, width)
    (grads,) = torch.autograd.grad((losses * mask).sum(), logits)
    return grads, losses.detach()


def clip_scale(logit_grads: torch.Tensor, sq_norms: torch.Tensor, mask: torch.Tensor, clip: float) -> torch.Tensor:
    """(C, b) factors min(1, C / ||g_i||) for a linear layer, where ||g_i||^2 = ||dlogits_i||^2 (||x_i||^2 + 1)."""
    norms = torch.sqrt(logit_grads.pow(2).sum(-1) * (sq_norms + 1.0))
    return (clip / norms.clamp_min(1e-12)).clamp(max=1.0) * mask


def _linear_clipped_sum(params, x, y, mask, clip, loss, aux, sq_norms=None):
    features = x.flatten(start_dim=2)  # (C, b, d)
    weight, bias = params["weight"], params["bias"]  # (C, L, d), (C, L)
    logits = torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))
    logit_grads, losses = logit_gradients(logits, y, mask, loss, aux)
    with torch.no_grad():
        scale = clip_scale(logit_grads, squared_norms(x) if sq_norms is None else sq_norms, mask, clip)
        scaled = logit_grads * scale.unsqueeze(-1)
        sums = {"weight": torch.bmm(scaled.transpose(1, 2), features), "bias": scaled.sum(dim=1)}
    return sums, losses


def _generic_clipped_sum(model, params, x, y, mask, clip, loss, aux):
    def one_example(p, xi, yi, ai):
        return loss(model.forward(p, xi.unsqueeze(0)), yi.unsqueeze(0), None if ai is None else ai.unsqueeze(0))[0]

    if aux is None:
        per_example = vmap(vmap(lambda p, xi, yi: grad(one_example)(p, xi, yi, None), in_dims=(None, 0, 0)))(params, x, y)
    else:
        per_example = vmap(vmap(grad(one_example), in_dims=(None, 0, 0, 0)))(params, x, y, aux)
    with torch.no_grad():
        norms = torch.sqrt(sum(g.flatten(start_dim=2).pow(2).sum(-1) for g in per_example.values()))
        scale = (clip / norms.clamp_min(1e-12)).clamp(max=1.0) * mask
        sums = {k: torch.einsum("cb,cb...->c...", scale, g) for k, g in per_example.items()}
        logits = vmap(model.forward)(params, x)
        count, width = y.shape
        flat_aux = None if aux is None else aux.reshape(count * width, *aux.shape[2:])
        losses = loss(logits.reshape(count * width, -1), y.reshape(-1), flat_aux).reshape(count, width)
    return sums, losses


class DPMechanism:
    """DP-SGD for the clients of one runtime group, reporting each release.

    `report(release)` sends releases to the ledger (through the `privacy_release` hook);
    `allowed(client_ids, sample_rate, phase)` says which clients can afford one more step under
    their budget. Methods call `sgd` (or `gradient`) and never compute epsilon.
    """

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

    def take(self, positions: torch.Tensor) -> "DPMechanism":
        return DPMechanism(self.settings, self.noise.take(positions), self.report, self.allowed)

    def gradient(
        self, model: Model, params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
        expected_batch: torch.Tensor, loss: PerExampleLoss = cross_entropy, aux: torch.Tensor | None = None,
        sq_norms: torch.Tensor | None = None,
    ) -> tuple[Params, torch.Tensor]:
        """Noisy mean gradient (C, ...) and mean loss (C,): (clipped sum + N(0, std^2)) / expected batch."""
        sums, losses = clipped_gradient_sum(model, params, x, y, mask, self.settings.clip, loss, aux, sq_norms)
        mean_loss = (losses * mask).sum(1) / mask.sum(1).clamp_min(1)
        return self.add_noise(sums, expected_batch), mean_loss

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
                targets[key].addcmul_(chunk, scale.to(chunk.dtype).view(-1, *([1] * (chunk.dim() - 1))), value=self.settings.noise_std)

    def admit(self, ctx, sample_rate: float) -> torch.Tensor:
        """(C,) bool: which rows of `ctx` can afford one more release under their budget."""
        return self.allowed(ctx.rows, sample_rate, ctx.phase)

    def record(self, ctx, released: torch.Tensor, sample_rate: float) -> None:
        """Report one release by the `released` rows of `ctx` to the ledger."""
        if bool(released.any()):
            self.report(Release(tuple(ctx.rows[released].tolist()), sample_rate, self.settings.noise_multiplier, 1, ctx.phase))

    def reserve(self, ctx, sample_rate: float, steps: int) -> torch.Tensor:
        """(steps, C) bool: admit and record `steps` consecutive releases of the rows of
        `ctx` at once, the same decisions and ledger entries as `steps` rounds of
        `admit`/`record` (the ledger decides on no data). For a method that computes
        all its steps together; it must then release exactly what this admitted."""
        admitted = []
        for _ in range(steps):
            admitted.append(self.admit(ctx, sample_rate))
            self.record(ctx, admitted[-1], sample_rate)
        return torch.stack(admitted) if admitted else torch.zeros(0, len(ctx.rows), dtype=torch.bool)

    def draw_noise(self, parts: list[torch.Tensor]) -> None:
        """Standard normals into `parts`, row i from its own stream (`NoiseStreams.fill`):
        K releases' draws at once as [bias_0, weight_0, ..., bias_K-1, weight_K-1] are
        the draws of K calls to `add_scaled_noise`. The caller scales by `noise_std`."""
        self.noise.fill(parts)

    def release(self, ctx, sums: Params, sample_rate: float, expected_batch: torch.Tensor) -> tuple[Params, torch.Tensor]:
        """Privatise clipped gradient sums of the rows of `ctx`: budget check, noise,
        report to the ledger. Returns (noisy mean gradients, released (C,) bool); rows
        that cannot afford the step get zero gradients and are not reported. Works in
        place: the returned gradients are the tensors of `sums`."""
        released = self.admit(ctx, sample_rate)
        noisy = self.add_noise(sums, expected_batch)
        if not bool(released.all()):
            keep = released.to(torch.float32)
            noisy = {k: g.mul_(keep.reshape(-1, *([1] * (g.dim() - 1)))) for k, g in noisy.items()}
        self.record(ctx, released, sample_rate)
        return noisy, released

    def step(
        self, ctx, params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, sample_rate: float,
        expected_batch: torch.Tensor, loss: PerExampleLoss = cross_entropy, aux: torch.Tensor | None = None,
        sq_norms: torch.Tensor | None = None,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        """One noisy release for the rows of `ctx`: (noisy gradient, mean loss, released).

        Rows whose budget cannot afford the step get a zero gradient and are not
        released (`released` is False for them); the others are reported to the ledger.
        """
        sums, losses = clipped_gradient_sum(ctx.model, params, x, y, mask, self.settings.clip, loss, aux, sq_norms)
        grads, released = self.release(ctx, sums, sample_rate, expected_batch)
        return grads, (losses * mask).sum(1) / mask.sum(1).clamp_min(1), released

    def sgd(
        self, ctx, params: Params, train, steps: int, lr: float, sample_rate: float | None = None,
    ) -> tuple[Params, torch.Tensor]:
        """`steps` DP-SGD steps with Poisson sampling; a client whose budget cannot afford
        a step stops there. Returns the parameters and each client's mean loss."""
        rate = ctx.config.data_rate if sample_rate is None else sample_rate
        expected = rate * train.n.double()
        total = torch.zeros(len(ctx.rows), dtype=torch.float64)
        taken = torch.zeros(len(ctx.rows), dtype=torch.float64)
        norms = train.squared_norms() if type(ctx.model) is LinearSoftmax else None  # cached per dataset
        for _ in range(steps):
            index, mask = poisson_batches(ctx.rng, train.n, rate)
            grads, step_loss, released = self.step(
                ctx, params, gather_batch(train.x, index), gather_batch(train.y, index), mask.float(), rate, expected,
                sq_norms=None if norms is None else gather_batch(norms, index),
            )
            if not bool(released.any()):
                break
            params = {k: params[k] - lr * grads[k] for k in params}
            total += step_loss.double() * released
            taken += released
        return params, total / taken.clamp_min(1)
