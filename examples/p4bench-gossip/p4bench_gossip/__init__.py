"""DP personalized gossip, a peer-to-peer method written from scratch as a p4bench plugin.

Every round, each client
1. takes K DP-SGD steps on its own model (`local_sgd`: the DP path, through `ctx.dp`,
   when the run is private; each step is one release in the client's ledger);
2. sends that model to its out-neighbours on the run's topology, as an ``update.*``
   payload (the payload attacks replace and defenses inspect; here it carries a whole
   model, so `update_reference` stays None);
3. mixes: x_i <- (1 - mix) x_i + mix * mean of the models it received, the mean taken
   by `ctx.aggregator`, where the run's defense (if any) filters the neighbours' models.

A client keeps (1 - mix) of its own model, so models stay personalized; `mix = 1`
replaces it by the neighbours' mean. What a client sends is its DP-trained model, i.e.
post-processing of its releases, so the run's epsilon covers everything it shares.

Options (`-o key=value`): `mix` in [0, 1] (default 0.5), and the run's `--topology` (ring |
exponential | complete, default ring) with its `--topology-option`s. The graph is public: drawn from the topology
plugin with a stream of the run seed, so every process (every device) computes the same
graph without talking to the others.
"""

from __future__ import annotations

import numpy as np
import torch

from p4bench.api import (
    DEFAULT_EPSILON,
    Capabilities,
    Exchange,
    LocalUpdate,
    Messages,
    Method,
    Option,
    PlannedRelease,
    default_registry,
    flatten,
    get_topology,
    hookimpl,
    local_sgd,
    resolve_options,
    topology_options,
    unvectorize,
    vectorize,
)

__version__ = "0.1.0"

UPDATE = "update."  # payload prefix of what attacks may replace and defenses filter
TOPOLOGIES = ("ring", "exponential", "complete")
_GRAPH_STREAM = 29  # tag of the public stream random graphs would be drawn from


class Gossip(Method):
    """DP local training, then partial mixing with the neighbours' mean model."""

    name = "gossip"
    description = "DP personalized gossip: DP-SGD locally, mix a share of the neighbours' mean model (example plugin)"
    # Honest flags: single clients' models reach their neighbours (shares_individual_updates),
    # they are combined through ctx.aggregator (has_aggregator: defenses apply), every
    # client deploys its own model (personalized), and there is no server.
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=True, personalized=True
    )
    default_epsilon = DEFAULT_EPSILON  # a DP method: private by default, like the suite's others
    options = (
        Option(
            "mix",
            float,
            0.5,
            "weight of the neighbours' mean model when a client mixes",
            low=0.0,
            high=1.0,
        ),
        *topology_options(
            "ring", choices=TOPOLOGIES
        ),  # `p4bench run --topology`, `--topology-option`
    )

    def validate_options(self) -> None:
        values = resolve_options(
            self.options, self.config.options
        )  # typed, defaults filled, ConfigError if bad
        self.mix = float(values["mix"])
        self.topology = get_topology(
            values["topology"], values["topology_options"], registry=default_registry()
        )

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config  # every client takes K DP steps in every round (no client sampling)
        return [
            PlannedRelease(
                "train", c.data_rate, c.local_steps * c.rounds, c.local_steps, c.rounds, 1.0
            )
        ]

    def round_steps(self, phase, round_index):
        return (LocalUpdate(), Exchange("gossip"))

    # -- the graph: public, the same in every process -------------------------------------
    def graph(self, round_index: int) -> torch.Tensor:
        """(M, M) bool adjacency of the round: [i, j] when client i sends to client j."""
        key = round_index if self.topology.time_varying else 0
        rng = np.random.default_rng(np.random.SeedSequence([self.config.seed, _GRAPH_STREAM, key]))
        edges = torch.from_numpy(
            np.asarray(self.topology.edges(self.num_clients, key, rng), dtype=bool)
        )
        return edges.to(torch.get_default_device())  # the run's device (a GPU run's default)

    # -- client state: one row per client ------------------------------------------------------
    def init_client_state(self, train, ctx):
        count = len(ctx.rows)
        return {
            "params": {
                k: v.expand(count, *v.shape).clone() for k, v in self.initial_params().items()
            }
        }

    def local_update(self, state, train, ctx):
        params, loss = local_sgd(
            ctx, state["params"], train, self.config.local_steps, self.config.lr
        )
        return {**state, "params": params}, loss

    def deployed_params(self, state):
        return state["params"]

    # -- messages ------------------------------------------------------------------------------
    def outgoing(self, exchange, state, ctx):
        sender, receiver = self.graph(ctx.round)[ctx.rows].nonzero(
            as_tuple=True
        )  # sender: a row of this state
        # one table row per client, shared by all its messages (`rows`): a model sent to
        # several neighbours is stored once
        return Messages(ctx.rows[sender], receiver, flatten(state["params"], UPDATE), rows=sender)

    def receive(self, exchange, state, inbox, ctx):
        if not len(inbox):
            return state
        # inbox is sorted by (dst, src); every neighbour weighs the same
        dst, mean = ctx.aggregator.aggregate_by_destination(
            inbox, torch.ones(len(inbox), dtype=torch.float64), ctx.round
        )
        own = vectorize(state["params"])  # (C, P) in sorted key order, the order of update_vectors
        mixed = own.clone()
        position = torch.searchsorted(ctx.rows, dst)
        mixed[position] = (1 - self.mix) * own[position] + self.mix * mean.to(own.dtype)
        return {**state, "params": unvectorize(mixed, state["params"])}


@hookimpl
def register_methods():
    return [Gossip]


__all__ = ["Gossip", "register_methods"]
