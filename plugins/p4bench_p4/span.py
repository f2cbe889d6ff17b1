"""P4's co-training steps for linear models, computed in the span of each client's data.

After any number of SGD steps on a client's samples X (n, d), a linear model's weights
are W_k = W_0 - A_k X + sum_{j<k} u_j N_j: one coefficient per class and sample (A_k,
(L, n)) plus the DP noise added so far (N_j, scaled by u_j = -lr std / E). Every step's
logits therefore follow from n x n numbers once the products with X are known:

    W_k X^T = W_0 X^T - A_k G + sum_{j<k} u_j N_j X^T,   G = X X^T (once per dataset).

So the K steps cost two passes over the data instead of 2K GEMMs and K batch gathers:
1. one GEMM with the data: both models' initial logits and what the later steps see of
   the noise;
2. the K steps in n-space: logits, closed-form gradients, clipping and the coefficient
   updates, for every client at once;
3. one GEMM W_K = W_0 + (noise) - A_K X.
It pays off when K s n d, the bucketed path's work, exceeds about (K + 3) n d
(`span_is_cheaper`), e.g. K = 5 and s = 0.5 on CIFAR-shaped features.

The noise (`span_noise` option: `basis` by default, or `streams`, the generic path's
exact draws) and its algebra live in `p4bench.privacy.span.SpanNoise`; this module does
the model math. Same batches from the same sampling stream, same clipping, same ledger
entries as the generic path: the K releases are one `Releases` transaction, recorded
before the computation (the ledger decides on no data), their noise drawn up front.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from p4bench.data import ClientTensors
from p4bench.engine.devices import WORKSPACE_FRACTION, free_device_memory
from p4bench.engine.training import sample_batches
from p4bench.models import Params
from p4bench.privacy.releases import Releases
from p4bench.privacy.span import NOISE_MODES, SpanNoise
from p4bench.privacy.span_factor import SpanFactor, implicit_span_applies, span_factors
from p4bench_p4.fused import LinearCotraining, mutual_distillation_gradients

if TYPE_CHECKING:
    from p4bench.engine.method import StepContext

__all__ = ["NOISE_MODES", "SpanCotraining", "span_factor", "span_fits", "span_is_cheaper"]

_FACTOR = "_span_factor"  # the per-dataset cache of `span_factor` on the training tensors
# bytes of stacked rows at once for the first GEMM: a few clients' rows, not a copy of all
# the models (which the round would hold beside the models themselves)
PRODUCT_CHUNK_BYTES = 32 << 20


def span_is_cheaper(
    samples: int,
    dim: int,
    classes: int,
    steps: int,
    data_rate: float,
    private: bool,
    noise: str = "basis",
) -> bool:
    """Whether the span path needs fewer FLOPs than the bucketed path for one round.

    Bucketed: per step, forward and weight gradient of both models on s n samples,
    8 s n d L. Span: the first GEMM over 2L rows plus the noise rows (L with `basis`,
    (K-1) L with `streams`), the last over 2L, against m = min(n, d) basis rows (`basis`)
    or the n samples, and per step the n-space products 4 L n^2. The Gram matrix or the
    QR basis is computed once per dataset and amortised over the rounds.
    """
    buckets = 8 * data_rate * samples * dim * classes * steps
    basis = private and noise == "basis"
    noise_rows = (classes if basis else (steps - 1) * classes) if private else 0
    rows = min(samples, dim) if basis else samples
    span = 2 * rows * dim * (4 * classes + noise_rows) + steps * 4 * classes * samples**2
    return span < buckets


def span_fits(train: ClientTensors, basis: bool) -> bool:
    """Whether the span path's per-dataset tables fit beside the data on an accelerator.
    With n <= d the basis is applied implicitly (`p4bench.privacy.span_factor`): its
    tables are n x n per client, small beside the samples. Otherwise a stored
    orthonormal basis is as large as the samples and its QR needs as much again.
    Checked once per dataset, before they are built; on the CPU, host memory is the
    limit, as for the data."""
    free = free_device_memory(train.x.device)
    if free is None or not basis or train.has_orthonormal_basis():
        return True
    count, samples = train.x.shape[:2]
    if implicit_span_applies(samples, math.prod(train.x.shape[2:])):
        # float64 Gram, its padded copy, the factor, the eigen-solver's workspace, and the
        # float32 tables kept; a client that falls back to a stored basis adds its own n d
        need = 6 * 8 * count * samples * samples
    else:
        need = 2 * train.x.numel() * train.x.element_size()
    return need < free[0] * (1 - WORKSPACE_FRACTION)


class SpanCotraining(LinearCotraining):
    """The span path: two GEMMs per round, the K steps in n-space (module docstring)."""

    def __init__(
        self, alpha: float, beta: float, lr: float, data_rate: float, noise: str = "basis"
    ) -> None:
        super().__init__(alpha, beta, lr, data_rate)
        self.noise = noise

    def run(
        self, proxy: Params, private: Params, train: ClientTensors, ctx: StepContext, steps: int
    ) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
        if ctx.dp is None:
            return self._round(
                proxy, private, train, ctx, steps, None, torch.ones(steps, len(ctx.rows))
            )
        with Releases(ctx.dp, ctx, self.data_rate, steps) as releases:
            releases.state_before(
                proxy
            )  # the K releases are forceable as a whole (record isolation is not checked here)
            noise = SpanNoise(
                releases,
                self.noise,
                self.lr,
                self.data_rate * train.n.double(),
                proxy["weight"].shape[1],
                steps,
            )
            result = self._round(
                proxy, private, train, ctx, steps, noise, releases.admitted.float()
            )
            releases.state_after(result[0])
            return result

    def _round(
        self,
        proxy: Params,
        private: Params,
        train: ClientTensors,
        ctx: StepContext,
        steps: int,
        noise: SpanNoise | None,
        done: torch.Tensor,
    ) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
        """The round with `noise` (None: not private); `done` (K, C): 1 where a step is taken."""
        count, classes, dim = proxy["weight"].shape
        proxy_lr = self.lr * done if noise is None else noise.step_sizes
        basis = noise is not None and noise.basis
        flat = train.x.flatten(start_dim=2)
        # the basis of the data's span: applied implicitly through R (n <= d), else stored
        factor = span_factor(train) if basis and implicit_span_applies(flat.shape[1], dim) else None
        stored = basis and factor is None
        # the rows the GEMMs run against: the data, or (d < n) a stored orthonormal basis
        data, coords = train.orthonormal_basis() if stored else (flat, None)
        if factor is not None:
            coords = factor.coords
        noise_rows = 0 if noise is None else noise.rows
        # both models' weights, [proxy W; private W] per client: the round's result is
        # computed in place here (W_K = W_0 + noise - B X), a fresh tensor each round
        weights = torch.empty(count, 2 * classes, dim)
        weights[:, :classes].copy_(proxy["weight"])
        weights[:, classes:].copy_(private["weight"])
        bias = torch.cat([proxy["bias"], private["bias"]], dim=1)
        rows = torch.empty(count, noise_rows, dim)  # the noise rows (G, or the N_k)
        if noise is not None:
            # m, the basis size (the coordinates' rows) for `basis`; unused by `streams`
            noise.draw(rows, (data if coords is None else coords).shape[1])
        projected = 0 if noise is None else noise.projected
        products = _stacked_products(weights, rows[:, :projected], data)  # (C, rows, m or n)
        projections = products[:, 2 * classes :]
        if factor is not None:
            if len(factor.bases):  # clients whose basis is stored: W Q, and W_0 X^T = (W_0 Q) R
                chosen = factor.explicit
                read = torch.cat([weights[chosen], rows[chosen, :projected]], dim=1)
                factor.explicit_products(read, products)
                products[chosen, : 2 * classes] = torch.bmm(
                    products[chosen, : 2 * classes], factor.coords[chosen]
                )
            initial, gram = products[:, : 2 * classes], factor.gram
            projections = factor.to_span(projections)  # G Q = (G X^T) R^-1
        elif stored:
            assert coords is not None  # the basis comes with its coordinates
            initial = torch.bmm(products[:, : 2 * classes], coords)  # W_0 X^T = (W_0 Q) R
            gram = torch.bmm(coords.transpose(1, 2), coords)  # X X^T = R^T R
        else:
            initial, gram = products[:, : 2 * classes], train.gram()
        seen = None if noise is None else noise.seen(products[:, 2 * classes :], coords)
        coefficients, total, taken = self._steps(
            initial, gram, seen, bias, noise, proxy_lr, done, train, ctx, steps
        )
        del products, initial, seen  # before the last GEMM's temporaries
        if factor is not None:
            assert noise is not None  # the factor serves the basis sampler only
            self._implicit_finish(factor, noise, weights, rows, coefficients, projections, flat)
            return _split(weights, bias, classes, total, taken)
        if stored:
            assert coords is not None
            coefficients = torch.bmm(coefficients, coords.transpose(1, 2))  # A X = (A R^T) Q^T
        if noise is not None:
            noise.finish(weights[:, :classes], coefficients[:, :classes], projections, rows)
        weights.baddbmm_(coefficients, data, alpha=-1.0)
        return _split(weights, bias, classes, total, taken)

    @staticmethod
    def _implicit_finish(
        factor: SpanFactor,
        noise: SpanNoise,
        weights: torch.Tensor,
        rows: torch.Tensor,
        coefficients: torch.Tensor,
        projections: torch.Tensor,
        flat: torch.Tensor,
    ) -> None:
        """W_K = W_0 + s G - B X, in place in `weights` (C, 2L, d), with the noise's
        coefficients in the basis moved to the samples' (B = A + N R^-T: N Q^T = N R^-T X),
        one GEMM with the data; clients with a stored basis: B = A R^T + N against their Q^T."""
        classes = weights.shape[1] // 2
        noise.add_outside(weights[:, :classes], rows)
        spanned = factor.from_span(noise.in_span(projections))  # identity for stored bases
        chosen = factor.explicit
        stored = weights[chosen] if len(factor.bases) else None  # a copy: their W_0 + s G
        if stored is not None:
            coefficients[chosen] = torch.bmm(
                coefficients[chosen], factor.coords[chosen].transpose(1, 2)
            )
        coefficients[:, :classes] += spanned
        weights.baddbmm_(coefficients, flat, alpha=-1.0)
        if stored is not None:
            weights[chosen] = torch.baddbmm(stored, coefficients[chosen], factor.bases, alpha=-1.0)

    def _steps(
        self,
        initial: torch.Tensor,
        gram: torch.Tensor,
        seen: torch.Tensor | None,
        bias: torch.Tensor,
        noise: SpanNoise | None,
        proxy_lr: torch.Tensor,
        done: torch.Tensor,
        train: ClientTensors,
        ctx: StepContext,
        steps: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The K steps in n-space from the initial logits W_0 X^T (C, 2L, n), the Gram
        matrices (C, n, n) and the noise's projections N_k X^T (C, (K-1) L, n). Updates
        `bias` in place; returns (A_K (C, 2L, n), summed proxy loss (C,), steps taken (C,))."""
        count, width = train.y.shape
        classes = bias.shape[1] // 2
        norms = train.squared_norms()
        coefficients = torch.zeros(count, 2 * classes, width)
        noise_logits = torch.zeros(count, classes, width)
        total, taken = torch.zeros(count, dtype=torch.float64), torch.zeros(count)
        for k in range(steps):
            index, mask = sample_batches(ctx, train)
            chosen = torch.zeros(count, width).scatter_add_(1, index, mask.float())
            logits = torch.baddbmm(initial, coefficients, gram, alpha=-1.0)
            logits[:, :classes] += noise_logits
            logits += bias.unsqueeze(2)
            grads, losses = mutual_distillation_gradients(
                logits.view(count, 2, classes, width).permute(0, 3, 1, 2),
                train.y,
                self.alpha,
                self.beta,
            )
            batch = chosen.sum(dim=1, keepdim=True).clamp_min(1.0)
            scale = torch.empty(count, width, 2, 1)
            if noise is not None:
                scale[:, :, 0, 0] = noise.releases.clip_scale(
                    grads[:, :, 0], norms, chosen
                ) * proxy_lr[k].unsqueeze(1)
            else:
                scale[:, :, 0, 0] = chosen / batch * proxy_lr[k].unsqueeze(1)
            scale[:, :, 1, 0] = chosen / batch * (self.lr * done[k]).unsqueeze(1)
            step = grads.mul_(scale).reshape(count, width, 2 * classes)
            coefficients += step.transpose(1, 2)
            bias -= step.sum(dim=1)
            if noise is not None:
                assert seen is not None  # projected with the noise
                noise.step(k, seen, noise_logits, bias[:, :classes])
            total += (losses * chosen).sum(dim=1).double() / batch.squeeze(1).double() * done[k]
            taken += done[k]
        return coefficients, total, taken


