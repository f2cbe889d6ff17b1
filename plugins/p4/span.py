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

The noise, two ways (`noise` option), both exactly DP-SGD's per-step Gaussian noise:
- `streams`: the K draws N_k (L x d) themselves, from the same per-client streams in
  the same order as K separate releases, projected as [W_0; N_0; ..; N_K-2] X^T. The
  same numbers as the generic path (tested equal).
- `basis` (default): with an orthonormal basis Q of the span of X (X^T = Q R,
  Householder QR once per dataset), split N_k = (N_k Q) Q^T + N_k (I - Q Q^T). The
  coordinates Z_k = N_k Q are i.i.d. standard normal because Q is orthonormal, and the
  run sees the noise only through Z_k (logits: N_k X^T = Z_k R) and through the sum
  sum_k u_k N_k, whose part outside the span is one Gaussian with std
  s = sqrt(sum_k u_k^2). So it draws Z_k (L x m, m = min(n, d)) per step and one
  G (L x d): sum_k u_k N_k = (sum_k u_k Z_k) Q^T + s (G - (G Q) Q^T). Every quantity
  the run computes has exactly the joint distribution of the `streams` draws (tested
  on moments), with 1/K of the Gaussian draws and a GEMM of 3L rows instead of
  (K+1)L; only the realisation for a given seed differs. Nothing is inverted, so the
  data's conditioning does not matter.

