"""Models evaluated for every client at once, without vmap: stacked layers as batched GEMMs,
and ghost clipping on them.

`vmap` over clients, and again over examples for per-example gradients, turns every
convolution into a grouped convolution with one group per client (or per example). On a
GPU the weight gradient of such a convolution runs as one small kernel per group: at 260
clients of 80 examples, 127,000 kernel launches per step, 20x slower than the arithmetic.
Here a convolution is an unfold (im2col) and one batched GEMM per layer over the client
axis, so its weight gradient is one batched GEMM too.

A model opts in with `StackedModel.stacked_forward(params, x, tape)`: params with a
leading client axis (C, ...), inputs (C, b, ...), logits (C, b, L). Each parametrised
layer goes through `conv2d` or `linear` below, which record on `tape` its input rows U
(C, b*R, K) and its pre-activation outputs Z (C, b*R, out): R rows per example (the
output positions of a convolution, 1 for a linear layer).

Ghost clipping (`clipped_gradient_sum`) then needs one forward and one backward to the
Z's (never to the weights): with G = dloss/dZ, example n's gradient of a layer is
G_n^T U_n (out x K), its bias gradient the column sums of G_n, and
    ||G_n^T U_n||_F^2 = <G_n G_n^T, U_n U_n^T>   (R x R Gram matrices),
used where R^2 < out * K (else the per-example gradient itself is formed). Each example's
factor s_n = min(1, C / ||g_n||) then gives the clipped sum of a client as one GEMM,
(s G)^T U. Clients are independent, so all of this runs in chunks of clients whose
unfolded inputs fit `CHUNK_ELEMENTS` (memory bounded at any client count).

Norms and sums are computed in the precision of the parameters (float32), from the same
G and U: the clipped contribution that is summed is the one whose norm was bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

__all__ = [
    "StackedModel",
    "Layer",
    "conv2d",
    "linear",
    "stacked_logits",
    "stacked_loss_and_grad",
    "clipped_gradient_sum",
    "input_grams",
    "dataset_input_grams",
    "CHUNK_ELEMENTS",
]

Params = dict[str, torch.Tensor]
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# Elements of the largest per-layer temporary (the unfolded input of a convolution) of one
# chunk of clients: 2**28 float32 values, 1 GiB.
CHUNK_ELEMENTS = 1 << 28


@dataclass
class Layer:
    """One parametrised layer of a stacked forward, as recorded on the tape."""

    weight: str  # parameter names
    bias: str
    rows: torch.Tensor  # U (C, b*R, K): the input rows the weight multiplies
    out: torch.Tensor  # Z (C, b*R, out): the pre-activation outputs
    per_example: int  # R


@runtime_checkable
class StackedModel(Protocol):
    """A model that can evaluate all clients at once (module docstring)."""

    def stacked_forward(
        self, params: Params, x: torch.Tensor, tape: list[Layer] | None = None
    ) -> torch.Tensor: ...

    def stacked_rows(self, x: torch.Tensor) -> int:
        """Elements of the largest per-layer temporary per client for inputs x (C, b, ...)."""
        ...


def supports_stacked(model: object) -> bool:
    return isinstance(model, StackedModel) and getattr(model, "stacked", False)


def conv2d(
    params: Params,
    name: str,
    h: torch.Tensor,
    stride: int = 1,
    padding: int = 0,
    tape: list[Layer] | None = None,
) -> torch.Tensor:
    """Per-client convolution: h (C, b, Cin, H, W), weights (C, Cout, Cin, k, k), bias (C, Cout)
    -> (C, b, Cout, H', W'), as unfold + one batched GEMM."""
    weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
    clients, batch, channels, height, width = h.shape
    out_channels, kernel = weight.shape[1], weight.shape[-1]
    rows = _patch_rows(h.reshape(clients * batch, channels, height, width), kernel, stride, padding)
    positions = rows.shape[1]
    rows = rows.view(clients, batch * positions, -1)  # (C, b*R, Cin*k*k)
    out = torch.baddbmm(
        bias.unsqueeze(1), rows, weight.reshape(clients, out_channels, -1).transpose(1, 2)
    )
    if tape is not None:
        tape.append(Layer(f"{name}.weight", f"{name}.bias", rows, out, positions))
    side_h = (height + 2 * padding - kernel) // stride + 1
    side_w = (width + 2 * padding - kernel) // stride + 1
    return out.view(clients, batch, side_h, side_w, out_channels).permute(0, 1, 4, 2, 3)


def _patch_rows(h: torch.Tensor, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """(N, R, Cin*k*k) input patches of every output position (im2col, in `F.unfold`'s
    order), as strided views and one copy. `F.unfold` on CUDA runs one kernel per sample
    (and its backward too): 2,000 launches for one chunk of clients."""
    padded = F.pad(h, (padding, padding, padding, padding)) if padding else h
    windows = padded.unfold(2, kernel, stride).unfold(
        3, kernel, stride
    )  # (N, Cin, H', W', k, k), a view
    count, channels, side_h, side_w = windows.shape[:4]
    return windows.permute(0, 2, 3, 1, 4, 5).reshape(
        count, side_h * side_w, channels * kernel * kernel
    )


def linear(
    params: Params, name: str, a: torch.Tensor, tape: list[Layer] | None = None
) -> torch.Tensor:
    """Per-client linear layer: a (C, b, K), weights (C, out, K), bias (C, out) -> (C, b, out)."""
    weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
    out = torch.baddbmm(bias.unsqueeze(1), a, weight.transpose(1, 2))
    if tape is not None:
        tape.append(Layer(f"{name}.weight", f"{name}.bias", a, out, 1))
    return out


def _chunks(model: StackedModel, x: torch.Tensor) -> list[slice]:
    clients = x.shape[0]
    per_client = max(1, model.stacked_rows(x[:1]))
    size = max(1, min(clients, CHUNK_ELEMENTS // per_client))
    return [slice(start, min(start + size, clients)) for start in range(0, clients, size)]


def _rows(params: Params, part: slice) -> Params:
    return {k: v[part] for k, v in params.items()}


@torch.no_grad()
def stacked_logits(model: StackedModel, params: Params, x: torch.Tensor) -> torch.Tensor:
    """(C, b, L) logits of every client's model on its own inputs x (C, b, ...)."""
    return torch.cat(
        [model.stacked_forward(_rows(params, part), x[part]) for part in _chunks(model, x)]
    )


