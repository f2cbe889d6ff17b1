"""PDSL's coalition values on a model linear in its parameters: no forward per coalition.

A coalition S of agent a is worth the accuracy on Q of x_a - lr mean_{j in S} g_aj. When
the logits are linear in the parameters (the built-in linear model: f(u + v) = f(u) + f(v)),
its logits are

    f(x_a) - (lr / |S|) sum_{j in S} f(g_aj),

so the A base models and the A K candidate gradients go through the forward once each,
and a coalition's prediction follows from a sum over its members alone: with
H_j = f(g_aj) - f(x_a) / lr, sum_{j in S} H_j = -(|S| / lr) (S's logits), whose smallest
class is the logits' largest. Monte-Carlo prefixes and exact Shapley's subsets come in
chains: each coalition but the first of a chain is a *parent* coalition plus one player,
so its sum is the parent's plus one (L, |Q|) block (`parents`): one addition per
coalition instead of a forward of |Q| x d x L. Coalitions without a parent among the
requested ones are summed directly.

Equal to the per-coalition forward (`p4bench.baselines.shapley.coalition_values`' generic
path) up to float rounding, except at ties: a sample whose label ties the largest logit
counts as correct here, where the generic path's argmax takes the first tied class.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from p4bench.engine.state import unvectorize
from p4bench.models import LinearSoftmax, Model

__all__ = ["linear_coalition_values", "linear_in_parameters", "parents"]

CHUNK_COALITIONS = 512  # coalitions per chunk of agents: a size's sums stay in cache (tens of rows)


def linear_in_parameters(model: Model) -> bool:
    """Whether the model's logits are linear in its parameters (f(u + v) = f(u) + f(v)):
    the built-in linear model's own forward, checked by type, not declared by a plugin."""
    return isinstance(model, LinearSoftmax) and type(model).forward is LinearSoftmax.forward


