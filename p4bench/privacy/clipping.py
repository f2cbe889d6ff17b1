"""Per-example gradient clipping: flat L2 clipping to C across all parameters, summed
over each client's batch.

Per-example gradients are batched across clients and examples. For the linear model
the clipped sum is computed from per-example logit gradients without materialising
per-example weight gradients (||g_i x_i^T||^2 = ||g_i||^2 ||x_i||^2), so a DP step costs
two GEMMs; other models use nested vmap. `clip_scale` is that linear-layer factor on
its own, for fast paths that apply the clipped step inside their own GEMMs (through
`Releases.clip_scale`, which supplies the run's C). Models with a stacked forward
(`p4bench.models.stacked`: the scatter-CNN) are clipped there, by ghost clipping.

Every path runs over the clients in chunks sized to the run's memory budget
(`p4bench.engine.chunking`): clients are independent, so the sums are the same for any
chunk size. The generic path takes each example's loss from the forward that computes
its gradient (no second forward).
"""

from __future__ import annotations

import torch
from torch.func import grad, vmap

from p4bench.data.federated import squared_norms
from p4bench.engine.chunking import clients_per_chunk
from p4bench.engine.training import PerExampleLoss, cross_entropy
from p4bench.models import LinearSoftmax, Model, Params, stacked
from p4bench.models.dropout import computes_training_gradients
from p4bench.privacy.isolation import current_changed, kept_mask
from p4bench.privacy.tape import current_tape

__all__ = ["clip_scale", "clipped_gradient_sum", "kept_linear_sum", "logit_gradients"]


@computes_training_gradients
def clipped_gradient_sum(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    loss: PerExampleLoss = cross_entropy,
    aux: torch.Tensor | None = None,
    sq_norms: torch.Tensor | None = None,
) -> tuple[Params, torch.Tensor]:
    """Sum over each client's batch of per-example gradients clipped to L2 norm `clip`
    (one norm across all parameters). Returns (sums (C, ...), per-example losses (C, b)).

    `sq_norms` (C, b), the squared norms of the flattened inputs, saves the linear
    path a pass over the batch when the caller has them precomputed; for a stacked model
    (C, b, R, R), the batch's first-layer input Grams (`p4bench.models.stacked.input_grams`).
    """
    if current_changed() is None:
        return _chunked_clipped_sum(model, params, x, y, mask, clip, loss, aux, sq_norms)
    # a run checked for record isolation (`p4bench.privacy.isolation`): the sum without the changed records too
    keep = kept_mask(x, mask)
    if type(model) is LinearSoftmax:  # from the same logit gradients: one more GEMM
        sums, losses, kept = _linear_clipped_sum(
            params, x, y, mask, clip, loss, aux, sq_norms, keep
        )
    else:
        sums, losses = _chunked_clipped_sum(model, params, x, y, mask, clip, loss, aux, sq_norms)
        kept = (
            None
            if keep is None
            else _chunked_clipped_sum(model, params, x, y, keep, clip, loss, aux, sq_norms)[0]
        )
    kept = sums if kept is None else kept
    tape = current_tape()
    if tape is not None:
        tape.clean([kept[k] for k in sorted(kept)])
    return sums, losses


def _chunked_clipped_sum(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
    sq_norms: torch.Tensor | None,
) -> tuple[Params, torch.Tensor]:
    """`clipped_gradient_sum` for one batch mask, in client chunks where memory needs them."""
    if type(model) is LinearSoftmax:  # per-example logit gradients only: (C, b, L), never chunked
        sums, losses, _ = _linear_clipped_sum(params, x, y, mask, clip, loss, aux, sq_norms)
        return sums, losses
    first = next(iter(params.values()))
    per_client = sum(int(v[0].numel()) for v in params.values())
    chunk = clients_per_chunk(
        len(x), per_client, int(y.shape[1]), first.element_size(), first.device
    )
    if chunk >= len(x):
        return _clipped_sum(model, params, x, y, mask, clip, loss, aux, sq_norms)
    parts = [
        _clipped_sum(
            model,
            {k: v[part] for k, v in params.items()},
            x[part],
            y[part],
            mask[part],
            clip,
            loss,
            None if aux is None else aux[part],
            None if sq_norms is None else sq_norms[part],
        )
        for part in (slice(start, start + chunk) for start in range(0, len(x), chunk))
    ]
    return {k: torch.cat([sums[k] for sums, _ in parts]) for k in parts[0][0]}, torch.cat(
        [losses for _, losses in parts]
    )


