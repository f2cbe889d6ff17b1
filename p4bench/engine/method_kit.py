"""Small pieces the baselines share: batches and (DP) gradients, the local step size of
Noble et al.'s code, graphs from the topology harness, and weighted sums of inboxes.

Everything is batched over the rows of a state (no loop over clients).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.engine.messages import UPDATE_PREFIX, Messages, prefixed_keys
from p4bench.engine.state import unvectorize
from p4bench.engine.training import (
    gather_batch,
    noble_local_lr,
    sample_batches,
)  # noble_local_lr: re-exported
from p4bench.errors import ConfigError
from p4bench.models import Params

if TYPE_CHECKING:
    from p4bench.data import ClientTensors
    from p4bench.engine.method import StepContext
    from p4bench.engine.training import TrainingContext

_TOPOLOGY_SEED = 17  # stream of random graphs: public, a function of the run seed only
_DENSE_LIMIT = 1 << 18  # receivers x messages up to which an inbox is summed by one matmul


def replicate(params: Params, count: int) -> Params:
    """`count` stacked copies of one set of parameters."""
    return {k: v.expand(count, *v.shape).clone() for k, v in params.items()}


def per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(C,) values shaped to broadcast against a (C, ...) tensor."""
    return values.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def draw_batch(
    ctx: TrainingContext, train: ClientTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, mask) of one batch per row: Poisson sampling at rate s when the run is
    private (what the DP analysis assumes), else round(s * n_i) samples without replacement."""
    index, mask = sample_batches(ctx, train)
    return gather_batch(train.x, index), gather_batch(train.y, index), mask


def prefixed_vectors(payload: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """(n, P): the payload entries named `prefix`* flattened in key order (the order of
    `p4bench.engine.state.vectorize` for the same parameter names)."""
    keys = prefixed_keys(payload, prefix)
    return torch.cat([payload[k].flatten(start_dim=1) for k in keys], dim=1)


def unpack(payload: Mapping[str, torch.Tensor], prefix: str, like: Params) -> Params:
    """The `prefix`* payload entries as parameters shaped like `like` (leading axis: one
    per message). Works for parameter names that contain dots, unlike nested unflatten."""
    return unvectorize(prefixed_vectors(payload, prefix), like)


def weighted_inbox_sum(
    rows: torch.Tensor, inbox: Messages, vectors: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """(len(rows), P): for every row, sum over its messages of weight * vector, in the
    vectors' dtype (float64 index_add is far slower on CPU and buys nothing here)."""
    if not len(inbox):
        return torch.zeros(len(rows), vectors.shape[1], dtype=vectors.dtype)
    position = torch.searchsorted(rows, inbox.dst)
    weights = weights.to(vectors.dtype)
    if len(rows) * len(inbox) <= _DENSE_LIMIT:  # one small GEMM: no scatter kernel launch overheads
        dense = torch.zeros(len(rows), len(inbox), dtype=vectors.dtype)
        dense[position, torch.arange(len(inbox))] = weights
        return dense @ vectors
    out = torch.zeros(len(rows), vectors.shape[1], dtype=vectors.dtype)
    return out.index_add_(0, position, vectors * weights.unsqueeze(1))


def received_any(rows: torch.Tensor, inbox: Messages) -> torch.Tensor:
    """(len(rows),) bool: rows that got at least one message."""
    got = torch.zeros(len(rows), dtype=torch.bool)
    if len(inbox):
        got[torch.searchsorted(rows, inbox.dst)] = True
    return got


@dataclass(frozen=True)
class Edges:
    """A support matrix (support[i, j]: j sends to i) as its edges by sender, then
    receiver: `receiver` (E,), and each sender's first edge `start` (M,) and `count` (M,).
    Built once per graph, it makes `send_along` cost the edges, not a scan of M^2."""

    receiver: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor

    @classmethod
    def of(cls, support: torch.Tensor) -> Edges:
        sender, receiver = support.T.nonzero(as_tuple=True)
        count = torch.bincount(sender, minlength=support.shape[0])
        return cls(receiver, count.cumsum(0) - count, count)


def send_along(
    rows: torch.Tensor, support: torch.Tensor | Edges, payload: dict[str, torch.Tensor]
) -> Messages:
    """Messages from each row j to every node i with support[i, j] (self included when
    support[j, j]), by sender, then receiver; `payload` has one entry per row and is
    repeated per destination. `support` (M, M) bool, or its `Edges` (static graphs)."""
    if isinstance(support, Edges):
        if len(rows) == len(support.count):  # every client (rows are sorted ids): all the edges
            sender = torch.repeat_interleave(support.count)
            receiver = support.receiver
        else:
            count = support.count[rows]
            sender = torch.repeat_interleave(count)
            offset = torch.arange(len(sender)) - (count.cumsum(0) - count)[sender]
            receiver = support.receiver[support.start[rows][sender] + offset]
    else:
        columns = support[:, rows].T  # (C, M): row j's receivers
        sender, receiver = columns.nonzero(as_tuple=True)
    return Messages(rows[sender], receiver, {k: v[sender] for k, v in payload.items()})