Same batches from the same sampling stream, same clipping, same ledger entries as the
generic path. The ledger decides on no data, so the K releases are admitted and
recorded before the computation (`DPMechanism.reserve`) and their noise is drawn up
front (`DPMechanism.draw_noise`).
"""

from __future__ import annotations

import torch

from p4bench.engine.training import sample_batches
from p4bench.models import Params
from p4bench.plugins.p4.fused import LinearCotraining, mutual_distillation_gradients
from p4bench.privacy.mechanism import clip_scale


NOISE_MODES = ("basis", "streams")


def span_is_cheaper(samples: int, dim: int, classes: int, steps: int, data_rate: float, private: bool, noise: str = "basis") -> bool:
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


class SpanCotraining(LinearCotraining):
    """The span path: two GEMMs per round, the K steps in n-space (module docstring)."""

    def __init__(self, alpha: float, beta: float, lr: float, data_rate: float, noise: str = "basis") -> None:
        super().__init__(alpha, beta, lr, data_rate)
        self.noise = noise

    def run(self, proxy: Params, private: Params, train, ctx, steps: int) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
        dp = ctx.dp
        count, classes, dim = proxy["weight"].shape
        noise_scale = None
        if dp is not None:
            done = dp.reserve(ctx, self.data_rate, steps).float()  # (K, C)
            expected = (self.data_rate * train.n.double()).clamp_min(1.0)
            proxy_lr = (self.lr * done.double() / expected).float()  # the DP mean divides by the expected batch
            noise_scale = -proxy_lr * dp.settings.noise_std  # (K, C): u_k per row
        else:
            done = torch.ones(steps, count)
            proxy_lr = self.lr * done
        basis = noise_scale is not None and self.noise == "basis"
        # the rows the GEMMs run against: an orthonormal basis of the data's span, or the data
        data, coords = train.orthonormal_basis() if basis else (train.x.flatten(start_dim=2), None)
        noise_rows = 0 if noise_scale is None else classes if basis else steps * classes
        # [proxy W; private W; noise] per client, so one GEMM reads the data once for all of them
        stacked = self.workspace.get("span", (count, 2 * classes + noise_rows, dim))
        stacked[:, :classes].copy_(proxy["weight"])
        stacked[:, classes : 2 * classes].copy_(private["weight"])
        bias = torch.cat([proxy["bias"], private["bias"]], dim=1)
        bias_noise = coordinates = None
        if noise_scale is not None:
            bias_noise = torch.empty(count, steps, classes)
            if basis:
                coordinates = torch.empty(count, steps, classes, data.shape[1])  # Z_k = N_k Q
                parts = [part for k in range(steps) for part in (bias_noise[:, k], coordinates[:, k])]
                dp.draw_noise([*parts, stacked[:, 2 * classes :]])  # then G, for the part outside the span
            else:
                blocks = stacked[:, 2 * classes :].view(count, steps, classes, dim)
                dp.draw_noise([part for k in range(steps) for part in (bias_noise[:, k], blocks[:, k])])
        # the last step's noise is seen by no later logits: `streams` does not project it
        read = stacked if basis or noise_scale is None else stacked[:, : 2 * classes + noise_rows - classes]
        products = torch.bmm(read, data.transpose(1, 2))  # (C, rows, m or n)
        if basis:
            initial = torch.bmm(products[:, : 2 * classes], coords)  # W_0 X^T = (W_0 Q) R
            gram = torch.bmm(coords.transpose(1, 2), coords)  # X X^T = R^T R
            earlier = coordinates[:, : steps - 1].reshape(count, (steps - 1) * classes, coords.shape[1])
            seen = torch.bmm(earlier, coords)  # N_k X^T = Z_k R
        else:
            initial, gram = products[:, : 2 * classes], train.gram()
            seen = products[:, 2 * classes :] if noise_scale is not None else None
        coefficients, total, taken = self._steps(initial, gram, seen, bias, bias_noise, noise_scale, proxy_lr, done, train, ctx, steps)
        if basis:
            coefficients = torch.bmm(coefficients, coords.transpose(1, 2))  # A X = (A R^T) Q^T
            spread = noise_scale.square().sum(dim=0).sqrt().view(count, 1, 1)  # s per row
            # sum_k u_k N_k = (sum_k u_k Z_k) Q^T + s (G - (G Q) Q^T)
            inside = (coordinates * noise_scale.t().reshape(count, steps, 1, 1)).sum(dim=1)
            coefficients[:, :classes].sub_(inside).addcmul_(products[:, 2 * classes :], spread)
            stacked[:, :classes].addcmul_(stacked[:, 2 * classes :], spread)
        elif noise_scale is not None:
            for k in range(steps):
                stacked[:, :classes].addcmul_(blocks[:, k], noise_scale[k].view(count, 1, 1))
        # into a fresh contiguous tensor: faster than in place on the strided view, and the
        # result must not live in the reused buffer anyway
        weights = torch.baddbmm(stacked[:, : 2 * classes], coefficients, data, alpha=-1.0, out=torch.empty(count, 2 * classes, dim))
        return (
            {"weight": weights[:, :classes], "bias": bias[:, :classes]},
            {"weight": weights[:, classes:], "bias": bias[:, classes:]},
            total,
            taken,
        )

    def _steps(self, initial, gram, seen, bias, bias_noise, noise_scale, proxy_lr, done, train, ctx, steps):
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
            grads, losses = mutual_distillation_gradients(logits.view(count, 2, classes, width).permute(0, 3, 1, 2),
                                                          train.y, self.alpha, self.beta)
            batch = chosen.sum(dim=1, keepdim=True).clamp_min(1.0)
            scale = torch.empty(count, width, 2, 1)
            if ctx.dp is not None:
                scale[:, :, 0, 0] = clip_scale(grads[:, :, 0], norms, chosen, ctx.dp.settings.clip) * proxy_lr[k].unsqueeze(1)
            else:
                scale[:, :, 0, 0] = chosen / batch * proxy_lr[k].unsqueeze(1)
            scale[:, :, 1, 0] = chosen / batch * (self.lr * done[k]).unsqueeze(1)
            step = grads.mul_(scale).reshape(count, width, 2 * classes)
            coefficients += step.transpose(1, 2)
            bias -= step.sum(dim=1)
            if noise_scale is not None:
                if k < steps - 1:  # the last step's noise is seen by no later logits
                    noise_logits.addcmul_(seen[:, k * classes : (k + 1) * classes], noise_scale[k].view(count, 1, 1))
                bias[:, :classes].addcmul_(bias_noise[:, k], noise_scale[k].view(count, 1))
            total += (losses * chosen).sum(dim=1).double() / batch.squeeze(1).double() * done[k]
            taken += done[k]
        return coefficients, total, taken
