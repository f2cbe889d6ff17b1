"""The pieces of `p2p-fl` that read a client's validation split: the split itself, the
scores of every candidate model on it (batched over receivers and candidates, exact or
as a DP release) and the `LocalAverage` weighting policies (Karras et al., Alg. 2).

Everything is batched over the rows of a state: a (C receivers x K candidates) grid of
models is evaluated with nested `vmap` (for the linear model, batched matmuls), in a
few chunks of candidates when the grid is large; there is no loop over clients.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import vmap

from p4bench.data import ClientTensors
from p4bench.engine.training import gather_batch, poisson_batches
from p4bench.models import Model, Params
from p4bench.privacy.releases import Releases
from p4bench.rng import ClientRng

if TYPE_CHECKING:
    from p4bench.engine.method import StepContext

__all__ = [
    "POLICIES",
    "candidate_outcomes",
    "exact_scores",
    "policy_weights",
    "private_scores",
    "validation_split",
]

POLICIES = ("uniform", "acc-weighted", "softmax-loss", "top-k", "threshold")
# Inputs (receivers x candidates x records x features) evaluated per forward call: bounds
# the activations of the grid's forward pass (a CNN's are tens of times its input).
_FORWARD_BUDGET = 1 << 23
# Under DP a record's loss enters its score release clipped to LOSS_CAP_FACTOR * ln(L)
# (a uniform guess over L classes scores ln L), so its contribution is bounded.
LOSS_CAP_FACTOR = 2.0


# -- the split -------------------------------------------------------------------------------
def validation_split(
    train: ClientTensors, keys: torch.Tensor, fraction: float
) -> tuple[ClientTensors, ClientTensors]:
    """(fit, validation) of every row: each record goes to the validation split with
    probability `fraction`, by a coin of the row's own split stream (`keys`, (C, 2) Philox
    words drawn once from the client's stream). Independent coins keep the DP analysis
    per record: adding a record puts it in one split and moves no other record. The coin of
    a record depends only on its slot, so the split is the same in every round and runtime."""
    width = train.y.shape[1]
    coins = ClientRng(keys).uniform(max(width, 1))[:, :width]
    real = torch.arange(width) < train.n.unsqueeze(1)
    held_out = (coins < fraction) & real
    return _compact(train, real & ~held_out), _compact(train, held_out)


def _compact(data: ClientTensors, chosen: torch.Tensor) -> ClientTensors:
    """The `chosen` records of every row, moved to the front (order kept) and padded."""
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)
    count = chosen.sum(dim=1)
    index = order[:, : max(int(count.max()) if len(count) else 0, 1)]
    return ClientTensors(gather_batch(data.x, index), gather_batch(data.y, index), count)


# -- scores ------------------------------------------------------------------------------------
def candidate_outcomes(
    model: Model, candidates: Params, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, loss), each (C, K, n): every candidate model k of receiver i (`candidates`
    (C, K, ...) per tensor) on receiver i's records x (C, n, ...), y (C, n)."""
    count, slots = next(iter(candidates.values())).shape[:2]
    per_input = max(1, count * x.shape[1] * math.prod(x.shape[2:]))
    chunk = max(1, _FORWARD_BUDGET // per_input)
    forward = vmap(vmap(model.forward, in_dims=(0, None)))  # over receivers, then their candidates
    correct, loss = [], []
    with torch.no_grad():
        for start in range(
            0, slots, chunk
        ):  # a few chunks of candidates, only when the grid is large
            logits = forward({k: v[:, start : start + chunk] for k, v in candidates.items()}, x)
            labels = y.unsqueeze(1).expand(*logits.shape[:3])
            correct.append((logits.argmax(dim=-1) == labels).float())
            loss.append(
                F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(
                    labels.shape
                )
            )
    return torch.cat(correct, dim=1), torch.cat(loss, dim=1)


def exact_scores(
    model: Model, candidates: Params, validation: ClientTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accuracy, mean loss), each (C, K) float64, of every candidate on the receiver's
    whole validation split (non-private runs); NaN where a split is empty."""
    correct, loss = candidate_outcomes(model, candidates, validation.x, validation.y)
    mask = (torch.arange(validation.y.shape[1]) < validation.n.unsqueeze(1)).unsqueeze(1)
    size = validation.n.double().unsqueeze(1)
    size = torch.where(size > 0, size, torch.nan)
    return (correct * mask).sum(-1).double() / size, (loss * mask).sum(-1).double() / size


def private_scores(
    ctx: StepContext,
    model: Model,
    candidates: Params,
    validation: ClientTensors,
    present: torch.Tensor,
    use_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (C, K) float64, released (C,) bool): a DP estimate of every candidate's
    validation accuracy (or, with `use_loss`, mean loss) as ONE ledger release per row.

    A Poisson sample of the validation split at the run's rate s (what the accountant
    analyses, the same rate as the training steps); each sampled record contributes its
    vector of per-candidate outcomes in [0, 1] (correct, or loss / cap), scaled by
    clip / sqrt(K) so that its L2 norm is at most the clip norm; the sum gets the
    mechanism's Gaussian noise (`Releases`: budget check, ledger, noise from the row's
    own stream) and is divided by the expected sample size s * |V_i|. The noise of one
    score is sigma sqrt(K) / (s |V_i|): small validation splits give noisy scores.
    Rows the budget refuses get no scores (`released` False)."""
    assert ctx.dp is not None, "private scores are for private runs"
    rate = float(ctx.config.data_rate)
    index, sampled = poisson_batches(ctx.rng, validation.n, rate)
    x, y = gather_batch(validation.x, index), gather_batch(validation.y, index)
    correct, loss = candidate_outcomes(model, candidates, x, y)
    cap = 1.0
    if use_loss:
        cap = LOSS_CAP_FACTOR * math.log(max(int(model.num_classes), 2))
        values = loss.clamp(max=cap) / cap
    else:
        values = correct
    slots = values.shape[1]
    scale = float(ctx.dp.settings.clip) / math.sqrt(slots)
    sums = {"scores": (values * sampled.unsqueeze(1) * present.unsqueeze(2)).sum(-1) * scale}
    with Releases(ctx.dp, ctx, rate) as releases:
        released = releases.admitted[0]
        noisy = releases.add_noise(sums, rate * validation.n.double())
    return noisy["scores"].double() * (cap / scale), released


# -- the LocalAverage policies ------------------------------------------------------------------
def policy_weights(
    policy: str,
    accuracy: torch.Tensor,
    loss: torch.Tensor,
    present: torch.Tensor,
    own: torch.Tensor,
    *,
    tau: float = 0.1,
    top_k: int = 3,
) -> torch.Tensor:
    """(C, K) float64 weights of each receiver's candidates (rows sum to 1, zero for
    candidates not `present`). `accuracy`/`loss` (C, K) are validation scores, `own` (C,)
    the column of each receiver's own model, which every policy keeps:

    - uniform: equal weights (all-to-all FedAvg; reads no scores);
    - acc-weighted: w_j proportional to accuracy_j (negative noisy scores count as 0;
      a row whose scores are all 0 falls back to uniform);
    - softmax-loss: w_j proportional to exp(-loss_j / tau);
    - top-k: the `top_k` best by accuracy (ties: lower column first), plus the own model,
      averaged uniformly;
    - threshold: the candidates scoring at least the own model's accuracy, averaged uniformly.

    A row whose scores are all NaN (an empty validation split, or a score release the
    budget refused) gets uniform weights.
    """
    rows = torch.arange(len(present))
    present = present.clone()
    present[rows, own] = True
    mask = present.double()
    used = loss if policy == "softmax-loss" else accuracy
    unscored = torch.isnan(used).all(dim=1, keepdim=True)
    if policy == "uniform":
        weights = mask
    elif policy == "acc-weighted":
        weights = torch.nan_to_num(accuracy.double(), nan=0.0).clamp_min(0.0) * mask
        weights = torch.where(weights.sum(1, keepdim=True) > 0, weights, mask)
    elif policy == "softmax-loss":
        logits = torch.nan_to_num(-loss.double() / tau, nan=-torch.inf).masked_fill(
            ~present, -torch.inf
        )
        weights = torch.softmax(logits, dim=1)
    elif policy in ("top-k", "threshold"):
        score = torch.nan_to_num(accuracy.double(), nan=-torch.inf).masked_fill(
            ~present, -torch.inf
        )
        if policy == "top-k":
            order = torch.argsort(-score, dim=1, stable=True)[:, : max(1, top_k)]
            kept = torch.zeros_like(present).scatter_(1, order, True) & present
        else:
            kept = present & (score >= score[rows, own].unsqueeze(1))
        kept[rows, own] = True
        weights = kept.double()
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    weights = torch.where(unscored, mask, weights)
    return weights / weights.sum(dim=1, keepdim=True)
