"""The network mixing check: does every gossip message carry exactly its sender's declared state?

The network-DP accountant (`p4bench.privacy.network_dp`) trusts a method's declaration of
its exchanges (`Method.network_events`): which releases enter which node's state, and which
mixing matrix every exchange applies. This check holds a recorded run to it by behaviour,
with the values the run really sent and released:

- it keeps each node's *declared state*: the public start (`Method.initial_params`), then,
  event by event, ``+ c * release`` where the declaration says a node releases (the value
  the release tape saw, `p4bench.privacy.tape`; c: one scale per release event, fitted on
  the messages, e.g. the step size -lr), and ``W @ messages`` at every `Gossip`;
- at every declared exchange each message w -> v must be declared (``W[v, w] != 0``), every
  declared one must be sent, its payload must hold the model alone (``update.*``), and it
  must equal w's declared state within float rounding.

A method that sends 1.1x its model, mixes a neighbour with a weight it did not declare,
adds a release of another node or anything else outside the declared linear mixture fails,
with a finding naming the exchange, the round and the sender. Runs in the recorded run of
every post-processing check (`p4bench.privacy.replay.instrument`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from p4bench.engine.messages import UPDATE_PREFIX, Messages
from p4bench.privacy.network_events import Gossip, Release

__all__ = ["MixingCheck", "method_exchange"]

# The equivocation check's own exchanges (`p4bench.engine.check_exchanges`): signed digests
# of the method's messages, not messages of the method; no declaration covers them.
HARNESS_PREFIXES = ("signed:", "digests:")


def method_exchange(exchange: str) -> bool:
    """Whether `exchange` is one of the method's (not the harness's equivocation check's)."""
    return not exchange.startswith(HARNESS_PREFIXES)


# Float32 models mixed in float32: a message may differ from the float64 declared state by a
# few ulps of the largest value per mixing step; anything outside the mixture is far larger.
RELATIVE_TOLERANCE = 1e-5


