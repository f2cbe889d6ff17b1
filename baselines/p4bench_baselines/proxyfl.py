"""ProxyFL (Kalra et al., Nature Communications 2023): each client keeps a private model
(never sent, trained without DP) and a proxy model (shared, trained with DP-SGD); the two
learn from each other by deep mutual learning, and proxies travel over ProxyFL's
time-varying directed exponential graph.

Per round, each client runs K steps (default local_steps; with s = 0.2 and K = 5 that is
the paper's one local epoch), both models on the same batch (Poisson-sampled when
private) with losses evaluated at the pre-step models:
    private: (1 - w) CE(f(x), y) + w KL(softmax(h(x)) || softmax(f(x)))   no DP
    proxy:   (1 - w) CE(h(x), y) + w KL(softmax(t(x)) || softmax(h(x)))   DP-SGD
where the proxy's teacher t is chosen by option ``teacher`` (a departure from the paper
for privacy, as in P4): the paper's t = f, the non-private model trained on the same
records, lets one record move other records' clipped proxy gradients in every later
step, outside the subsampled-Gaussian analysis, so its epsilon does not hold.
- ``none`` (default): no distillation term for the proxy (w = 0 in its loss only);
- ``last-proxy``: t = the proxy as it was after the last mixing (a DP output);
- ``private``: the paper's t = f, kept for reproduction; the epsilon is uncertified.
Then client k sends its proxy to its out-neighbour (k + 2^(r mod (floor(log2(M-1))+1)))
mod M and handles what it receives by option ``proxy_update``:
- ``average`` (default, the paper's Algorithm 1): the uniform average of its own proxy
  and the received ones (1/2 each on the exponential graph);
- ``replace`` (the authors' code, train_proxy_push): the received proxy overwrites its own.

Only the proxy's DP steps are releases (privacy_plan: K steps per round in every round).
The private model never appears in any message. Deviations from the authors' code: SGD
with the run's step size instead of Adam (every method here uses SGD), the per-client
test split instead of the global test set, and the proxy's teacher (above).

Options: dml_weight (w, default 0.5), teacher (none | last-proxy | private),
proxy_update (average | replace), topology (default exponential), topology_options
(mapping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from p4bench.engine import DEFAULT_EPSILON, Capabilities, Exchange, LocalUpdate, Method
from p4bench.engine.equivocation import EQUIVOCATION_OPTION
from p4bench.engine.messages import UPDATE_PREFIX, Messages
from p4bench.engine.method import Phase, PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import (
    GraphSchedule,
    draw_batch,
    per_row,
    prefixed_vectors,
    received_any,
    replicate,
    send_along,
    weighted_inbox_sum,
)
from p4bench.engine.state import State, flatten, unvectorize, vectorize
from p4bench.engine.training import PerExampleLoss, batch_gradient, distillation_loss, logits_of
from p4bench.models import Model, Params
from p4bench.options import Option, resolve_options, topology_options
from p4bench.topology import uniform_averaging

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

UPDATE = UPDATE_PREFIX
PROXY_UPDATES = ("average", "replace")
TEACHERS = ("none", "last-proxy", "private")


def mutual_learning_loss(weight: float) -> PerExampleLoss:
    """Per-example (1 - w) CE(logits, y) + w KL(softmax(peer) || softmax(logits)), the
    peer's logits arriving as the auxiliary input (deep mutual learning, as in P4)."""
    return distillation_loss(weight)


