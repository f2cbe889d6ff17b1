"""Cross-gradients (PDSL, DP-CGA): every agent evaluates the gradient of each model in its
neighbourhood on ONE batch of its own records, in one batched computation, and
privatises them as one release.

Agent i holds K slots (`present` (C, K) marks its neighbourhood M_i, itself included;
PDSL and DP-CGA pass K = the largest degree, `NeighbourTable`) and computes
g_ij = grad F_i(x_j; B) for every present j on the same batch B.
The k_i = |M_i| gradients come from the same records, so they are one release of the
concatenated vector, never k_i independent ones:

- `clip_mode = per-example`: Poisson sampling at the run's rate q, each record's
  gradient clipped to C for each model, so the concatenation has L2 sensitivity
  sqrt(k_i) C per record. Noise std sqrt(k_i) sigma C on every coordinate (sigma the run's
  noise multiplier; 2 sigma C under replace-one) makes the whole round ONE subsampled
  Gaussian release with multiplier sigma, recorded at rate q.
- `clip_mode = batch` (the paper's): the batch-mean gradient of each model is clipped to
  C, so each has sensitivity 2C (any two vectors of the C-ball) under both relations and
  the concatenation 2C sqrt(k_i). Noise std 2 C sigma sqrt(k_i) per coordinate: one
  Gaussian release with multiplier sigma, recorded at rate 1 (no amplification claimed:
  a record in the batch moves every clipped mean).

Without DP the gradients are plain batch means (no clipping, no noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.engine.messages import UPDATE_PREFIX
from p4bench.engine.method_kit import GraphSchedule
from p4bench.engine.state import unvectorize, vectorize
from p4bench.engine.training import fixed_size_batches, gather_batch, poisson_batches
from p4bench.errors import ConfigError
from p4bench.models import Params
from p4bench.moved import forward_moved
from p4bench.privacy.clipping import clipped_gradient_sum
from p4bench.privacy.concatenated import noise_scale, release_rate
from p4bench.privacy.releases import Releases
from p4bench.topology import is_connected, metropolis_hastings, uniform_averaging
from p4bench.topology.assumptions import check_pdsl_assumption
from p4bench_baselines.neighbour_table import NeighbourTable

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

# the noise algebra was defined here before 0.2
__getattr__ = forward_moved(
    __name__,
    dict.fromkeys(("CLIP_MODES", "noise_std_per_coordinate"), "p4bench.privacy.concatenated"),
)

# payload keys of the `models` and `gradients` exchanges: update.*, so a malicious neighbour's
# message attack acts on them (a crafted x_j: `model-probe`; a poisoned cross-gradient)
MODEL, GRADIENT = UPDATE_PREFIX + "model", UPDATE_PREFIX + "gradient"


@dataclass(frozen=True)
class Neighbourhoods:
    """A static graph's mixing matrix W (M, M), each agent's neighbourhood M_i (itself
    included, (M, M) bool) and W's report (rho, degrees; `p4bench.topology.assumptions`);
    `members`, `matrix` (W, float64) and `table` (M_i as K = max degree slots, what a
    round works on) live on the run's device."""

    weights: np.ndarray
    members: torch.Tensor
    report: dict[str, Any]
    matrix: torch.Tensor
    table: NeighbourTable


def static_neighbourhoods(
    values: dict[str, Any], num_clients: int, seed: int, method: str
) -> Neighbourhoods:
    """The graph of options topology / topology_options / mixing, which must be connected
    and static (ConfigError otherwise), its W and the A3 report (`check`: PDSL's A3 check)."""
    graph = GraphSchedule(str(values["topology"]), values["topology_options"], num_clients, seed)
    if graph.time_varying:
        raise ConfigError(
            "options.topology", f"{method} needs a static graph (W is fixed for the run)"
        )
    adjacency = graph.adjacency(0).astype(bool)
    if not is_connected(adjacency):
        raise ConfigError("options.topology", f"graph '{values['topology']}' is not connected")
    weights = (metropolis_hastings if values["mixing"] == "metropolis" else uniform_averaging)(
        adjacency
    )
    report = check_pdsl_assumption(weights)  # rho < 1, W symmetric and doubly stochastic, w_ii > 0
    device = torch.get_default_device()  # the run's (p4bench.engine.devices.device_scope)
    members = torch.from_numpy((weights > 0) | np.eye(num_clients, dtype=bool)).to(device)
    matrix = torch.from_numpy(weights).to(device)
    return Neighbourhoods(weights, members, report, matrix, NeighbourTable.of(members, matrix))


