"""PDSL's coalition values on a model linear in its parameters: no forward per coalition.

A coalition S of agent a is worth the accuracy on Q of x_a - lr mean_{j in S} g_aj. When
the logits are linear in the parameters (the built-in linear model: f(u + v) = f(u) + f(v)),
its logits are

    f(x_a) - (lr / |S|) sum_{j in S} f(g_aj),

and a coalition's prediction follows from a sum over its members alone: with
H_j = f(g_aj) - f(x_a) / lr = f(g_aj - x_a / lr), sum_{j in S} H_j = -(|S| / lr) (S's
logits), whose smallest class is the logits' largest. Each candidate's block is its
margins against the label, H_c - H_label for the other classes (one product per label
group of Q), and a coalition is right on a sample exactly where its members' margins sum
to no negative class. Monte-Carlo prefixes and exact Shapley's subsets come in chains: each
coalition but the first of a chain is a *parent* coalition plus one player (`parents`), so
its sum is the parent's plus one block (`p4bench_pdsl.shapley_rows`): one addition per
coalition instead of a forward of |Q| x d x L.

Equal to the per-coalition forward (`p4bench_pdsl.shapley.coalition_values`' generic
path) up to float rounding, except at ties: a sample whose label ties the largest logit
counts as correct here, where the generic path's argmax takes the first tied class.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from p4bench.engine.state import unvectorize
from p4bench.engine.training import Workspace
from p4bench.models import LinearSoftmax, Model
from p4bench_pdsl.shapley_rows import correct_counts, plan_rows

__all__ = ["linear_coalition_values", "linear_in_parameters", "parents"]

CHUNK_ROWS = 40  # buffer rows per chunk of agents: a size's sums stay in cache


def linear_in_parameters(model: Model) -> bool:
    """Whether the model's logits are linear in its parameters (f(u + v) = f(u) + f(v)):
    the built-in linear model's own forward, checked by type, not declared by a plugin."""
    return isinstance(model, LinearSoftmax) and type(model).forward is LinearSoftmax.forward