class GraphSchedule:
    """The communication graph of every round, from the topology harness.

    Static graphs are drawn once from a public stream of the run seed; time-varying ones
    (ProxyFL's exponential graph, or a random graph with ``resample``) per round, each
    round from its own public stream so every process agrees. ``adjacency(t)[i, j]``
    is true when i sends to j (the harness's convention).
    """

    def __init__(
        self, name: str, options: Mapping[str, Any] | None, num_clients: int, seed: int
    ) -> None:
        from p4bench.host.manager import default_registry  # plugins may read the host's registry
        from p4bench.topology import get_topology

        if not isinstance(options or {}, Mapping):
            raise ConfigError(
                "options.topology_options",
                f"must be a mapping of topology options, got {options!r}",
            )
        self.name = name
        self.topology = get_topology(name, dict(options or {}), registry=default_registry())
        self.num_clients = num_clients
        self.seed = seed
        self.time_varying = bool(self.topology.time_varying)
        self._static = None if self.time_varying else self._draw(0)

    def _draw(self, round_index: int) -> np.ndarray:
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, _TOPOLOGY_SEED, round_index])
        )
        return np.asarray(self.topology.edges(self.num_clients, round_index, rng), dtype=bool)

    def adjacency(self, round_index: int) -> np.ndarray:
        if self._static is not None:
            return self._static
        return _cached_draw(self, int(round_index))


@lru_cache(maxsize=8)
def _cached_draw(schedule: GraphSchedule, round_index: int) -> np.ndarray:
    return schedule._draw(round_index)


def power_law_weights(count: int, a: float = 2.0) -> np.ndarray:
    """(count,) selection probabilities of clients 0..count-1 under the power law
    f(x) = a x^(a-1) on [0, 1] (P4L's participation skew, a = 2): client i gets
    F((i+1)/count) - F(i/count), F(x) = x^a. P4L's peer sampling and FedAvg's
    `client_sampling=powerlaw` share it."""
    edges = (np.arange(count + 1) / count) ** a
    return np.diff(edges)


__all__ = [
    "Edges",
    "power_law_weights",
    "GraphSchedule",
    "draw_batch",
    "noble_local_lr",
    "per_row",
    "prefixed_vectors",
    "received_any",
    "replicate",
    "send_along",
    "unpack",
    "weighted_inbox_sum",
]


def mix_through_aggregator(
    own: torch.Tensor, inbox: Messages, weights: torch.Tensor, ctx: StepContext
) -> torch.Tensor:
    """(C, P): each row's W-weighted mean of the models it received (its own included),
    through the run's defense when there is one; rows that received nothing keep `own`."""
    if ctx.aggregator.defense is None:  # plain weighted mean, no padding per receiver
        total = weighted_inbox_sum(
            ctx.rows, inbox, prefixed_vectors(inbox.payload, UPDATE_PREFIX), weights
        )
        mass = weighted_inbox_sum(
            ctx.rows, inbox, torch.ones(len(inbox), 1, dtype=total.dtype), weights
        )
        return torch.where(mass > 0, total / mass.clamp_min(1e-30), own)
    mixed = own.clone()
    models = inbox.select(weights != 0)
    if len(models):
        dst, mean = ctx.aggregator.aggregate_by_destination(
            models, weights[weights != 0], ctx.round
        )
        mixed[torch.searchsorted(ctx.rows, dst)] = mean.to(own.dtype)
    return mixed


def pinned_declarations(
    declared: torch.Tensor | None,
    inbox: Messages,
    ctx: StepContext,
    num_clients: int,
    key: str = "weight",
) -> tuple[Messages, torch.Tensor, torch.Tensor]:
    """(uploads kept, the value each kept sender declared, the updated declarations) for a
    per-client value a receiver cannot compute but an honest sender never changes (a
    record count, a batch share): the first value a sender declares is kept (`declared`,
    NaN where none yet; None: nothing recorded, as in a checkpoint from before this), and
    an upload stating another value is rejected as ``changed weight`` naming the sender.
    The receive gate has already held the value to [0, N] when `key` is "weight"."""
    if declared is None:
        declared = torch.full((num_clients,), float("nan"), dtype=torch.float64)
    sent = inbox.value(key).double().to(declared.device)
    known = declared[inbox.src]
    changed = ~torch.isnan(known) & (known != sent)
    if bool(changed.any()):
        ctx.reject("changed weight", inbox.src[changed])
        inbox, sent = inbox.select(~changed), sent[~changed]
    declared = declared.clone()
    declared[inbox.src] = torch.where(torch.isnan(declared[inbox.src]), sent, declared[inbox.src])
    return inbox, declared[inbox.src], declared
