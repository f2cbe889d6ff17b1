"""Accept-if-better and the merge of concurrent synergies, batched over peers.

Every peer scores its own model and each average it received this round on its
validation split in one batched evaluation (candidates stacked along a second axis);
no loop over peers or candidates in the model math.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from p4bench.data import ClientTensors
from p4bench.engine.state import unvectorize, vectorize
from p4bench.models import Model, Params

MERGES = ("best", "mean")
# (accuracy, mean loss), each (C, K), of K candidates per row on the rows' validation splits
Scorer = Callable[[Model, Params, ClientTensors], tuple[torch.Tensor, torch.Tensor]]


def merge_candidates(
    model: Model,
    params: Params,
    averages: list[list[torch.Tensor]],
    validation: ClientTensors,
    scorer: Scorer,
    *,
    gate: bool,
    rule: str,
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """(new params, accepted (C,), refused (C,)): each row's model after this round's
    averages `averages[i]` (flat float64 vectors), by accept-if-better (`gate`: an
    average is accepted when its validation accuracy is at least the own model's) and the
    merge `rule` (best: the best accepted average; mean: the mean of the accepted ones)."""
    count = len(averages)
    most = max((len(a) for a in averages), default=0)
    zero = torch.zeros(count, dtype=torch.int64)
    if most == 0:
        return params, zero, zero
    own = vectorize(params)
    grid = own.double().unsqueeze(1).repeat(1, most + 1, 1)  # slot 0: the own model
    present = torch.zeros(count, most + 1, dtype=torch.bool)
    present[:, 0] = True
    for i, received in enumerate(averages):
        if received:
            grid[i, 1 : 1 + len(received)] = torch.stack(received)
            present[i, 1 : 1 + len(received)] = True
    flat = unvectorize(grid.to(own.dtype).reshape(count * (most + 1), -1), params)
    candidates = {k: v.reshape(count, most + 1, *v.shape[1:]) for k, v in flat.items()}
    accuracy, _ = scorer(model, candidates, validation)
    accuracy = torch.nan_to_num(accuracy, nan=0.0)
    accepted = present.clone()
    accepted[:, 0] = False
    if gate:
        accepted &= accuracy >= accuracy[:, :1]
    if rule == "best":
        scores = torch.where(accepted, accuracy, -torch.inf)
        best = scores.argmax(dim=1)
        chosen = grid[torch.arange(count), best]
    else:
        weights = accepted.double()
        chosen = (weights.unsqueeze(2) * grid).sum(dim=1) / weights.sum(
            dim=1, keepdim=True
        ).clamp_min(1)
    changed = accepted.any(dim=1)
    merged = torch.where(changed.unsqueeze(1), chosen, own.double()).to(own.dtype)
    refused = (present[:, 1:] & ~accepted[:, 1:]).sum(dim=1)
    return unvectorize(merged, params), changed.long(), refused