@torch.no_grad()
def linear_coalition_values(
    model: Model,
    like: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    q_x: torch.Tensor,
    q_y: torch.Tensor,
    q_n: torch.Tensor | None,
    agent: torch.Tensor,
    members: torch.Tensor,
    chains: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """(U,) float64 accuracy of the distinct coalitions (`agent` (U,) sorted, `members`
    (U, K)), arguments as `coalition_values`; `chains` from `parents` (None: none known).

    The bookkeeping (which coalitions, in which chunk and order) is read to the host once
    (on a GPU every read is a synchronisation) and drives the device's work from there."""
    num_agents, slots, size = g.shape
    device = g.device
    count = members.sum(dim=1)
    parent, added = (
        chains if chains is not None else (torch.full_like(agent, -1), torch.full_like(agent, -1))
    )
    agent_h, count_h, parent_h, added_h = (
        torch.stack([agent, count, parent, added]).cpu().numpy()
    )  # the one read
    orphans = bool(
        ((parent_h < 0) & (count_h > 0)).any()
    )  # coalitions without a parent (rare): a second read
    plan = plan_rows(
        agent_h, count_h, parent_h, added_h, members.cpu().numpy() if orphans else None, num_agents
    )
    values = torch.zeros(len(agent), dtype=torch.float64, device=device)
    classes, width = int(like["bias"].shape[-1]), q_y.shape[-1]
    groups = (
        None if q_n is not None else _LabelGroups(q_x, q_y, classes)
    )  # a shared Q: sorted by label once
    rows_per_block = classes - 1 if groups is not None else classes
    per_agent = np.bincount(agent_h, minlength=num_agents)
    starts = np.cumsum(per_agent) - per_agent
    step = max(1, CHUNK_ROWS // plan.capacity)
    workspace = (
        Workspace()
    )  # buffers reused by every chunk: a fresh one costs its page faults each time
    for first in range(0, num_agents, step):
        last = min(first + step, num_agents)
        lo, hi = int(starts[first]), int(starts[last - 1] + per_agent[last - 1])
        if hi == lo:
            continue
        weights = _candidate_weights(like, x[first:last], g[first:last], lr)
        out = workspace.get(
            "shapley.blocks",
            ((last - first) * slots * rows_per_block, width),
            g.dtype,
            device=device,
        )
        if groups is not None:
            groups.margins(weights, out)
        else:  # each agent's own validation set, padded
            assert q_n is not None
            real = torch.arange(width, device=q_y.device) < q_n[first:last, None]
            _own_margins(weights, q_x[first:last], q_y[first:last], real, out)
        right = correct_counts(
            out.view((last - first) * slots, -1),
            width,
            plan,
            lo,
            hi,
            first,
            last - first,
            slots,
            workspace,
        )
        total = (
            torch.full_like(right, width)
            if q_n is None
            else q_n[agent[lo:hi]].clamp_min(1).double()
        )
        values[lo:hi] = right / total  # empty coalitions: 0 right
    return values


def _candidate_weights(
    like: Mapping[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor, lr: float
) -> torch.Tensor:
    """(a, K, L, d + 1): the weights and bias of g_j - x_a / lr, whose logits on a sample are
    H_j = f(g_j) - f(x_a) / lr (f is linear in its parameters). Then sum_{j in S} H_j =
    -(|S| / lr) (S's logits): a coalition's smallest class is its logits' largest, with no
    base model or 1/|S| applied per coalition. The bias as the weight of one more input, 1."""
    agents, slots, size = g.shape
    params = unvectorize((g - x[:, None, :] / lr).reshape(agents * slots, size), like)
    weight, bias = params["weight"], params["bias"]  # (a K, L, d), (a K, L)
    return torch.cat([weight, bias.unsqueeze(-1)], dim=-1).view(agents, slots, weight.shape[1], -1)


class _LabelGroups:
    """A shared Q sorted by label (a count over Q does not depend on its order), so each
    candidate's margins against the label, D_c = H_c - H_label for the L - 1 other classes,
    are one product per label: (w_c - w_label) against that label's samples. A coalition's
    model is right on a sample exactly where no class's sum of margins is negative (a tie
    with the label counts as right; the generic path's argmax takes the first tied class)."""

    def __init__(self, q_x: torch.Tensor, q_y: torch.Tensor, classes: int) -> None:
        order = torch.argsort(q_y, stable=True)
        samples = q_x[order].reshape(len(q_y), -1)
        self.samples = torch.cat(
            [samples, samples.new_ones(len(q_y), 1)], dim=1
        )  # (|Q|, d + 1), grouped by label
        counts = torch.bincount(q_y, minlength=classes).tolist()  # one read per call
        ends = np.cumsum(counts)
        self.groups = [
            (label, int(end - n), int(end)) for label, (n, end) in enumerate(zip(counts, ends)) if n
        ]

    def margins(self, weights: torch.Tensor, out: torch.Tensor) -> None:
        """`out` (a K (L - 1), |Q|): each candidate's margins, L - 1 rows per candidate."""
        agents, slots, classes, inputs = weights.shape
        rows = out.view(agents * slots * (classes - 1), -1)
        flat = weights.view(-1, classes, inputs)
        for (
            label,
            start,
            end,
        ) in self.groups:  # w_c - w_label for the classes c before and after the label
            difference = torch.cat([flat[:, :label], flat[:, label + 1 :]], dim=1).sub_(
                flat[:, label : label + 1]
            )
            torch.mm(difference.view(-1, inputs), self.samples[start:end].T, out=rows[:, start:end])


def _own_margins(
    weights: torch.Tensor,
    q_x: torch.Tensor,
    q_y: torch.Tensor,
    real: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`out` (a K L, |Q|): each candidate's margins D_c = H_c - H_label on its agent's own
    validation set (L rows per candidate, the label's exactly 0). Padded samples (not
    `real`) get -1 everywhere: never right."""
    agents, slots, classes, inputs = weights.shape
    samples = q_x.reshape(agents, q_x.shape[1], -1)
    samples = torch.cat([samples, samples.new_ones(agents, samples.shape[1], 1)], dim=2)
    torch.bmm(
        weights.view(agents, slots * classes, inputs),
        samples.transpose(1, 2),
        out=out.view(agents, slots * classes, -1),
    )
    blocks = out.view(agents, slots, classes, -1)
    width = blocks.shape[-1]
    blocks.sub_(blocks.gather(2, q_y.view(agents, 1, 1, width).expand(agents, slots, 1, width)))
    blocks.masked_fill_(~real[:, None, None, :], -1.0)


def parents(
    agent: torch.Tensor, members: torch.Tensor, num_agents: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(parent (U,), added (U,)): for each distinct coalition (sorted by agent, then by its
    members' bits, as `_distinct_coalitions` returns them), a coalition of the same agent
    among them holding all its members but `added`, or -1 where there is none. None where
    the coalitions cannot be packed in one integer key (then none is known)."""
    rows, slots = members.shape
    if not rows or slots + max(num_agents, 1).bit_length() > 62:
        return None
    bits = torch.ones(slots, dtype=torch.int64, device=members.device) << torch.arange(
        slots, device=members.device
    )
    keys = (agent << slots) | (members.long() * bits).sum(
        dim=1
    )  # ascending: the order of the distinct rows
    without = (
        keys[:, None] ^ bits[None, :]
    )  # (U, K): the key with member k removed (meaningful where held)
    position = torch.searchsorted(keys, without).clamp_max(rows - 1)
    found = (keys[position] == without) & members
    first = found.to(torch.int8).argmax(dim=1)
    has = found.any(dim=1)
    parent = torch.where(
        has, position.gather(1, first[:, None]).squeeze(1), torch.full_like(keys, -1)
    )
    return parent, torch.where(has, first.long(), torch.full_like(keys, -1))
