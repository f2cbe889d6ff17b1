"""P4's co-training steps for linear models, computed in the span of each client's data.

After any number of SGD steps on a client's samples X (n, d), a linear model's weights
are W_k = W_0 - A_k X + sum_{j<k} u_j N_j: one coefficient per class and sample (A_k,
(L, n)) plus the DP noise added so far (N_j, scaled by u_j = -lr std / E). Every step's
logits therefore follow from n x n numbers once the products with X are known:

    W_k X^T = W_0 X^T - A_k G + sum_{j<k} u_j N_j X^T,   G = X X^T (once per dataset).

So the K steps cost two passes over the data instead of 2K GEMMs and K batch gathers:
1. one GEMM [W_0; N_0; ...; N_{K-2}] X^T, both models' logits and the projections of
   the noise that later steps see (the noise of the last step only enters the weights);
2. the K steps in n-space: logits, closed-form gradients, clipping and the coefficient
   updates, for every client at once;
3. one GEMM W_K = (W_0 + sum_j u_j N_j) - A_K X.
It pays off when K s n d, the bucketed path's work, exceeds about (K + 3) n d
(`span_is_cheaper`), e.g. K = 5 and s = 0.5 on CIFAR-shaped features.

The same math as the generic path (tested equal): the same batches from the same
sampling stream, the same clipping, the same noise draws from the same per-client
streams, the same ledger entries. The ledger decides on no data, so the K releases are
admitted and recorded before the computation (`DPMechanism.reserve`) and their noise is
drawn up front (`DPMechanism.draw_noise`, in the order K separate releases draw it).
"""

from __future__ import annotations

import torch

from p4bench.engine.training import sample_batches
from p4bench.models import Params
from p4bench.plugins.p4.fused import LinearCotraining, mutual_distillation_gradients
from p4bench.privacy.mechanism import clip_scale


def span_is_cheaper(samples: int, dim: int, classes: int, steps: int, data_rate: float, private: bool) -> bool:
    """Whether the span path needs fewer FLOPs than the bucketed path for one round.

    Bucketed: per step, forward and weight gradient of both models on s n samples,
    8 s n d L. Span: the first GEMM over 2L (+ (K-1) L noise) rows, the last over 2L,
    and per step the n-space products 4 L n^2 (the Gram matrix is amortised over rounds).
    """
    buckets = 8 * data_rate * samples * dim * classes * steps
    first_rows = 2 * classes + ((steps - 1) * classes if private else 0)
    span = 2 * samples * dim * (first_rows + 2 * classes) + steps * 4 * classes * samples**2
    return span < buckets


class SpanCotraining(LinearCotraining):
    """The span path: two GEMMs per round, the K steps in n-space (module docstring)."""

    def run(self, proxy: Params, private: Params, train, ctx, steps: int) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
        dp = ctx.dp
        count, classes, dim = proxy["weight"].shape
        x = train.x.flatten(start_dim=2)  # (C, n, d)
        if dp is not None:
            done = dp.reserve(ctx, self.data_rate, steps).float()  # (K, C)
            expected = (self.data_rate * train.n.double()).clamp_min(1.0)
            proxy_lr = (self.lr * done.double() / expected).float()  # the DP mean divides by the expected batch
        else:
            done = torch.ones(steps, count)
            proxy_lr = self.lr * done
        noise_rows = steps * classes if dp is not None else 0
        # [proxy W; private W; N_0; ...; N_{K-1}] per client, so one GEMM reads X once for all of them
        stacked = self.workspace.get("span", (count, 2 * classes + noise_rows, dim))
        stacked[:, :classes].copy_(proxy["weight"])
        stacked[:, classes : 2 * classes].copy_(private["weight"])
        bias = torch.cat([proxy["bias"], private["bias"]], dim=1)
        noise_scale = None
        if dp is not None:
            bias_noise = torch.empty(count, steps, classes)
            blocks = [stacked[:, 2 * classes + k * classes : 2 * classes + (k + 1) * classes] for k in range(steps)]
            dp.draw_noise([part for k in range(steps) for part in (bias_noise[:, k], blocks[k])])
            noise_scale = -proxy_lr * dp.settings.noise_std  # (K, C): u_k per row
        projected_rows = 2 * classes + max(noise_rows - classes, 0)
        projected = torch.bmm(stacked[:, :projected_rows], x.transpose(1, 2))  # (C, rows, n)
        if noise_scale is not None:  # the noise's share of the final proxy weights, known already
            for k in range(steps):
                stacked[:, :classes].addcmul_(blocks[k], noise_scale[k].view(count, 1, 1))
        coefficients, total, taken = self._steps(projected, bias, bias_noise if dp is not None else None, noise_scale,
                                                 proxy_lr, done, train, ctx, steps)
        # into a fresh contiguous tensor: faster than in place on the strided view, and the
        # result must not live in the reused buffer anyway
        weights = torch.baddbmm(stacked[:, : 2 * classes], coefficients, x, alpha=-1.0, out=torch.empty(count, 2 * classes, dim))
        return (
            {"weight": weights[:, :classes], "bias": bias[:, :classes]},
            {"weight": weights[:, classes:], "bias": bias[:, classes:]},
            total,
            taken,
        )

    def _steps(self, projected, bias, bias_noise, noise_scale, proxy_lr, done, train, ctx, steps):
        """The K steps in n-space. Updates `bias` in place; returns (A_K (C, 2L, n),
        summed proxy loss (C,), steps taken (C,))."""
        count, width = train.y.shape
        classes = bias.shape[1] // 2
        gram, norms = train.gram(), train.squared_norms()
        coefficients = torch.zeros(count, 2 * classes, width)
        noise_logits = torch.zeros(count, classes, width)
        total, taken = torch.zeros(count, dtype=torch.float64), torch.zeros(count)
        for k in range(steps):
            index, mask = sample_batches(ctx, train)
            chosen = torch.zeros(count, width).scatter_add_(1, index, mask.float())
            logits = torch.baddbmm(projected[:, : 2 * classes], coefficients, gram, alpha=-1.0)
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
                rows = slice(2 * classes + k * classes, 2 * classes + (k + 1) * classes)
                if k < steps - 1:  # the last step's noise is seen by no later logits
                    noise_logits.addcmul_(projected[:, rows], noise_scale[k].view(count, 1, 1))
                bias[:, :classes].addcmul_(bias_noise[:, k], noise_scale[k].view(count, 1))
            total += (losses * chosen).sum(dim=1).double() / batch.squeeze(1).double() * done[k]
            taken += done[k]
        return coefficients, total, taken