def _clipped_sum(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
    sq_norms: torch.Tensor | None,
) -> tuple[Params, torch.Tensor]:
    """`clipped_gradient_sum` for one chunk of clients (a non-linear model)."""
    if stacked.supports_stacked(model):  # ghost clipping on batched GEMMs, no per-example gradients
        # `sq_norms` of a stacked model: its first layer's per-sample input Grams (`stacked.input_grams`)
        return stacked.clipped_gradient_sum(model, params, x, y, mask, clip, loss, aux, sq_norms)  # type: ignore[arg-type]
    return _generic_clipped_sum(model, params, x, y, mask, clip, loss, aux)


def logit_gradients(
    logits: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-example dloss/dlogits (C, b, L), per-example losses (C, b)) for a per-example loss."""
    logits = logits.detach().requires_grad_(True)
    count, width, classes = logits.shape
    flat_aux = None if aux is None else aux.reshape(count * width, *aux.shape[2:])
    losses = loss(logits.reshape(count * width, classes), y.reshape(-1), flat_aux).reshape(
        count, width
    )
    (grads,) = torch.autograd.grad((losses * mask).sum(), logits)
    return grads, losses.detach()


def clip_scale(
    logit_grads: torch.Tensor, sq_norms: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """(C, b) factors min(1, C / ||g_i||) for a linear layer, where ||g_i||^2 = ||dlogits_i||^2 (||x_i||^2 + 1)."""
    norms = torch.sqrt(logit_grads.pow(2).sum(-1) * (sq_norms + 1.0))
    return (clip / norms.clamp_min(1e-12)).clamp(max=1.0) * mask


def _linear_clipped_sum(
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
    sq_norms: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[Params, torch.Tensor, Params | None]:
    """(sums, per-example losses, and with `keep` (C, b), the sums over its entries alone)."""
    features = x.flatten(start_dim=2)  # (C, b, d)
    weight, bias = params["weight"], params["bias"]  # (C, L, d), (C, L)
    logits = torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))
    logit_grads, losses = logit_gradients(logits, y, mask, loss, aux)
    with torch.no_grad():
        scale = clip_scale(
            logit_grads, squared_norms(x) if sq_norms is None else sq_norms, mask, clip
        )
        scaled = logit_grads * scale.unsqueeze(-1)
        sums = {"weight": torch.bmm(scaled.transpose(1, 2), features), "bias": scaled.sum(dim=1)}
        kept = None
        if (
            keep is not None
        ):  # each entry's term is its own: the kept sum drops the others' (where, not *: no NaN * 0)
            part = torch.where(
                (keep != 0).unsqueeze(-1), scaled, torch.zeros((), dtype=scaled.dtype)
            )
            kept = {"weight": torch.bmm(part.transpose(1, 2), features), "bias": part.sum(dim=1)}
    return sums, losses, kept


def _generic_clipped_sum(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    loss: PerExampleLoss,
    aux: torch.Tensor | None,
) -> tuple[Params, torch.Tensor]:
    def one_example(
        p: Params, xi: torch.Tensor, yi: torch.Tensor, ai: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        value = loss(
            model.forward(p, xi.unsqueeze(0)),
            yi.unsqueeze(0),
            None if ai is None else ai.unsqueeze(0),
        )[0]
        return value, value.detach()  # the loss rides along as aux: no second forward for it

    step = grad(one_example, has_aux=True)
    if aux is None:
        per_example, losses = vmap(
            vmap(lambda p, xi, yi: step(p, xi, yi, None), in_dims=(None, 0, 0))
        )(params, x, y)
    else:
        per_example, losses = vmap(vmap(step, in_dims=(None, 0, 0, 0)))(params, x, y, aux)
    with torch.no_grad():
        norms = torch.sqrt(sum(g.flatten(start_dim=2).pow(2).sum(-1) for g in per_example.values()))
        scale = (clip / norms.clamp_min(1e-12)).clamp(max=1.0) * mask
        sums = {k: torch.einsum("cb,cb...->c...", scale, g) for k, g in per_example.items()}
    return sums, losses


def kept_linear_sum(
    logit_grads: torch.Tensor, features: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor
) -> None:
    """For a fused linear kernel that clips inside its own GEMMs (`clip_scale`): inside a
    run checked for record isolation (`p4bench.privacy.isolation`), hand the tape the
    clipped sum of the batch without the changed records' own terms, as
    `clipped_gradient_sum` does; elsewhere nothing. `logit_grads` (C, b, L), `features`
    (C, b, d) the batch's flattened records, `scale` (C, b) the clipping factors."""
    changed, tape = current_changed(), current_tape()
    if changed is None or tape is None:
        return
    with torch.no_grad():
        keep = scale * ~changed.hits(features, mask)
        scaled = logit_grads * keep.unsqueeze(-1).to(logit_grads.dtype)
        tape.clean(
            [scaled.sum(dim=1), torch.bmm(scaled.transpose(1, 2), features)]
        )  # bias, weight: sorted names
