"""Local training: every client trains only on its own data and never communicates.

With a target epsilon every step is a DP-SGD step (Poisson rate s); ScatterNet features
come from ``--features scatter`` as for every method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.engine import Capabilities, Method
from p4bench.engine.method import PlannedRelease, StepContext
from p4bench.engine.state import State
from p4bench.engine.training import local_sgd
from p4bench.models import Params

if TYPE_CHECKING:
    from p4bench.data import ClientTensors


class LocalTraining(Method):
    """Each client trains its own model for K steps per round; no messages."""

    name = "local"
    tuning_options = ("local_steps", "data_rate", "clip")  # no client sampling
    description = "each client trains alone on its own data (no communication)"
    capabilities = Capabilities(personalized=True)

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config  # every client trains in every round: client_rate does not apply
        return [
            PlannedRelease(
                "train", c.data_rate, c.local_steps * c.rounds, c.local_steps, c.rounds, 1.0
            )
        ]

    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        return {
            "params": {
                k: v.expand(count, *v.shape).clone() for k, v in self.initial_params().items()
            }
        }

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        params, loss = local_sgd(
            ctx, state["params"], train, self.config.local_steps, self.config.lr
        )
        return {**state, "params": params}, loss

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params


__all__ = ["LocalTraining"]
