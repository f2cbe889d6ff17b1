"""PDSL's cross-gradients on the built-in linear model: one product per agent, no copies.

`p4bench_baselines.cross_gradients` evaluates every (agent i, neighbour j) pair as its own
model on its own copy of i's batch (the batch repeated |M_i| times, then one batched GEMM
and autograd). On a model whose logits are x W^T + b the |M_i| models of agent i share
its batch, so their logits are one product of the batch with the neighbours' stacked
weights, (b, d) @ (d, |M_i| L), and the gradient of the mean cross-entropy is in closed
form: with G = (softmax - onehot) * mask / |B| per sample and model, grad W_j = G_j^T x
and grad b_j = sum of G_j over the batch (one product back). The batch, its draw, the
loss and what happens after (batch clipping, the one DP release per agent) are those of
`cross_gradients`; only the gradient's arithmetic differs (float rounding).

Taken only where it computes the same thing: the built-in linear model's own forward,
the runtime's batched gradients with the default loss (a reference runtime's per-client
autograd, `reference_loss_and_grad`, keeps its own), and no per-example clipping (which
needs per-sample gradients). Everything else goes to `cross_gradients` unchanged.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from p4bench.engine.training import batched_loss_and_grad, fixed_size_batches, gather_batch
from p4bench.models import LinearSoftmax, Params
from p4bench_baselines.cross_gradients import _privatise, cross_gradients

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

__all__ = ["pdsl_cross_gradients", "takes_linear_path"]


def takes_linear_path(ctx: Any, clip_mode: str) -> bool:
    """Whether `pdsl_cross_gradients` computes in closed form (module docstring): decided on
    what the runtime handed over (its model and gradient function), not on a declaration."""
    gradient = getattr(ctx, "loss_and_grad", None)
    batched = (
        isinstance(gradient, partial)
        and gradient.func is batched_loss_and_grad
        and not gradient.keywords  # the default loss
        and len(gradient.args) == 1
    )
    model = getattr(ctx, "model", None)
    linear = type(model) is LinearSoftmax  # its own forward, x W^T + b
    per_example = ctx.dp is not None and clip_mode == "per-example"
    return batched and linear and not per_example


def pdsl_cross_gradients(
    ctx: Any,
    models: torch.Tensor,
    like: Params,
    present: torch.Tensor,
    train: ClientTensors,
    clip_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cross_gradients`' contract and results (grads (C, K, P), mean loss (C,) float64,
    released (C,) bool), in closed form on the linear model (module docstring)."""
    if not takes_linear_path(ctx, clip_mode):
        return cross_gradients(ctx, models, like, present, train, clip_mode)
    count, slots, size = models.shape
    private = ctx.dp is not None
    index, mask = fixed_size_batches(ctx, train)  # the draw `cross_gradients` makes
    x = gather_batch(train.x, index).reshape(count, index.shape[1], -1)  # (C, b, d)
    y = gather_batch(train.y, index)
    weight = mask.to(x.dtype)
    classes = int(like["bias"].shape[-1])
    features = x.shape[2]
    # `vectorize` order (sorted keys): bias (L) then weight (L, d), for every slot
    bias = models[:, :, :classes].reshape(count, slots * classes, 1)
    weights = models[:, :, classes:].reshape(count, slots * classes, features)
    # (C, K, L, b): every slot's model on the agent's batch, samples innermost, so the
    # reductions over the L classes run along contiguous rows of the batch
    logits = torch.baddbmm(bias, weights, x.transpose(1, 2)).view(count, slots, classes, -1)
    # the default loss as `p4bench.engine.training.cross_entropy` computes it
    shifted = logits - logits.amax(dim=2, keepdim=True)
    exp = shifted.exp()
    total = exp.sum(dim=2, keepdim=True)
    onehot = (torch.arange(classes, device=y.device).view(-1, 1) == y.unsqueeze(1)).to(x.dtype)
    onehot = onehot.unsqueeze(1)  # (C, 1, L, b)
    losses = total.log().squeeze(2) - (shifted * onehot).sum(dim=2)  # (C, K, b)
    records = weight.sum(dim=1).clamp_min(1.0)  # (C,)
    scale = (weight / records.unsqueeze(1)).unsqueeze(1)  # (C, 1, b): d mean / d loss
    loss = (losses * scale).sum(dim=2)  # (C, K)
    # d mean loss / d logits = (softmax - onehot) * weight / records
    upstream = (exp / total).sub_(onehot).mul_(scale.unsqueeze(1)).view(count, slots * classes, -1)
    grad_weight = torch.bmm(upstream, x).view(count, slots, classes * features)
    grad_bias = upstream.sum(dim=2).view(count, slots, classes)
    computed = torch.cat([grad_bias, grad_weight], dim=2)
    if private:  # the paper's batch clipping, as `cross_gradients` applies it
        clip = float(ctx.dp.settings.clip)
        computed = computed * (clip / computed.norm(dim=2, keepdim=True).clamp_min(clip))
    valid = present.bool()
    # absent slots give zero gradients (and no loss), whatever their slot held
    grads = torch.where(valid.unsqueeze(2), computed, 0.0)
    mean_loss = torch.where(valid, loss.double(), 0.0).sum(1) / valid.sum(1).clamp_min(1)
    if not private:
        return grads, mean_loss, torch.ones(count, dtype=torch.bool)
    noisy, released = _privatise(
        ctx, grads, present, clip_mode, ctx.config.data_rate * train.n.double()
    )
    return noisy, mean_loss, released