def _repeat_rows(tensor: torch.Tensor, times: int) -> torch.Tensor:
    """(C, ...) -> (C * times, ...): each row repeated `times` times, consecutively."""
    return (
        tensor.unsqueeze(1)
        .expand(tensor.shape[0], times, *tensor.shape[1:])
        .reshape(-1, *tensor.shape[1:])
    )


def cross_gradients(
    ctx: Any,
    models: torch.Tensor,
    like: Params,
    present: torch.Tensor,
    train: ClientTensors,
    clip_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grads (C, K, P) float32, mean loss (C,) float64, released (C,) bool).

    `models` (C, K, P) flat parameters (slot j of row i: x_j as i received it), `like` a
    parameter dict with a leading axis (shapes for `unvectorize`). Absent slots give zero
    gradients; rows the budget refuses give zero gradients and `released` False. `ctx` is
    a `StepContext` or any object with its dp, rng, config, model and loss_and_grad (the
    audit's probe, `p4bench.audit.inversion`, passes a namespace)."""
    count, slots, size = models.shape
    private = ctx.dp is not None
    # only the present slots are computed (at most the largest degree per row, not M):
    # a sparse graph costs its edges; absent slots stay zero as before
    width = int(present.sum(1).max()) if count else 0
    order = torch.argsort((~present).to(torch.int8), dim=1, stable=True)[
        :, :width
    ]  # present slots first
    valid = present.gather(1, order)
    per_example = private and clip_mode == "per-example"
    if per_example:
        index, mask = poisson_batches(ctx.rng, train.n, ctx.config.data_rate, train.max_count())
    else:
        index, mask = fixed_size_batches(ctx, train)
    x, y = gather_batch(train.x, index), gather_batch(train.y, index)
    chosen = models.gather(1, order.unsqueeze(2).expand(count, width, size))
    params = unvectorize(
        chosen.reshape(count * width, size), {k: _repeat_rows(v, width) for k, v in like.items()}
    )
    xs, ys, masks = (
        _repeat_rows(x, width),
        _repeat_rows(y, width),
        _repeat_rows(mask.float(), width),
    )
    if per_example:
        sums, losses = clipped_gradient_sum(
            ctx.model, params, xs, ys, masks, float(ctx.dp.settings.clip)
        )
        computed = vectorize(sums).reshape(count, width, size)
        loss = ((losses * masks).sum(1) / masks.sum(1).clamp_min(1)).reshape(count, width)
    else:
        value, raw = ctx.loss_and_grad(params, xs, ys, masks)
        computed = vectorize(raw).reshape(count, width, size)
        loss = value.detach().reshape(count, width)
        if private:  # the paper's batch clipping: each model's batch-mean gradient to norm C
            clip = float(ctx.dp.settings.clip)
            computed = computed * (clip / computed.norm(dim=2, keepdim=True).clamp_min(clip))
    computed = computed * valid.unsqueeze(2)
    grads = computed.new_zeros(count, slots, size).scatter_(
        1, order.unsqueeze(2).expand(count, width, size), computed
    )
    mean_loss = (loss.double() * valid).sum(1) / valid.sum(1).clamp_min(1)
    if not private:
        return grads, mean_loss, torch.ones(count, dtype=torch.bool)
    noisy, released = _privatise(
        ctx, grads, present, clip_mode, ctx.config.data_rate * train.n.double()
    )
    return noisy, mean_loss, released


def _privatise(
    ctx: Any, grads: torch.Tensor, present: torch.Tensor, clip_mode: str, expected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One release per row: noise on all of the row's gradients at once (module docstring).

    Every row draws K P normals, K the slots: with neighbour slots (`NeighbourTable`)
    that is the largest degree, so a row with fewer neighbours draws its padding's too
    and drops it. The draw is then the same for an agent in any batch of rows, so every
    runtime (a device process holds one agent) uses the same numbers."""
    settings = ctx.dp.settings
    degree = present.sum(1).double()
    rate = release_rate(clip_mode, ctx.config.data_rate)
    with Releases(ctx.dp, ctx, rate, 1) as releases:
        released = releases.admitted[0]
        scale = noise_scale(
            settings, clip_mode, degree
        )  # of the mechanism's noise std (p4bench.privacy.concatenated)
        if clip_mode == "per-example":
            target = {"g": grads.reshape(grads.shape[0], -1)}
            releases.privatise(target, scale)
            noisy = (
                target["g"].reshape(grads.shape) / expected.clamp_min(1.0).view(-1, 1, 1).float()
            )
        else:
            target = {"g": grads.reshape(grads.shape[0], -1).clone()}
            releases.privatise(target, scale)
            noisy = target["g"].reshape(grads.shape)
    keep = (present & released.unsqueeze(1)).unsqueeze(2)
    return noisy * keep, released
