"""Ditto (Li et al., 2021) over a peer-to-peer graph, as an outside author wrote it against
p4bench 0.1, before plugins declared their options; kept unchanged.

It reads its options from the run's free-form `config.options` (`-o ditto_lambda=0.5`,
`-o topology=star-hub`), registers its own graph, `star-hub`, and imports from p4bench's
internal modules (there was no `p4bench.api` then). p4bench 0.2 must run it with one
deprecation line for its undeclared options and one for its topology, and
`p4bench check-plugin p4bench-ditto` must name its internal imports and the options it
reads without declaring them.

Each client keeps two models: a shared one, trained with DP-SGD and mixed with its
neighbours' (gossip), and a personal one, trained with DP-SGD plus the pull
ditto_lambda * (v - w) towards the shared model w; it deploys the personal one.
"""

import numpy as np
import torch

from p4bench import hookimpl
from p4bench.data import ClientTensors
from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Method
from p4bench.engine.method import DEFAULT_EPSILON, PlannedRelease
from p4bench.engine.state import flatten, unvectorize, vectorize
from p4bench.engine.training import batch_gradient, gather_batch, local_sgd, sample_batches
from p4bench.errors import ConfigError
from p4bench.topology import CompleteGraph, RingGraph, Topology

__version__ = "0.1.0"

UPDATE = "update."
MIX = 0.5


class StarHub(Topology):
    """Client 0 is the hub: it talks to every client, the others only to it."""

    name = "star-hub"
    description = "star: client 0 talks to every other client, they only to it (a 0.1 plugin)"

    def edges(self, num_clients, round_index, rng):
        adjacency = np.zeros((num_clients, num_clients), dtype=bool)
        adjacency[0, 1:] = adjacency[1:, 0] = True
        return adjacency


GRAPHS = {"star-hub": StarHub, "ring": RingGraph, "complete": CompleteGraph}


class Ditto(Method):
    name = "ditto"
    description = "Ditto over a graph: a shared gossip model and a personal one (a 0.1 plugin)"
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, personalized=True
    )
    default_epsilon = DEFAULT_EPSILON

    def validate_options(self):
        options = self.config.options
        self.ditto_lambda = float(options.get("ditto_lambda", 0.1))
        if self.ditto_lambda < 0:
            raise ConfigError("options.ditto_lambda", f"must be >= 0, got {self.ditto_lambda}")
        graph = options.get("topology", "star-hub")
        if graph not in GRAPHS:
            raise ConfigError("options.topology", f"must be one of {', '.join(GRAPHS)}")
        self.topology = GRAPHS[graph](options.get("topology_options"))

    def privacy_plan(self):
        c = self.config  # K DP steps for each of the two models in every round
        steps = 2 * c.local_steps
        return [PlannedRelease("train", c.data_rate, steps * c.rounds, steps, c.rounds, 1.0)]

    def round_steps(self, phase, round_index):
        return (LocalUpdate(), Exchange("gossip"))

    def graph(self, round_index):
        rng = np.random.default_rng([self.config.seed, 29])
        edges = self.topology.edges(self.num_clients, round_index, rng)
        return torch.from_numpy(np.asarray(edges, dtype=bool))

    def init_client_state(self, train: ClientTensors, ctx):
        count = len(ctx.rows)
        start = {k: v.expand(count, *v.shape).clone() for k, v in self.initial_params().items()}
        return {"shared": start, "personal": {k: v.clone() for k, v in start.items()}}

    def local_update(self, state, train: ClientTensors, ctx):
        lr, steps = self.config.lr, self.config.local_steps
        shared, loss = local_sgd(ctx, state["shared"], train, steps, lr)
        personal = state["personal"]
        for _ in range(steps):
            index, mask = sample_batches(ctx, train)
            x, y = gather_batch(train.x, index), gather_batch(train.y, index)
            grads, _, _ = batch_gradient(ctx, personal, x, y, mask, train)
            pull = self.ditto_lambda
            personal = {
                k: personal[k] - lr * (grads[k] + pull * (personal[k] - shared[k]))
                for k in personal
            }
        return {"shared": shared, "personal": personal}, loss

    def deployed_params(self, state):
        return state["personal"]

    def outgoing(self, exchange, state, ctx):
        sender, receiver = self.graph(ctx.round)[ctx.rows].nonzero(as_tuple=True)
        return Messages(ctx.rows[sender], receiver, flatten(state["shared"], UPDATE), rows=sender)

    def receive(self, exchange, state, inbox, ctx):
        if not len(inbox):
            return state
        weights = torch.ones(len(inbox), dtype=torch.float64)
        dst, mean = ctx.aggregator.aggregate_by_destination(inbox, weights, ctx.round)
        own = vectorize(state["shared"])
        mixed = own.clone()
        position = torch.searchsorted(ctx.rows, dst)
        mixed[position] = (1 - MIX) * own[position] + MIX * mean.to(own.dtype)
        return {**state, "shared": unvectorize(mixed, state["shared"])}


@hookimpl
def register_methods():
    return [Ditto]


@hookimpl
def register_topologies():
    return [StarHub]
