"""FedProx (Li et al., 2020) as a third-party p4bench method plugin.

FedProx is FedAvg whose clients add a proximal term (mu / 2) * ||w - w_global||^2 to
their local objective, which keeps heterogeneous clients from drifting. Everything
else (sampling, upload, weighted averaging, broadcast) is inherited from p4bench's
FedAvg, so the plugin only overrides the local update.
"""

from __future__ import annotations

import torch

from p4bench import hookimpl
from p4bench.engine.training import gather_batch
from p4bench.options import Option, resolve_options
from p4bench_baselines.fedavg import FedAvg

__version__ = "0.1.0"


class FedProx(FedAvg):
    """FedAvg with a proximal term; option `mu` (default 0.01): `p4bench run --method fedprox -o mu=0.1`."""

    name = "fedprox"
    description = "FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 (example plugin)"
    # declared options are checked before the run starts and shown by `p4bench describe fedprox`
    options = FedAvg.options + (
        Option("mu", float, 0.01, "weight of the proximal term (mu/2) ||w - w_global||^2", low=0),
    )

    def validate_options(self) -> None:
        super().validate_options()  # FedAvg's lr_scaling
        self.mu = resolve_options(self.options, self.config.options)["mu"]

    def local_update(self, state, train, ctx):
        anchor = state["global"]
        params = dict(anchor)
        batch = torch.round(self.config.data_rate * train.n.double()).clamp_min(1).long()
        total = torch.zeros(len(ctx.rows), dtype=torch.float64)
        for _ in range(self.config.local_steps):
            index, mask = ctx.rng.subsets(train.n, batch, int(batch.max()))
            loss, grads = ctx.loss_and_grad(
                params, gather_batch(train.x, index), gather_batch(train.y, index), mask.float()
            )
            # gradient of (mu/2)||w - w_global||^2 is mu * (w - w_global)
            params = {
                k: params[k] - self.config.lr * (grads[k] + self.mu * (params[k] - anchor[k]))
                for k in params
            }
            total += loss.detach().double()
        return {**state, "params": params}, total / self.config.local_steps


@hookimpl
def register_methods():
    return [FedProx]
