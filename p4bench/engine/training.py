"""Per-client training math, batched over a client axis, with a plain reference loop.

`batched_loss_and_grad` vmaps one client's loss over stacked parameters, so a round of
M clients costs a handful of batched kernels. `reference_loss_and_grad` computes the
same numbers with ordinary autograd, one client at a time; tests compare the two.

Losses are per-example functions of the logits (`PerExampleLoss`), optionally with an
auxiliary per-example tensor (for example a teacher's logits in distillation).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.func import grad_and_value, vmap

from p4bench.models import LinearSoftmax, Model, Params
from p4bench.models.dropout import computes_training_gradients
from p4bench.models.stacked import stacked_logits, stacked_loss_and_grad, supports_stacked

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.data import ClientTensors
    from p4bench.rng import ClientRng

PerExampleLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class LossAndGrad(Protocol):
    """`ctx.loss_and_grad`: the non-private loss and gradient of every row's batch, computed
    as the runtime decides (batched over all rows in the simulator, one row at a time in
    the reference runtime). `params` are stacked per row (R, ...), `x` (R, b, ...) and `y`
    (R, b) the rows' batches, `weight` (R, b) 1 for a sample and 0 for padding; `loss` maps
    (logits, labels, aux) to per-example losses (cross-entropy by default), `aux` (R, b, ...)
    is passed to it. Returns (the weighted mean loss per row (R,), the gradient of that mean
    per parameter, stacked like `params`). Nothing is clipped, noised or recorded: a
    gradient that reaches a release goes through `ctx.dp`."""

    def __call__(
        self,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        loss: PerExampleLoss = ...,
        aux: torch.Tensor | None = ...,
    ) -> tuple[torch.Tensor, Params]: ...


class _DPSteps(Protocol):
    """What the helpers below use of a DP mechanism (`p4bench.privacy.mechanism.DPMechanism`)."""

    def step(
        self,
        ctx: Any,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        sample_rate: float,
        expected_batch: torch.Tensor,
        loss: PerExampleLoss = ...,
        aux: torch.Tensor | None = ...,
        sq_norms: torch.Tensor | None = ...,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]: ...

    def sgd(
        self, ctx: Any, params: Params, train: Any, steps: int, lr: float
    ) -> tuple[Params, torch.Tensor]: ...


class TrainingContext(Protocol):
    """What the helpers below use of a step context (`p4bench.engine.method.StepContext`,
    which imports this module)."""

    @property
    def config(self) -> RunConfig: ...
    @property
    def rows(self) -> torch.Tensor: ...
    @property
    def rng(self) -> ClientRng: ...
    @property
    def loss_and_grad(self) -> LossAndGrad: ...
    @property
    def dp(self) -> _DPSteps | None: ...


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis, as elementwise operations and sums over it: torch's
    CPU kernel is slow for a few classes (4.3 ms for 28,800 x 10 on one thread, against
    0.5 ms here). Equal to `torch.log_softmax` up to float rounding (about 1e-6)."""
    shifted = logits - logits.detach().amax(
        dim=-1, keepdim=True
    )  # a constant per row: no gradient needed
    return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, aux: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-example cross-entropy (the default loss): log sum exp of the logits minus the
    label's, the way `log_softmax` computes it (`F.cross_entropy` up to float rounding)."""
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    return shifted.exp().sum(dim=-1).log() - shifted.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def distillation_loss(weight: float) -> PerExampleLoss:
    """Per-example (1 - w) * CE(student, y) + w * KL(softmax(teacher) || softmax(student)).

    The teacher's logits come as the auxiliary input and are treated as constants
    (P4's eqs. 10-11, ProxyFL's deep mutual learning).
    """

    def loss(
        logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None
    ) -> torch.Tensor:
        ce = cross_entropy(logits, labels)
        if teacher is None or weight == 0:
            return ce
        target = log_softmax(teacher.detach())
        kl = (target.exp() * (target - log_softmax(logits))).sum(dim=-1)
        return (1 - weight) * ce + weight * kl

    return loss