def _per_example_losses(
    model: StackedModel,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
    tape: list[Layer] | None,
) -> torch.Tensor:
    logits = model.stacked_forward(params, x, tape)
    count, width, classes = logits.shape
    flat_aux = None if aux is None else aux.reshape(count * width, *aux.shape[2:])
    return loss(logits.reshape(count * width, classes), y.reshape(-1), flat_aux).view(count, width)


def stacked_loss_and_grad(
    model: StackedModel,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    loss: PerExampleLoss,
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Params]:
    """`batched_loss_and_grad`'s contract: (mean loss (C,), grads) of each client's
    weighted batch, through one stacked forward and backward per chunk of clients."""
    values, grads = [], []
    for part in _chunks(model, x):
        own = {k: v[part].detach().requires_grad_(True) for k, v in params.items()}
        losses = _per_example_losses(
            model, own, x[part], y[part], loss, None if aux is None else aux[part], None
        )
        w = weight[part]
        value = (losses * w).sum(1) / w.sum(1).clamp_min(1.0)
        grads.append(dict(zip(own, torch.autograd.grad(value.sum(), list(own.values())))))
        values.append(value.detach())
    return torch.cat(values), {k: torch.cat([g[k] for g in grads]) for k in params}


def input_grams(model: StackedModel, x: torch.Tensor) -> torch.Tensor | None:
    """(C, n, R, R) Gram matrices U U^T of each sample's first-layer input rows, or None
    where the first layer has one row per example. They depend on the data alone, so a
    caller computes them once per dataset (`dataset_input_grams`) and gathers a batch's:
    the ghost norm of the first layer, the largest, then costs no GEMM per step."""
    first_rows = getattr(model, "first_layer_rows", None)
    if first_rows is None:
        return None
    clients, samples = x.shape[:2]
    step = max(1, min(clients, CHUNK_ELEMENTS // max(1, model.stacked_rows(x[:1]))))
    parts = []
    for start in range(0, clients, step):
        rows = first_rows(x[start : start + step])  # (c * n, R, K)
        if rows.shape[1] == 1:
            return None
        parts.append(
            torch.bmm(rows, rows.transpose(1, 2)).view(-1, samples, rows.shape[1], rows.shape[1])
        )
    return torch.cat(parts)


def dataset_input_grams(model: StackedModel, train: object) -> torch.Tensor | None:
    """`input_grams` of a client dataset's samples (`ClientTensors`), computed once per
    data set and model architecture, and selected (not recomputed) for the row subsets
    that rounds with partial participation take (`ClientTensors._derived`)."""
    name = f"_input_grams_{type(model).__name__}_{'x'.join(map(str, getattr(model, 'feature_shape', ())))}"
    grams: torch.Tensor | None = train._derived(  # type: ignore[attr-defined]
        name,
        lambda x: input_grams(model, x),
        lambda value, index, width: None if value is None else value[index, :width],
    )
    return grams


def _squared_norms(
    layer: Layer, grad_out: torch.Tensor, examples: int, input_gram: torch.Tensor | None = None
) -> torch.Tensor:
    """(N,) squared norms of each example's gradient of one layer (weight and bias);
    `input_gram` (N, R, R): U U^T of the layer's input rows when the caller has it."""
    per = layer.per_example
    g = grad_out.reshape(examples, per, -1)  # (N, R, out)
    u = layer.rows.reshape(examples, per, -1)  # (N, R, K)
    if per == 1:
        weight = g.square().sum((1, 2)) * u.square().sum((1, 2))
    elif input_gram is not None:  # ghost norm with the precomputed U U^T
        weight = (torch.bmm(g, g.transpose(1, 2)) * input_gram.reshape(examples, per, per)).sum(
            (1, 2)
        )
    elif per * per < g.shape[-1] * u.shape[-1]:  # ghost norm: <G G^T, U U^T>
        weight = (torch.bmm(g, g.transpose(1, 2)) * torch.bmm(u, u.transpose(1, 2))).sum((1, 2))
    else:
        weight = torch.bmm(g.transpose(1, 2), u).square().sum((1, 2))
    return weight + g.sum(1).square().sum(1)


def clipped_gradient_sum(
    model: StackedModel,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    loss: PerExampleLoss,
    aux: torch.Tensor | None = None,
    grams: torch.Tensor | None = None,
) -> tuple[Params, torch.Tensor]:
    """`p4bench.privacy.clipping.clipped_gradient_sum`'s contract for a stacked model:
    (sum over each client's batch of per-example gradients clipped to L2 norm `clip`,
    per-example losses (C, b)), by ghost clipping (module docstring). `grams` (C, b, R, R):
    the batch's `input_grams`, where the caller keeps them (else computed here)."""
    sums: list[Params] = []
    all_losses = []
    for part in _chunks(model, x):
        # the weights require grad only to connect the outputs Z to the graph: autograd
        # computes the gradients asked for (the Z's), never the weights'
        own = {k: v[part].detach().requires_grad_(True) for k, v in params.items()}
        tape: list[Layer] = []
        with torch.enable_grad():
            losses = _per_example_losses(
                model, own, x[part], y[part], loss, None if aux is None else aux[part], tape
            )
            grad_outs = torch.autograd.grad(
                (losses * mask[part]).sum(), [layer.out for layer in tape]
            )
        with torch.no_grad():
            count, width = losses.shape
            first = None if grams is None else grams[part]
            squared = sum(
                _squared_norms(layer, g, count * width, first if index == 0 else None)
                for index, (layer, g) in enumerate(zip(tape, grad_outs))
            )
            norms = torch.as_tensor(squared).sqrt().view(count, width)
            scale = (clip / norms.clamp_min(1e-12)).clamp(max=1.0) * mask[part]
            chunk: Params = {}
            for layer, g in zip(tape, grad_outs):
                scaled = g * scale.repeat_interleave(layer.per_example, dim=1).unsqueeze(
                    -1
                )  # (C, b*R, out)
                chunk[layer.weight] = torch.bmm(scaled.transpose(1, 2), layer.rows).view(
                    own[layer.weight].shape
                )
                chunk[layer.bias] = scaled.sum(1)
        sums.append(chunk)
        all_losses.append(losses.detach())
    return {k: torch.cat([s[k] for s in sums]) for k in params}, torch.cat(all_losses)