def _stacked_products(
    weights: torch.Tensor, noise: torch.Tensor, data: torch.Tensor
) -> torch.Tensor:
    """(C, 2L + r, m) products of [weights (C, 2L, d); noise rows (C, r, d)] with `data`
    (C, m, d): one GEMM per client reads its data once for all rows. The rows are stacked
    a chunk of clients at a time (`PRODUCT_CHUNK_BYTES`), not for all clients at once."""
    count, width = weights.shape[0], weights.shape[1] + noise.shape[1]
    products = torch.empty(count, width, data.shape[1])
    per_client = width * weights.shape[2] * weights.element_size()
    size = max(1, PRODUCT_CHUNK_BYTES // max(per_client, 1))
    for start in range(0, count, size):
        part = slice(start, min(start + size, count))
        stacked = torch.cat([weights[part], noise[part]], dim=1)
        torch.bmm(stacked, data[part].transpose(1, 2), out=products[part])
    return products


def _split(
    weights: torch.Tensor,
    bias: torch.Tensor,
    classes: int,
    total: torch.Tensor,
    taken: torch.Tensor,
) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
    """(proxy, private, total, taken) from both models' stacked weights and biases."""
    return (
        {"weight": weights[:, :classes], "bias": bias[:, :classes]},
        {"weight": weights[:, classes:], "bias": bias[:, classes:]},
        total,
        taken,
    )


def span_factor(train: ClientTensors) -> SpanFactor:
    """The implicit basis's tables (`p4bench.privacy.span_factor`), once per dataset and
    shared with the row subsets of later rounds, like the data's Gram matrices."""
    factor: SpanFactor = train._derived(
        _FACTOR, span_factors, lambda whole, index, width: whole.rows(index, width)
    )
    return factor