def weighted_loss(
    model: Model,
    loss: PerExampleLoss,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean loss of one client's batch; `weight` masks padding (0) from samples (1)."""
    losses = loss(model.forward(params, x), y, aux)
    return (losses * weight).sum() / weight.sum().clamp_min(1.0)


@computes_training_gradients
def batched_loss_and_grad(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    loss: PerExampleLoss = cross_entropy,
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Params]:
    """(loss (C,), grads) for stacked params (C, ...) and batches (C, b, ...)."""
    if supports_stacked(model):  # every client in batched GEMMs (p4bench.models.stacked), not vmap
        return stacked_loss_and_grad(model, params, x, y, weight, loss, aux)  # type: ignore[arg-type]
    if type(model) is LinearSoftmax:  # the built-in linear model's own forward: one batched GEMM
        return _linear_loss_and_grad(params, x, y, weight, loss, aux)
    fn = grad_and_value(partial(weighted_loss, model, loss))
    if aux is None:
        grads, value = vmap(lambda p, xs, ys, ws: fn(p, xs, ys, ws))(params, x, y, weight)
    else:
        grads, value = vmap(fn)(params, x, y, weight, aux)
    return value, grads


def _linear_loss_and_grad(
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
) -> tuple[torch.Tensor, Params]:
    """`batched_loss_and_grad` for the linear model: every client's logits in one batched
    GEMM and plain autograd of the summed losses (each client's loss depends on its own
    parameters alone). No torch.func: its first gradient imports torch._dynamo, about 1 s
    of a run's first round."""
    with torch.enable_grad():
        own = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        clients, samples = x.shape[:2]
        logits = torch.baddbmm(
            own["bias"].unsqueeze(1), x.reshape(clients, samples, -1), own["weight"].transpose(1, 2)
        )  # (C, b, L)
        flat_aux = None if aux is None else aux.reshape(clients * samples, *aux.shape[2:])
        losses = loss(logits.reshape(clients * samples, -1), y.reshape(-1), flat_aux).view(
            clients, samples
        )
        value = (losses * weight).sum(dim=1) / weight.sum(dim=1).clamp_min(1.0)
        grads = torch.autograd.grad(value.sum(), list(own.values()))
    return value.detach(), dict(zip(own, grads))


@computes_training_gradients
def reference_loss_and_grad(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    loss: PerExampleLoss = cross_entropy,
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Params]:
    """Same contract as `batched_loss_and_grad`, computed client by client with autograd."""
    losses, grads = [], []
    for c in range(x.shape[0]):
        own = {k: v[c].detach().clone().requires_grad_(True) for k, v in params.items()}
        value = weighted_loss(
            model, loss, own, x[c], y[c], weight[c], None if aux is None else aux[c]
        )
        values = torch.autograd.grad(value, list(own.values()))
        losses.append(value.detach())
        grads.append(dict(zip(own, values)))
    return torch.stack(losses), {k: torch.stack([g[k] for g in grads]) for k in params}


class Workspace:
    """Reusable scratch memory for large per-step temporaries.

    Allocations of hundreds of MB are fresh mmaps that the kernel must fault in page by
    page on every step (slower than the arithmetic on them); reusing one buffer avoids
    that. A buffer handed out is valid until the next request under the same name.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def holds(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in buffer `name` (so a caller can pick another one)."""
        buffer = self._buffers.get((name, tensor.dtype))
        return (
            buffer is not None
            and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        )

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        reserve: int = 0,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """A (shape) view of buffer `name`, grown to at least `reserve` elements when it
        has to grow (so a size that varies from step to step allocates once); on `device`
        (default: torch's default device, the run's inside its device scope)."""
        size = 1
        for extent in shape:
            size *= int(extent)
        key = (name, dtype)
        buffer = self._buffers.get(key)
        moved = device is not None and buffer is not None and buffer.device != torch.device(device)
        if buffer is None or buffer.numel() < size or moved:
            buffer = torch.empty(max(size, reserve), dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:size].view(shape)


def gather_batch(
    values: torch.Tensor,
    index: torch.Tensor,
    workspace: Workspace | None = None,
    name: str = "batch",
    clients: torch.Tensor | None = None,
) -> torch.Tensor:
    """values (C, n, ...) and index (B, b) -> (B, b, ...): sample index[i, j] of client
    clients[i] (default: of client i, B = C); into `workspace` memory if given."""
    if (
        values.device != index.device
    ):  # samples streamed from (pinned) host memory: gather there, move the batch
        host_clients = None if clients is None else clients.cpu()
        return gather_batch(values, index.cpu(), clients=host_clients).to(
            index.device, non_blocking=True
        )
    count, width = values.shape[:2]
    owners = (torch.arange(count, device=index.device) if clients is None else clients).unsqueeze(1)
    if not values.is_contiguous():
        return values[owners, index]
    # index_select copies whole rows: much faster than advanced indexing for wide samples
    flat = (index + owners * width).reshape(-1)
    rows = values.reshape(count * width, *values.shape[2:])
    if workspace is None:
        picked = rows.index_select(0, flat)
    else:
        # headroom for larger batches: Poisson batch widths vary a little from step to step
        row = values[0, 0].numel() if values.numel() else 0
        reserve = min(values.numel(), int(1.25 * len(flat)) * row)
        buffer = workspace.get(name, (len(flat), *values.shape[2:]), values.dtype, reserve=reserve)
        picked = torch.index_select(rows, 0, flat, out=buffer)
    return picked.reshape(*index.shape, *values.shape[2:])


# Clients per chunk when samples are streamed from host memory for evaluation.
STREAM_CHUNK_CLIENTS = 64


@torch.no_grad()
def logits_of(model: Model, params: Params, x: torch.Tensor) -> torch.Tensor:
    """(C, n, L) logits of each client's model on its own samples (C, n, ...); samples
    held in host memory (streamed runs) are moved to the parameters' device in chunks of
    clients."""
    device = next(iter(params.values())).device if params else x.device
    if x.device == device:
        if supports_stacked(model):
            return stacked_logits(model, params, x)  # type: ignore[arg-type]
        return vmap(model.forward)(params, x)
    chunks = []
    for start in range(0, x.shape[0], STREAM_CHUNK_CLIENTS):
        part = slice(start, start + STREAM_CHUNK_CLIENTS)
        chunk = {k: v[part] for k, v in params.items()}
        chunks.append(vmap(model.forward)(chunk, x[part].to(device, non_blocking=True)))
    return torch.cat(chunks)


@torch.no_grad()
def accuracy(
    model: Model, params: Params, x: torch.Tensor, y: torch.Tensor, n: torch.Tensor
) -> torch.Tensor:
    """(C,) accuracy of each client's model on its own padded samples."""
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64)
    logits = logits_of(model, params, x)
    mask = torch.arange(y.shape[1], device=y.device) < n.unsqueeze(1)
    correct = ((logits.argmax(dim=-1) == y) & mask).sum(dim=1)
    return correct.double() / n.clamp_min(1).double()


