"""FedProx (Li et al., 2020) as a third-party p4bench method plugin.

FedProx is FedAvg whose clients add a proximal term (mu / 2) * ||w - w_global||^2 to
their local objective, which keeps heterogeneous clients from drifting. Everything
else (sampling, upload, weighted averaging, broadcast) is inherited from p4bench's
FedAvg, so the plugin only overrides the local update. Its batches and gradients are
p4bench's (`draw_batch`, `batch_gradient`): where the run is private, every step goes
through the DP mechanism and is counted in the client's ledger.

It imports only `p4bench.api`, whose names keep their meaning within an API version.
"""

from __future__ import annotations

import torch

from p4bench.api import FedAvg, Option, batch_gradient, draw_batch, hookimpl, resolve_options

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
        total = torch.zeros(len(ctx.rows), dtype=torch.float64)
        for _ in range(self.config.local_steps):
            x, y, mask = draw_batch(ctx, train)  # each client's own stream (ctx.rng)
            grads, loss, _ = batch_gradient(ctx, params, x, y, mask, train)  # DP where private
            # gradient of (mu/2)||w - w_global||^2 is mu * (w - w_global)
            params = {
                k: params[k] - self.config.lr * (grads[k] + self.mu * (params[k] - anchor[k]))
                for k in params
            }
            total += loss
        return {**state, "params": params}, total / self.config.local_steps


@hookimpl
def register_methods():
    return [FedProx]