class MixingCheck:
    """Checks a method's gossip messages against its declared mixing (module docstring).
    `on_release` goes on the release tape's observers, `on_send` on the observed network."""

    def __init__(self, method: Any, num_nodes: int) -> None:
        self.method, self.num_nodes = method, num_nodes
        self.findings: list[str] = []
        self.checked = 0  # messages compared
        self.declared = True  # False once an exchange was not declared (nothing to check)
        self._base: torch.Tensor | None = None  # (N, P) float64: the declared states, known part
        self._unknown: list[torch.Tensor] = []  # (N, P) releases whose scale c is not yet fitted
        self._pending: list[torch.Tensor] = []  # release rows made since the last exchange
        self._occurrences: dict[tuple[str, str, int], int] = {}

    def on_release(self, kind: str, tensors: Sequence[torch.Tensor]) -> None:
        if kind == "add_noise" and tensors:
            rows = len(tensors[0])
            self._pending.append(
                torch.cat([t.detach().reshape(rows, -1).double().cpu() for t in tensors], 1)
            )

    def on_send(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> None:
        if not method_exchange(exchange):
            return
        key = (exchange, phase, round_index)
        occurrence = self._occurrences.get(key, 0)
        self._occurrences[key] = occurrence + 1
        if not self.declared or self.findings:
            return  # one finding is enough: later states follow from a wrong one
        events = self.method.network_events(exchange, phase, round_index, occurrence)
        if events is None:
            self.declared = False
            return
        where = f"phase '{phase}' round {round_index}, exchange '{exchange}' #{occurrence}"
        pending, self._pending = self._pending, []
        for event in events:
            if isinstance(event, Release):
                self._release(event, pending, where)
                pending = []
            elif isinstance(event, Gossip):
                self._gossip(event, outgoing, where)
            if self.findings:
                return

    # -- the declared states ----------------------------------------------------------------
    def _start(self, width: int) -> torch.Tensor:
        params = self.method.initial_params()
        start = torch.cat([params[k].detach().reshape(-1).double().cpu() for k in sorted(params)])
        if len(start) != width:
            self.findings.append(
                f"the models sent have {width} values, the method's initial model {len(start)}"
            )
        return start.expand(self.num_nodes, -1).clone()

    def _release(self, event: Release, rows: list[torch.Tensor], where: str) -> None:
        nodes = np.flatnonzero(np.asarray(event.nodes, dtype=bool))
        made = torch.cat(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)
        if len(made) != len(nodes):
            self.findings.append(
                f"{where}: {len(nodes)} node(s) declared a release, the method made "
                f"{len(made)} release row(s)"
            )
            return
        values = torch.zeros(self.num_nodes, made.shape[1], dtype=torch.float64)
        values[torch.as_tensor(nodes)] = made
        self._unknown.append(values)

    def _gossip(self, event: Gossip, outgoing: Messages, where: str) -> None:
        weights = np.asarray(event.weights, dtype=np.float64)
        table = (
            outgoing.table
        )  # one row per distinct payload: memory of the states, not the messages
        extra = sorted(k for k in table if not k.startswith(UPDATE_PREFIX))
        if extra:
            self.findings.append(f"{where}: messages carry {extra}, which no declared state holds")
            return
        src, dst = outgoing.src.cpu().numpy(), outgoing.dst.cpu().numpy()
        rows = outgoing.table_rows().cpu().numpy()
        used = np.unique(rows)
        sender_of = np.full(int(rows.max()) + 1 if len(rows) else 0, -1)
        sender_of[rows] = src
        shared = [int(r) for r in used if len(np.unique(src[rows == r])) > 1]
        if shared:  # a payload row shown as two senders' state: one of them is not its own
            self.findings.append(f"{where}: one payload sent as the state of two senders")
            return
        sent = torch.cat(
            [
                table[k].detach()[torch.as_tensor(used)].reshape(len(used), -1).double().cpu()
                for k in sorted(table)
            ],
            1,
        )
        if self._base is None:
            self._base = self._start(sent.shape[1])
            if self.findings:
                return
        if not self._pattern(weights, src, dst, where):
            return
        declared = self._fit(sent, sender_of[used], where)
        if declared is None:
            return
        self.checked += len(src)
        self._base = torch.from_numpy(weights) @ declared
        self._unknown = []

    def _pattern(self, weights: np.ndarray, src: np.ndarray, dst: np.ndarray, where: str) -> bool:
        """Every message declared and every declared message sent (a node's to itself aside)."""
        other = src != dst
        sent = set(zip(src[other].tolist(), dst[other].tolist()))
        receivers, senders = np.nonzero(weights * (1 - np.eye(len(weights))))
        expected = set(zip(senders.tolist(), receivers.tolist()))
        for what, pairs in (
            ("not declared", sent - expected),
            ("declared, not sent", expected - sent),
        ):
            if pairs:
                w, v = min(pairs)
                self.findings.append(f"{where}: message client {w} -> client {v} {what}")
                return False
        return True

    def _fit(self, sent: torch.Tensor, senders: np.ndarray, where: str) -> torch.Tensor | None:
        """The declared states with each unknown release scale fitted by least squares on the
        payloads sent (`senders`: whose state each row is); None (and a finding) where a
        payload is not its sender's declared state."""
        assert self._base is not None
        index = torch.as_tensor(senders)
        target = sent - self._base[index]
        scales = torch.zeros(len(self._unknown), dtype=torch.float64)
        if self._unknown:
            basis = torch.stack([u[index].reshape(-1) for u in self._unknown], 1)
            scales = torch.linalg.lstsq(basis, target.reshape(-1, 1)).solution.reshape(-1)
        states = self._base.clone()
        for scale, values in zip(scales.tolist(), self._unknown):
            states += scale * values
        error = (sent - states[index]).abs().amax(1)
        tolerance = RELATIVE_TOLERANCE * max(1.0, float(sent.abs().max()) if len(sent) else 1.0)
        wrong = np.flatnonzero(error.numpy() > tolerance)
        if len(wrong):
            i = int(wrong[0])
            self.findings.append(
                f"{where}: the message of client {int(senders[i])} differs from its declared state "
                f"(the declared mixture of releases and public values) by {float(error[i]):.3g}: it "
                "mixes something it did not declare"
            )
            return None
        states[index] = sent
        return states