class ProxyFL(Method):
    """ProxyFL with private/proxy mutual learning and proxy pushes over a graph."""

    name = "proxyfl"
    tuning_options = ("local_steps", "data_rate", "clip")  # no client sampling
    description = "ProxyFL (Kalra et al.): private model + DP proxy, mutual distillation, exponential-graph pushes"
    capabilities = Capabilities(
        shares_individual_updates=True, has_aggregator=False, personalized=True
    )
    default_epsilon = DEFAULT_EPSILON
    options = (
        Option(
            "dml_weight",
            float,
            0.5,
            "w, the distillation weight of deep mutual learning",
            low=0,
            high=1,
        ),
        Option(
            "teacher",
            str,
            "none",
            "what the DP proxy distils from: none, last-proxy (a DP output) or private "
            "(the paper's; epsilon uncertified)",
            choices=TEACHERS,
        ),
        Option(
            "proxy_update",
            str,
            "average",
            "handling of received proxies: average (the paper) or replace (the authors' code)",
            choices=PROXY_UPDATES,
        ),
        *topology_options("exponential"),
        EQUIVOCATION_OPTION,
    )

    def validate_options(self) -> None:
        values = resolve_options(self.options, self.config.options)
        self.weight, self.proxy_update, self.teacher = (
            values["dml_weight"],
            values["proxy_update"],
            values["teacher"],
        )
        self.graph = GraphSchedule(
            values["topology"], values["topology_options"], self.num_clients, self.config.seed
        )
        self.loss = mutual_learning_loss(self.weight)
        self.proxy_loss = mutual_learning_loss(self.weight if self.teacher != "none" else 0.0)

    def uncertified_steps(self) -> list[str]:
        if self.teacher == "private" and self.weight > 0:
            return [
                "ProxyFL teacher=private (the paper's): the DP proxy distils from the non-DP private model trained "
                "on the same records, so one record moves other records' clipped gradients outside the ledger"
            ]
        return []

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config  # every client trains its proxy in every round (no client sampling)
        return [
            PlannedRelease(
                "train", c.data_rate, c.local_steps * c.rounds, c.local_steps, c.rounds, 1.0
            )
        ]

    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        return (LocalUpdate(), Exchange("push"))

    # -- state ---------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        init = replicate(self.initial_params(), len(ctx.rows))
        return {"private": init, "proxy": {k: v.clone() for k, v in init.items()}}

    def deployed_params(self, state: State) -> Params:
        private: Params = state["private"]
        return private

    def extra_models(self, state: State) -> dict[str, Params]:
        return {"proxy": state["proxy"]}

    # a client that joins after training (--unseen-fraction): the private models never leave
    # their clients and are trained without DP, so a newcomer starts from the proxies' mean
    newcomer_start = "the mean of the trained clients' proxies"

    def newcomer_params(self, state: State) -> Params:
        return {k: v.mean(0) for k, v in state["proxy"].items()}

    # -- local computation ---------------------------------------------------------------
    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        private, proxy = state["private"], state["proxy"]
        released = proxy  # the proxy as mixed after the last exchange: a DP output
        total, taken = torch.zeros(len(ctx.rows), dtype=torch.float64), torch.zeros(len(ctx.rows))
        for _ in range(self.config.local_steps):
            x, y, mask = draw_batch(ctx, train)
            private_logits, proxy_logits = (
                logits_of(ctx.model, private, x),
                logits_of(ctx.model, proxy, x),
            )
            teacher = self.teacher_logits(ctx.model, private_logits, released, x)
            proxy_grads, loss, done = batch_gradient(
                ctx, proxy, x, y, mask, train, self.proxy_loss, teacher
            )
            _, private_grads = ctx.loss_and_grad(
                private, x, y, mask.float(), loss=self.loss, aux=proxy_logits
            )
            proxy = {k: v - self.config.lr * proxy_grads[k] for k, v in proxy.items()}
            private = {
                k: v - self.config.lr * private_grads[k] * per_row(done, v)
                for k, v in private.items()
            }
            total, taken = total + loss * done, taken + done
        return {**state, "private": private, "proxy": proxy}, total / taken.clamp_min(1)

    def teacher_logits(
        self, model: Model, private_logits: torch.Tensor, released: Params, x: torch.Tensor
    ) -> torch.Tensor | None:
        """The logits the proxy distils from on batch `x` (None: CE only): the private
        model's (`teacher=private`), the last released proxy's, or none."""
        if self.teacher == "none":
            return None
        return private_logits if self.teacher == "private" else logits_of(model, released, x)

    # -- messages --------------------------------------------------------------------------
    def mixing(self, round_index: int) -> torch.Tensor:
        """M[i, j]: weight client i gives to the proxy it gets from j (its own when i == j),
        computed on the host and returned on the run's device."""
        adjacency, device = self.graph.adjacency(round_index), torch.get_default_device()
        if self.proxy_update == "average":
            return torch.from_numpy(uniform_averaging(adjacency)).to(device)
        receives = torch.from_numpy(adjacency.T.astype("float64"))  # receives[i, j]: i hears j
        return (receives / receives.sum(dim=1, keepdim=True).clamp_min(1.0)).to(device)

    def identical_messages(
        self, exchange: str, phase: str, round_index: int
    ) -> bool | frozenset[str]:
        """Every peer of the round gets the sender's one proxy: where a sender has two or more
        (not on the default exponential graph, one peer a round), receivers compare signed
        digests (p4bench.engine.equivocation)."""
        pushes = self.graph.adjacency(round_index) != 0  # [j, i]: j pushes to i
        return bool((pushes.sum(axis=1) - pushes.diagonal()).max() >= 2)

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        """Only the proxy is sent (to the round's out-neighbours, and to oneself when averaging)."""
        return send_along(ctx.rows, self.mixing(ctx.round) != 0, flatten(state["proxy"], UPDATE))

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        weights = self.mixing(ctx.round)[inbox.dst, inbox.src]
        mixed = weighted_inbox_sum(
            ctx.rows, inbox, prefixed_vectors(inbox.payload, UPDATE), weights
        )
        own = vectorize(state["proxy"])
        proxy = torch.where(received_any(ctx.rows, inbox).unsqueeze(1), mixed, own)
        return {**state, "proxy": unvectorize(proxy, state["proxy"])}


__all__ = ["ProxyFL", "mutual_learning_loss"]
