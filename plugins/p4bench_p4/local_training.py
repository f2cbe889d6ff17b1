"""P4's local computation, as a mixin of `P4`: phase 1's epoch of DP training of the proxy
alone, and phase 2's co-training, where the proxy takes a DP step (distilling from its
teacher, option `teacher`) and the private model learns on the same batch without DP,
distilling from the proxy (beta). Linear models may take a fused step (`p4bench_p4.fused`,
`p4bench_p4.span`: same math, fewer passes) instead of the generic autograd one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from p4bench.engine.method import StepContext
from p4bench.engine.precision import tf32_matmuls
from p4bench.engine.state import State
from p4bench.engine.training import batch_gradient, gather_batch, logits_of, sample_batches
from p4bench.models import LinearSoftmax, Params
from p4bench.privacy.mechanism import input_statistics
from p4bench_p4.chunked_batches import batch_chunks, chunkable, chunked_dp_gradient
from p4bench_p4.fused import FusedCotraining, LinearCotraining
from p4bench_p4.losses import distillation_loss
from p4bench_p4.span import SpanCotraining, span_fits, span_is_cheaper

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data import ClientTensors

__all__ = ["LocalCotraining"]


class LocalCotraining:
    """P4's local steps (`_proxy_epoch` in phase 1, `_cotrain` in phase 2). Uses the
    method's `config`, `epoch_steps`, `local_lr`, `use_proxy`, `teacher` and its weight
    `alpha`, `beta`, `fused`, `span_noise` and `private_tf32`, and its fused steps `_buckets` and `_span`."""

    config: RunConfig
    epoch_steps: int
    local_lr: float
    use_proxy: bool
    teacher: str
    alpha: float
    beta: float
    fused: str
    span_noise: str
    private_tf32: bool
    _buckets: FusedCotraining
    _span: SpanCotraining

    def _proxy_epoch(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        """Phase 1: one local epoch of (DP) training of the proxy alone."""
        proxy: Params = state["proxy"]
        total, taken = torch.zeros(len(ctx.rows), dtype=torch.float64), torch.zeros(len(ctx.rows))
        for _ in range(self.epoch_steps):
            grads, loss, done = self._proxy_gradient(proxy, train, ctx, teacher_params=None)
            proxy = _descend(proxy, grads, self.local_lr)
            total, taken = total + loss * done, taken + done
        return {**state, "proxy": proxy, "group_proxy": proxy}, total / taken.clamp_min(1)

    def _cotrain(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        proxy: Params = state["proxy"]
        private: Params = state["private"]
        total, taken = torch.zeros(len(ctx.rows), dtype=torch.float64), torch.zeros(len(ctx.rows))
        stopped = state["stopped"].clone()
        if (
            self.fused != "off"
            and self.use_proxy
            and self.teacher != "last-proxy"
            and type(ctx.model) is LinearSoftmax
        ):
            proxy, private, total, taken = self._fused_step(train, ctx).run(
                proxy, private, train, ctx, self.config.local_steps
            )
            stopped |= taken < self.config.local_steps  # the ledger refused a step: budget spent
            return self._cotrained(state, proxy, private, stopped, total, taken)
        stats = (
            input_statistics(ctx.model, train) if ctx.dp is not None else None
        )  # per dataset, cached
        for _ in range(self.config.local_steps):
            index, mask = sample_batches(ctx, train)
            x, y = gather_batch(train.x, index), gather_batch(train.y, index)
            teacher = self._teacher(state, private)
            grads, loss, done = self._proxy_step(
                proxy,
                x,
                y,
                mask,
                train,
                ctx,
                teacher,
                None if stats is None else gather_batch(stats, index),
            )
            if self.use_proxy:
                # the private model learns on the same batch, without DP, from the proxy's pre-step
                # outputs; none of this reaches a release unless the proxy distils from it
                with tf32_matmuls(self.private_tf32):
                    proxy_logits = logits_of(ctx.model, proxy, x)
                    _, private_grads = ctx.loss_and_grad(
                        private,
                        x,
                        y,
                        mask.float(),
                        loss=distillation_loss(self.beta),
                        aux=proxy_logits,
                    )
                private = {
                    k: private[k]
                    - self.local_lr
                    * private_grads[k]
                    * done.view(-1, *([1] * (private[k].dim() - 1)))
                    for k in private
                }
            proxy = {k: proxy[k] - self.local_lr * grads[k] for k in proxy}
            stopped |= ~done.bool()
            total, taken = total + loss * done, taken + done
        return self._cotrained(state, proxy, private, stopped, total, taken)

    def _teacher(self, state: State, private: Params) -> Params | None:
        """The parameters whose outputs the proxy distils from (None: CE only)."""
        if not self.use_proxy or self.alpha == 0:
            return None
        return state["group_proxy"] if self.teacher == "last-proxy" else private

    def _fused_step(self, train: ClientTensors, ctx: StepContext) -> LinearCotraining:
        """The span path when forced or when it needs fewer FLOPs, else the bucketed one.
        Samples streamed from host memory (`ClientTensors.to(stream=True)`) take the
        bucketed path: the span path reads every sample each round (or a basis as large)."""
        if train.x.device != train.y.device:
            return self._buckets
        if self.fused == "auto":
            samples, dim, c = train.x.shape[1], math.prod(train.x.shape[2:]), self.config
            cheaper = span_is_cheaper(
                samples,
                dim,
                ctx.model.num_classes,
                c.local_steps,
                c.data_rate,
                ctx.dp is not None,
                self.span_noise,
            )
            return (
                self._span
                if cheaper and span_fits(train, ctx.dp is not None and self.span_noise == "basis")
                else self._buckets
            )
        return self._span if self.fused == "span" else self._buckets

    @staticmethod
    def _cotrained(
        state: State,
        proxy: Params,
        private: Params,
        stopped: torch.Tensor,
        total: torch.Tensor,
        taken: torch.Tensor,
    ) -> tuple[State, torch.Tensor]:
        trained = taken > 0
        return {
            **state,
            "proxy": proxy,
            "private": private,
            "trained": trained,
            "stopped": stopped,
        }, total / taken.clamp_min(1)

    def _proxy_gradient(
        self, proxy: Params, train: ClientTensors, ctx: StepContext, teacher_params: Params | None
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        index, mask = sample_batches(ctx, train)
        stats = input_statistics(ctx.model, train) if ctx.dp is not None else None
        chunks = batch_chunks(train, index)
        if chunkable(ctx, chunks, train):  # the batches a chunk of clients at a time
            loss_fn = distillation_loss(self.alpha if teacher_params is not None else 0.0)
            return chunked_dp_gradient(
                ctx, proxy, train, index, mask, loss_fn, teacher_params, stats, chunks
            )
        x, y = gather_batch(train.x, index), gather_batch(train.y, index)
        return self._proxy_step(
            proxy,
            x,
            y,
            mask,
            train,
            ctx,
            teacher_params,
            None if stats is None else gather_batch(stats, index),
        )

    def _proxy_step(
        self,
        proxy: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        train: ClientTensors,
        ctx: StepContext,
        teacher_params: Params | None,
        stats: torch.Tensor | None = None,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        """Gradient of the proxy's loss: DP when the run is private. Returns
        (grads, loss (C,), done (C,) float: 1 where the step was taken). `stats`: the
        batch's `input_statistics` (precomputed per dataset)."""
        loss_fn = distillation_loss(self.alpha if teacher_params is not None else 0.0)
        teacher = logits_of(ctx.model, teacher_params, x) if teacher_params is not None else None
        return batch_gradient(ctx, proxy, x, y, mask, train, loss_fn, teacher, input_stats=stats)


def _descend(params: Params, grads: Params, lr: float) -> Params:
    """params - lr * grads, written into the gradients' memory where they are plain tensors
    of their own: no scaled copy and no new models beside the old ones and the gradients
    (phase 1's peak on wide linear models). The same two roundings as the expression:
    (-lr) * g rounds to exactly -(lr * g), then one addition."""
    stepped = {}
    for k, value in params.items():
        grad = grads[k]
        own = (
            grad.is_contiguous()
            and grad.shape == value.shape
            and grad.dtype == value.dtype
            and not grad.requires_grad
            and grad.data_ptr() != value.data_ptr()
        )
        stepped[k] = grad.mul_(-lr).add_(value) if own else value - lr * grad
    return stepped
