"""Accept-if-better (P4L, Arapakis et al.): a client keeps a received model only if it
scores at least as well on the client's own data as the model it has.

It runs on the client and reads nothing but the client's own model, the received one
and the client's own records, so it works where updates are hidden from every peer
(P4L's Paillier chains, secure aggregation) and with every method. The driver applies it
after each `receive` that changes a client's deployed model (`Defense.gates_clients`):
accuracy of both models on the client's training records (the paper's "own data"; its
labels as the client holds them), and the previous state of the client where the new
model scores lower. Methods that merge what they received inside `local_update` (e.g.
p2p-fl's personal average) are not gated: the run's `gate.judged` metric counts the
decisions actually taken, so a gate that never acted shows as 0. P4L applies the same
rule inside its protocol (option `accept_gate`), on a held-out validation split.

Privacy: the decision reads the client's records outside the DP ledger, and it selects
the model the client trains on and sends next, so a private run with this defense is
reported uncertified (`Defense.uncertified_steps`), with the reason.
"""

from __future__ import annotations

from p4bench.engine import Defense


class AcceptIfBetter(Defense):
    """Keep a received model only if it is at least as accurate on the client's own data."""

    name = "accept-if-better"
    description = (
        "client-side gate (P4L): keep a received model only if it scores at least as well on the "
        "client's own records; works under encryption and with every method"
    )
    needs_individual_updates = False
    filters = False  # it judges whole received models, never single senders' updates
    gates_clients = True
