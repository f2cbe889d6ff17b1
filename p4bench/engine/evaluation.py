"""Per-client evaluation beyond accuracy: test loss and macro one-vs-rest ROC AUC
(a method asks for them with `Method.test_metrics`), and the client-side gate of a
defense like accept-if-better, batched over clients."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine.state import State, put_rows, take_rows
from p4bench.engine.training import accuracy, logits_of
from p4bench.models import Model, Params

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.engine.method import Method
    from p4bench.engine.threats import Defense

TEST_METRICS = ("loss", "auc")


def _masked(y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.arange(y.shape[1]) < n.unsqueeze(1)


@torch.no_grad()
def test_loss(logits: torch.Tensor, y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(C,) mean cross-entropy of each client's logits (C, n, L) on its labels (NaN: none)."""
    mask = _masked(y, n)
    labels = y.clamp(0, logits.shape[-1] - 1)
    per = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).double(), labels.flatten(), reduction="none"
    ).view_as(y)
    total = (per * mask).sum(dim=1)
    return torch.where(n > 0, total / n.clamp_min(1).double(), torch.nan)


@torch.no_grad()
def macro_auc(logits: torch.Tensor, y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(C,) macro one-vs-rest ROC AUC (Mann-Whitney, ties counted one half) of each
    client, over the classes that have both positives and negatives in its split (NaN if
    none). Ranks come from one batched sort; no loop over clients or classes."""
    mask = _masked(y, n)
    classes = logits.shape[-1]
    scores = torch.softmax(logits.double(), dim=-1).transpose(1, 2)  # (C, L, n)
    scores = scores.masked_fill(
        ~mask.unsqueeze(1), torch.inf
    )  # padding sorts last, below nothing real
    ordered = scores.sort(dim=-1).values.contiguous()
    below = torch.searchsorted(ordered, scores.contiguous(), right=False).double()
    upto = torch.searchsorted(ordered, scores.contiguous(), right=True).double()
    rank = (below + upto + 1) / 2  # average 1-based rank among the real samples
    positive = (y.unsqueeze(1) == torch.arange(classes).view(1, -1, 1)) & mask.unsqueeze(
        1
    )  # (C, L, n)
    pos = positive.sum(dim=-1).double()
    neg = n.double().unsqueeze(1) - pos
    rank_sum = (rank * positive).sum(dim=-1)
    auc = (rank_sum - pos * (pos + 1) / 2) / (pos * neg).clamp_min(1)
    defined = (pos > 0) & (neg > 0)
    count = defined.sum(dim=1)
    return torch.where(count > 0, (auc * defined).sum(dim=1) / count.clamp_min(1), torch.nan)


def test_metrics(
    model: Model,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    n: torch.Tensor,
    names: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    """{f"test_{name}": (C,)} for each requested name in `TEST_METRICS`."""
    if not names or x.shape[0] == 0:
        return {f"test_{name}": torch.zeros(0, dtype=torch.float64) for name in names}
    logits = logits_of(model, params, x)
    compute = {"loss": test_loss, "auc": macro_auc}
    return {f"test_{name}": compute[name](logits, y, n) for name in names}


def gate_received(
    defense: Defense,
    method: Method,
    model: Model,
    data: ClientTensors,
    before: State,
    received: State,
    metrics: dict[str, float],
) -> State:
    """`received` (the state after a `receive`), except the rows whose deployed model
    changed and which `defense.accept` refuses, given both models' accuracy on the rows'
    own records `data`: those keep `before`. Counts `gate.judged` / `gate.rejected`."""
    old_params, new_params = method.deployed_params(before), method.deployed_params(received)
    changed = torch.zeros(data.n.shape[0], dtype=torch.bool)
    for key, value in new_params.items():
        changed |= (value != old_params[key]).flatten(1).any(dim=1)
    if not bool(changed.any()):
        return received
    old = accuracy(model, old_params, data.x, data.y, data.n)
    new = accuracy(model, new_params, data.x, data.y, data.n)
    rejected = (changed & ~defense.accept(new, old)).nonzero().squeeze(1)
    metrics["gate.judged"] = metrics.get("gate.judged", 0.0) + float(changed.sum())
    metrics["gate.rejected"] = metrics.get("gate.rejected", 0.0) + float(len(rejected))
    return put_rows(received, rejected, take_rows(before, rejected)) if len(rejected) else received