@torch.no_grad()
def linear_coalition_values(
    model: Model, like: Mapping[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor, lr: float,
    q_x: torch.Tensor, q_y: torch.Tensor, q_n: torch.Tensor | None, agent: torch.Tensor, members: torch.Tensor,
    chains: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """(U,) float64 accuracy of the distinct coalitions (`agent` (U,) sorted, `members`
    (U, K)), arguments as `coalition_values`; `chains` from `parents` (None: none known).

    The bookkeeping (which coalitions, in which chunk and order) is read to the host once
    (on a GPU every read is a synchronisation) and drives the device's work from there."""
    num_agents, slots, size = g.shape
    device = g.device
    count = members.sum(dim=1)
    parent, added = chains if chains is not None else (torch.full_like(agent, -1), torch.full_like(agent, -1))
    agent_h, count_h, parent_h, added_h = torch.stack([agent, count, parent, added]).cpu()  # the one read
    orphans = bool(((parent_h < 0) & (count_h > 0)).any())  # coalitions without a parent (rare): a second read
    members_h = members.cpu() if orphans else None
    values = torch.zeros(len(agent), dtype=torch.float64, device=device)
    shared = q_n is None
    width = q_y.shape[-1]
    per_agent = torch.bincount(agent_h, minlength=num_agents)
    starts = torch.cumsum(per_agent, 0) - per_agent
    for first, last in _agent_chunks(per_agent.tolist(), CHUNK_COALITIONS):
        lo, hi = int(starts[first]), int(starts[last - 1] + per_agent[last - 1])
        if hi == lo:
            continue
        base, candidates = _logits(like, x[first:last], g[first:last], q_x if shared else q_x[first:last], shared)
        # H_j = f(g_j) - f(x_a) / lr: sum_{j in S} H_j = -(|S| / lr) (the coalition's logits), so
        # its smallest class is the logits' largest, and no base or 1/|S| is applied per coalition
        candidates.sub_(base.unsqueeze(1), alpha=1.0 / lr)
        owner = agent[lo:hi]
        if q_n is None:
            labels, real = q_y.view(1, width), None
        else:  # each agent's own validation set, padded
            labels, real = q_y[first:last], torch.arange(width, device=q_y.device) < q_n[first:last, None]
        chunk = _Chunk(agent_h[lo:hi] - first, count_h[lo:hi], parent_h[lo:hi] - lo, added_h[lo:hi],
                       None if members_h is None else members_h[lo:hi])
        right = _correct_counts(candidates, chunk, labels, real)
        total = torch.full_like(right, width) if q_n is None else q_n[owner].clamp_min(1)
        values[lo:hi] = right.double() / total.double()  # empty coalitions: 0 right
    return values


@dataclass(frozen=True)
class _Chunk:
    """A chunk's coalitions on the host: agent (within the chunk), size, parent (row within
    the chunk, negative: none), the member added to the parent, and the members (only where
    some coalition has no parent)."""

    agent: torch.Tensor
    count: torch.Tensor
    parent: torch.Tensor
    added: torch.Tensor
    members: torch.Tensor | None


def _agent_chunks(per_agent: list[int], capacity: int) -> Iterator[tuple[int, int]]:
    """Consecutive agent ranges [first, last) holding at most `capacity` coalitions (at least one agent)."""
    first, held = 0, 0
    for a, n in enumerate(per_agent):
        if held and held + n > capacity:
            yield first, a
            first, held = a, 0
        held += n
    if first < len(per_agent):
        yield first, len(per_agent)


def _logits(like: Mapping[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor, q_x: torch.Tensor,
            shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(base (a, L, |Q|), candidates (a, K, L, |Q|)): the logits of the agents' models and of
    their candidate gradients on Q (`shared`) or on each agent's own, classes before
    samples. The linear model's forward written as one product per validation set: the
    stacked weights of all models against Q's flattened samples."""
    agents, slots, size = g.shape
    base = _linear_logits(unvectorize(x, like), q_x, agents, 1, shared)[:, 0]
    candidates = _linear_logits(unvectorize(g.reshape(agents * slots, size), like), q_x, agents, slots, shared)
    return base, candidates


def _linear_logits(params: Mapping[str, torch.Tensor], q_x: torch.Tensor, agents: int, per_agent: int,
                   shared: bool) -> torch.Tensor:
    """(agents, per_agent, L, |Q|) logits of `params` (agents * per_agent linear models, each
    agent's together) on Q or on each agent's own: W X^T + b, contiguous."""
    weight, bias = params["weight"], params["bias"]  # (agents per_agent, L, d), (agents per_agent, L)
    classes, dim = weight.shape[1], weight.shape[2]
    if shared:
        samples = q_x.reshape(len(q_x), dim)
        logits = (weight.reshape(-1, dim) @ samples.T).view(agents, per_agent, classes, len(samples))
    else:
        samples = q_x.reshape(agents, q_x.shape[1], dim)
        logits = torch.bmm(weight.reshape(agents, per_agent * classes, dim), samples.transpose(1, 2))
        logits = logits.view(agents, per_agent, classes, samples.shape[1])
    return logits.add_(bias.reshape(agents, per_agent, classes, 1))


def parents(agent: torch.Tensor, members: torch.Tensor, num_agents: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(parent (U,), added (U,)): for each distinct coalition (sorted by agent, then by its
    members' bits, as `_distinct_coalitions` returns them), a coalition of the same agent
    among them holding all its members but `added`, or -1 where there is none. None where
    the coalitions cannot be packed in one integer key (then none is known)."""
    rows, slots = members.shape
    if not rows or slots + max(num_agents, 1).bit_length() > 62:
        return None
    bits = torch.ones(slots, dtype=torch.int64, device=members.device) << torch.arange(slots, device=members.device)
    keys = (agent << slots) | (members.long() * bits).sum(dim=1)  # ascending: the order of the distinct rows
    without = keys[:, None] ^ bits[None, :]  # (U, K): the key with member k removed (meaningful where held)
    position = torch.searchsorted(keys, without).clamp_max(rows - 1)
    found = (keys[position] == without) & members
    first = found.to(torch.int8).argmax(dim=1)
    has = found.any(dim=1)
    parent = torch.where(has, position.gather(1, first[:, None]).squeeze(1), torch.full_like(keys, -1))
    return parent, torch.where(has, first.long(), torch.full_like(keys, -1))


def _correct_counts(candidates: torch.Tensor, chunk: _Chunk, labels: torch.Tensor,
                    real: torch.Tensor | None) -> torch.Tensor:
    """(rows,) int64 on the device: how many samples of Q each coalition's model classifies
    right (of the `real` ones (a, |Q|) of its agent's own set, where given).

    The coalitions' sums of candidate blocks go size by size (a coalition of size t is its
    parent's sum, at size t - 1, plus one block; one without a parent among the requested
    coalitions sums its members directly), each size scored as soon as it is summed and
    only the size below kept: two small buffers, reused, instead of every coalition's
    (L, |Q|) block (which would make each pass a trip to memory). A tie between the label
    and another class counts as correct (the generic path's argmax takes the first)."""
    device = candidates.device
    agents, slots, classes, width = candidates.shape
    rows = len(chunk.count)
    flat = candidates.reshape(-1, classes * width)  # (a K, L |Q|): a block is one contiguous row
    # each block's entries at the samples' labels, summed along the same chains (a gather
    # per coalition would cost as much as the rest)
    wanted = labels.view(-1, 1, 1, width).expand(agents, slots, 1, width)
    at_label = candidates.gather(2, wanted).reshape(-1, width)  # (a K, |Q|)
    order = torch.argsort(chunk.count, stable=True)  # host: rows of one size contiguous, sizes ascending
    position = torch.empty_like(order)
    position[order] = torch.arange(rows, device=order.device)  # host (the run may default to its device)
    sizes = torch.bincount(chunk.count, minlength=1).tolist()
    largest = max(sizes[1:], default=0)
    below, current, picked = (flat.new_empty(largest, classes * width) for _ in range(3))
    label_below, label_current = (flat.new_empty(largest, width) for _ in range(2))
    right = torch.zeros(rows, dtype=torch.int64, device=device)
    start, below_start = sizes[0], 0  # empty coalitions are worth 0 (`right` stays 0)
    for size in range(1, len(sizes)):  # ascending: every parent is summed before its children
        level = order[start : start + sizes[size]]
        sums, label_sums = current[: len(level)], label_current[: len(level)]
        chained = chunk.parent[level] >= 0
        if size == 1:  # one member: its block (the parent, when requested, is the empty coalition)
            assert chunk.members is not None or bool(chained.all())
            member = chunk.added[level] if bool(chained.all()) else chunk.members[level].to(torch.int8).argmax(dim=1)  # type: ignore[index]
            block = (chunk.agent[level] * slots + member).to(device)
            torch.index_select(flat, 0, block, out=sums)
            torch.index_select(at_label, 0, block, out=label_sums)
        elif bool(chained.all()):
            above = (position[chunk.parent[level]] - below_start).to(device)
            block = (chunk.agent[level] * slots + chunk.added[level]).to(device)
            torch.index_select(below, 0, above, out=sums)
            sums.add_(torch.index_select(flat, 0, block, out=picked[: len(level)]))
            torch.index_select(label_below, 0, above, out=label_sums)
            label_sums.add_(at_label[block])
        else:  # some coalitions have no parent among the requested ones (rare)
            assert chunk.members is not None
            _sum_members(sums, label_sums, flat, at_label, below, label_below, chunk.members[level], chained,
                         position[chunk.parent[level]] - below_start, chunk.agent[level] * slots, chunk.added[level])
        smallest = sums.view(len(level), classes, width).amin(dim=1)
        correct = label_sums <= smallest  # the smallest sum is the prediction
        where = level.to(device)
        right[where] = (correct if real is None else correct & real[chunk.agent[level].to(device)]).sum(dim=1)
        below, current, label_below, label_current = current, below, label_current, label_below
        below_start, start = start, start + sizes[size]
    return right


def _sum_members(sums, label_sums, flat, at_label, below, label_below, members, chained, above, first, added) -> None:
    """A size's sums where some coalitions have no parent: a parent's sum plus one block
    where there is one, the members' blocks summed slot by slot where not (host indices)."""
    device = sums.device
    sums.zero_()
    label_sums.zero_()
    linked = chained.nonzero().flatten()
    if len(linked):
        above_d, block = above[linked].to(device), (first[linked] + added[linked]).to(device)
        sums[linked.to(device)] = below[above_d] + flat[block]
        label_sums[linked.to(device)] = label_below[above_d] + at_label[block]
    roots = (~chained).nonzero().flatten()
    for slot in range(members.shape[1]):  # a loop over neighbourhood slots, not agents
        holding = roots[members[roots, slot]]
        if len(holding):
            block, where = (first[holding] + slot).to(device), holding.to(device)
            sums[where] += flat[block]
            label_sums[where] += at_label[block]
