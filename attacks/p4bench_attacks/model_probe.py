"""`model-probe`: a malicious neighbour crafts the model at which its victims evaluate gradients.

In cross-gradient methods (PDSL; DP-CGA) agent j sends its model x_j to each neighbour i
in exchange ``models``, and i returns g_ij = grad F_i(x_j; B_i), the gradient of x_j's
loss on a batch B_i of i's own records (clipped and noised under DP). A malicious j
chooses x_j freely, so it chooses where i's gradient is evaluated: an active
gradient-inversion probe. This attack replaces the model a malicious client sends in
exchange ``models`` by the all-zero model and leaves every other exchange untouched (its
cross-gradients and gossip stay honest, so the probe is not conspicuous there).

Why zeros, for the suite's linear softmax model (`p4bench.models.LinearSoftmax`,
weight W (L, d), bias c (L,), flattened by `vectorize` in sorted key order: bias, then
weight row by row). At W = 0, c = 0 every logit is 0, so softmax is uniform, p = 1/L,
and the batch-mean cross-entropy gradient over a batch of b records (x_n, y_n) is

    dF/dc_k = (1/b) sum_n (1/L - [y_n = k])           = 1/L - n_k / b
    dF/dW_k = (1/b) sum_n (1/L - [y_n = k]) x_n        = xbar / L - S_k / b

with n_k the batch's count of label k, S_k = sum_{n: y_n = k} x_n and xbar the batch mean.
The bias gradient reveals the label histogram and each weight row the class-conditional
sum of the victim's inputs, up to the common term xbar / L (`p4bench.audit.inversion`
inverts it and measures what DP noise leaves of it). For any other model the zero probe
is untargeted: it still fixes where the victim's gradient is evaluated, but no closed
form reading of it is claimed.

The attack acts on ``update.*`` payloads of exchange ``models`` only, so it bites on
methods that send their model there (PDSL does); elsewhere it leaves messages as they
are (`incompatibility` keeps the default: any method that sends updates accepts it).
"""

from __future__ import annotations

import torch

from p4bench.engine.messages import Messages
from p4bench.engine.threats import Attack, update_vectors, with_update_vectors
from p4bench.rng import ClientRng

PROBED_EXCHANGE = "models"


class ModelProbe(Attack):
    """Send the all-zero model in exchange ``models`` (module docstring): the victims'
    cross-gradients at it reveal their batches' label counts and class-conditional input
    sums (linear softmax model)."""

    name = "model-probe"
    description = (
        "malicious neighbours send an all-zero probe model in exchange `models` (PDSL's cross-gradients "
        "are then evaluated at it and reveal the victim's label counts and class sums); other exchanges "
        "untouched"
    )

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        """Messages of exchange ``models`` carry the zero model instead of the sender's;
        those of any other exchange are returned unchanged."""
        if exchange != PROBED_EXCHANGE or not len(messages):
            return messages
        updates = update_vectors(messages.payload)
        # a payload that is a delta from `reference` must decode to the zero model: send -reference
        probe = torch.zeros_like(updates) if reference is None else -reference.to(updates.dtype)
        return Messages(messages.src, messages.dst, with_update_vectors(messages.payload, probe))