def shared_accuracy(
    model: Model, params: Params, held: ClientTensors, chunk_logits: int = 1 << 24
) -> torch.Tensor:
    """(C,) accuracy of each client's model on one test set shared by all (`held`, one row
    (1, N, ...)), in chunks of clients so that the logits stay under `chunk_logits` values."""
    count = next(iter(params.values())).shape[0] if params else 0
    total = int(held.n[0]) if len(held.n) else 0
    if count == 0 or total == 0:
        return torch.zeros(count, dtype=torch.float64)
    device = next(iter(params.values())).device
    x, y = held.x[0, :total].to(device), held.y[0, :total].to(device)
    forward = vmap(model.forward, in_dims=(0, None))  # one copy of the test set for every model
    per_chunk = max(1, chunk_logits // (total * max(model.num_classes, 1)))
    parts = []
    for start in range(0, count, per_chunk):  # chunks of clients: memory, not a loop per client
        logits = forward({k: v[start : start + per_chunk] for k, v in params.items()}, x)
        parts.append((logits.argmax(dim=-1) == y).sum(dim=1).double() / total)
    return torch.cat(parts)


def poisson_batches(
    rng: ClientRng, n: torch.Tensor, rate: float, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Poisson sampling: each of a client's n_i samples is in the batch with prob `rate`.

    Returns (index, mask) compacted to the largest realised batch (read back: the one
    host synchronisation of a step on a GPU). `width`, max(n) when the caller knows it
    (`ClientTensors.max_count`), saves a second one.
    """
    if width is None:
        width = int(n.max()) if len(n) else 0
    chosen = (rng.uniform(max(width, 1))[:, :width] < rate) & (torch.arange(width) < n.unsqueeze(1))
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)
    counts = chosen.sum(dim=1)
    realised = int(counts.max()) if len(counts) else 0
    return order[:, : max(realised, 1)], torch.arange(max(realised, 1)) < counts.unsqueeze(1)


def sample_batches(ctx: TrainingContext, train: ClientTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, mask) of one batch per row: Poisson sampling at rate s when the run is
    private (what the DP analysis assumes), else round(s * n_i) samples without replacement."""
    if ctx.dp is not None:
        return poisson_batches(ctx.rng, train.n, ctx.config.data_rate, train.max_count())
    return fixed_size_batches(ctx, train)


def fixed_size_batches(
    ctx: TrainingContext, train: ClientTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-client batches of round(s * n_i) samples without replacement: (index, mask)."""
    batch = torch.round(ctx.config.data_rate * train.n.double()).clamp_min(1).long()
    return ctx.rng.subsets(train.n, batch, int(batch.max()))


def batch_gradient(
    ctx: TrainingContext,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    train: ClientTensors,
    loss: PerExampleLoss = cross_entropy,
    aux: torch.Tensor | None = None,
    input_stats: torch.Tensor | None = None,
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """Mean gradient of each row's batch: through the DP mechanism (clipping, noise,
    ledger, budget) when the run is private. Returns (grads, loss (C,) float64,
    done (C,) float: 0 where the budget refused the step and the gradient is zero).
    `input_stats`: the batch's per-sample statistics for clipping, where the caller keeps
    them (`p4bench.privacy.mechanism.input_statistics`, gathered like the samples)."""
    if ctx.dp is not None:
        expected = ctx.config.data_rate * train.n.double()
        # sq_norms only when there are statistics: a mechanism wrapper written before it existed keeps working
        extra = {} if input_stats is None else {"sq_norms": input_stats}
        grads, value, released = ctx.dp.step(
            ctx, params, x, y, mask.float(), ctx.config.data_rate, expected, loss, aux, **extra
        )
        return grads, value.double(), released.float()
    value, grads = ctx.loss_and_grad(params, x, y, mask.float(), loss=loss, aux=aux)
    return grads, value.detach().double(), torch.ones(len(ctx.rows))


def noble_local_lr(config: RunConfig) -> float:
    """eta_l = lr / (max(round(K * s), 1) * eta_g), the local step size of Noble et al.'s
    DP-FedAvg/DP-SCAFFOLD code (the CLI's lr is a tuned multiplier there): FedAvg's
    default (option lr_scaling = noble), SCAFFOLD through it, and P4, which builds on that code."""
    return config.lr / (max(round(config.local_steps * config.data_rate), 1) * config.global_lr)


def local_sgd(
    ctx: TrainingContext, params: Params, train: ClientTensors, steps: int, lr: float
) -> tuple[Params, torch.Tensor]:
    """`steps` SGD steps for every row of `params`, each on a fresh batch of round(s * n_i)
    samples drawn without replacement from the client's own stream (`ctx.rng`).

    With differential privacy on (`ctx.dp`), each step goes through the DP mechanism
    instead (Poisson sampling, clipping, noise, ledger). Returns the new parameters and
    each client's mean loss over the steps.
    """
    if ctx.dp is not None:
        return ctx.dp.sgd(ctx, params, train, steps, lr)
    total = torch.zeros(train.n.shape[0], dtype=torch.float64)
    for _ in range(steps):
        index, mask = fixed_size_batches(ctx, train)
        loss, grads = ctx.loss_and_grad(
            params, gather_batch(train.x, index), gather_batch(train.y, index), mask.float()
        )
        params = {k: params[k] - lr * grads[k] for k in params}
        total += loss.detach().double()
    return params, total / steps
