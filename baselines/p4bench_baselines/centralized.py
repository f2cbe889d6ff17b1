"""Centralized learning: one model trained by (DP-)SGD on the pooled training data of
all clients, deployed to (and evaluated on the test split of) every client.

The pooled SGD is realised as the exact federated equivalent, so it runs through the
same engine, mechanism and ledger as every other method and on every runtime: at each
step every client draws its share of the pooled batch and sends the sum of its
per-example gradients; a trusted server adds them, divides by the pooled batch size,
takes the step and broadcasts the model (K steps per round).
- Private: every record is in the batch independently with probability s (Poisson
  sampling, so the union of the clients' draws is a Poisson sample of the pool), each
  per-example gradient is clipped to C and the server adds N(0, (sigma C)^2) once to
  the pooled sum (from its own noise stream), then divides by the expected pooled batch
  s * N. That is DP-SGD on the pooled data; each client's ledger records the step as a
  release of its records at rate s (the server is trusted with raw sums, as a central
  data holder is with the data; DP protects the released model).
- Non-private: each client contributes round(s * n_i) samples without replacement
  (stratified sampling of the pool, an unbiased pooled gradient of batch ~ s * N).
Bytes count this gradient-sum realisation (per step: one sum up, one model down per
client), not a one-off upload of the raw data. Use ``--features scatter`` for the
ScatterNet variant.

Evaluation clients' data is pooled too (the method does not know which clients the
harness reports); so are malicious clients' poisoned labels under a label-flip attack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Method
from p4bench.engine.declared_sizes import MAX_DECLARED_RECORDS
from p4bench.engine.messages import MODEL_PREFIX
from p4bench.engine.method import Phase, PlannedRelease, Step, StepContext
from p4bench.engine.method_kit import (
    draw_batch,
    pinned_declarations,
    prefixed_vectors,
    replicate,
    unpack,
)
from p4bench.engine.receive_gate import WEIGHT_KEY
from p4bench.engine.state import State, flatten, unvectorize, vectorize
from p4bench.models import Params
from p4bench.privacy.mechanism import NoiseStreams, clipped_gradient_sum
from p4bench.privacy.releases import Releases, add_central_noise
from p4bench.rng import SERVER_ID

if TYPE_CHECKING:
    from p4bench.data import ClientTensors

MODEL, GRADIENT = MODEL_PREFIX, "gradient."


class Centralized(Method):
    """(DP-)SGD on the pooled data of all clients; every client deploys the one model."""

    name = "centralized"
    tuning_options = ("local_steps", "data_rate", "clip")  # no client sampling
    # each upload declares its batch share (`weight`): the receive gate bounds it (p4bench.engine.declared_sizes)
    options = (MAX_DECLARED_RECORDS,)
    description = "centralized (DP-)SGD on the pooled training data of all clients (trusted server)"
    capabilities = Capabilities(uses_server=True, personalized=False)

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        steps = c.local_steps * c.rounds  # every record is eligible at every server step
        return [PlannedRelease("train", c.data_rate, steps, c.local_steps, c.rounds, 1.0)]

    def round_steps(self, phase: Phase, round_index: int) -> Sequence[Step]:
        return (LocalUpdate(), Exchange("upload"), Exchange("broadcast")) * self.config.local_steps

    # -- clients -------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        params = replicate(self.initial_params(), count)
        return {
            "params": params,
            "sums": {k: torch.zeros_like(v) for k, v in params.items()},
            "size": torch.zeros(
                count, dtype=torch.float64
            ),  # this client's share of the batch size
            "active": torch.zeros(count, dtype=torch.bool),
        }

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        params = state["params"]
        x, y, mask = draw_batch(ctx, train)
        if ctx.dp is None:
            loss, grads = ctx.loss_and_grad(params, x, y, mask.float())
            size = mask.sum(dim=1).double()
            sums = {
                k: g * size.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
                for k, g in grads.items()
            }
            active = torch.ones(len(ctx.rows), dtype=torch.bool)
            return {**state, "sums": sums, "size": size, "active": active}, loss.detach().double()
        rate = ctx.config.data_rate
        with Releases(
            ctx.dp, ctx, rate
        ) as releases:  # budget and ledger; the server adds the noise
            active = releases.admitted[0]
            releases.delegate()
        sums, losses = clipped_gradient_sum(
            ctx.model, params, x, y, mask.float(), ctx.dp.settings.clip
        )
        size = rate * train.n.double() * active  # expected share: the analysis divides by s * N
        loss = (losses * mask).sum(1).double() / mask.sum(1).clamp_min(1)
        return {**state, "sums": sums, "size": size, "active": active}, loss

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange != "upload":
            return Messages.empty()
        chosen = state["active"]
        count = int(chosen.sum())
        payload = {
            **flatten({k: v[chosen] for k, v in state["sums"].items()}, GRADIENT),
            WEIGHT_KEY: state["size"][
                chosen
            ],  # bounded to [0, N] by the receive gate, pinned by the server
        }
        return Messages(ctx.rows[chosen], torch.full((count,), SERVER_ID), payload)

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange != "broadcast" or not len(inbox):
            return state
        position = torch.searchsorted(ctx.rows, inbox.dst)
        model = unpack(inbox.payload, MODEL, state["params"])
        params = {k: v.clone() for k, v in state["params"].items()}
        for k in params:
            params[k][position] = model[k]
        return {**state, "params": params, "active": torch.zeros_like(state["active"])}

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params

    # -- server ------------------------------------------------------------------------------
    def init_server_state(self, ctx: StepContext) -> State:
        secure = self.config.noise_source == "secure"
        self._noise = NoiseStreams(
            self.config.seed, [SERVER_ID], secure=secure
        )  # the server's own stream
        return {"params": {k: v.unsqueeze(0) for k, v in self.initial_params().items()}}

    def server_receive(
        self, exchange: str, state: State, inbox: Messages, ctx: StepContext
    ) -> State:
        if exchange != "upload" or not len(inbox):
            return state
        # each client's batch share as it first declared it: a sender cannot change it later to
        # scale the step (the server cannot compute it: it does not hold the clients' data)
        inbox, shares, declared = pinned_declarations(
            state.get("declared"), inbox, ctx, self.num_clients
        )
        state = {**state, "declared": declared}
        if not len(inbox):
            return state
        total = prefixed_vectors(inbox.payload, GRADIENT).double().sum(dim=0, keepdim=True)
        size = float(shares.sum())
        # the run's noise std, known to the server as to everyone: never one a client sends
        std = float(ctx.dp_settings.noise_std) if ctx.dp_settings is not None else 0.0
        if size <= 0:
            return state
        if std > 0:
            total = add_central_noise(total, std, self._noise)
        params = vectorize(state["params"]).double() - self.config.lr * total / size
        return {**state, "params": unvectorize(params.float(), state["params"])}

    def server_outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        if exchange != "broadcast":
            return Messages.empty()
        count = self.num_clients
        model = {k: v.expand(count, *v.shape[1:]) for k, v in state["params"].items()}
        return Messages(torch.full((count,), SERVER_ID), torch.arange(count), flatten(model, MODEL))


__all__ = ["Centralized"]
