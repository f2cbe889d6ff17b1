"""Every message a run sends, kept as row fingerprints, and the comparison of two runs' logs.

The post-processing check compares what a recorded run and its replay send, message by
message and payload entry by payload entry, bit for bit. At the run's own size a run
sends its whole traffic many times over, so each message's payload entries are kept as
exact row fingerprints (`p4bench.privacy.fingerprint`) with their norms, not values:
16 bytes and a float per message and entry.

What is not compared: a node's messages to itself (they never leave it); for central DP
(releases `delegate`d to a trusted server), the clients' raw sums addressed to the
server (the server is trusted with them, and its noisy sum is forced like any release);
and the messages of senders an attack controls (their own records are theirs to leak:
the check is of the method, not of the attack).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from p4bench.engine.messages import BROADCAST, Messages
from p4bench.engine.network import Network, ObservedNetwork
from p4bench.privacy.fingerprint import row_fingerprints, row_norms
from p4bench.privacy.tape import ReleaseTape
from p4bench.rng import SERVER_ID

__all__ = ["LoggedExchange", "MessageLog", "compare_logs"]


@dataclass
class LoggedExchange:
    """One exchange's outgoing messages: who sends to whom, and each payload entry's
    dtype and row shape, row fingerprints (n, 2) and row norms (n,)."""

    exchange: str
    phase: str
    round_index: int
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    prints: dict[str, npt.NDArray[np.int64]]
    norms: dict[str, npt.NDArray[np.float64]]

    @property
    def where(self) -> str:
        return f"phase '{self.phase}' round {self.round_index}, exchange '{self.exchange}'"


class MessageLog:
    """The messages of one run, in order; `network(inner)` wraps a runtime's network so
    that every exchange is logged before it travels (and the open tape knows the round)."""

    def __init__(self, tape: ReleaseTape | None = None) -> None:
        self.exchanges: list[LoggedExchange] = []
        self.tape = tape

    def keep(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> None:
        payload = outgoing.payload
        self.exchanges.append(
            LoggedExchange(
                exchange,
                phase,
                round_index,
                outgoing.src.cpu().numpy().astype(np.int64),
                outgoing.dst.cpu().numpy().astype(np.int64),
                {k: (v.dtype, tuple(v.shape[1:])) for k, v in payload.items()},
                {k: row_fingerprints(v) for k, v in payload.items()},
                {k: row_norms(v) for k, v in payload.items()},
            )
        )

    def wrap(self, inner: Callable[[], Network]) -> Callable[[], Network]:
        """A runtime's `network` factory whose networks log here."""
        tape = self.tape

        class Logged(ObservedNetwork):
            def begin_round(self, phase: str, round_index: int) -> None:
                if tape is not None:
                    tape.where = f"phase '{phase}' round {round_index}"
                super().begin_round(phase, round_index)

        return lambda: Logged(inner(), self.keep)


def _node(node: int) -> str:
    return (
        "server" if node == SERVER_ID else "every client" if node == BROADCAST else f"client {node}"
    )


def compare_logs(
    recorded: list[LoggedExchange],
    replayed: list[LoggedExchange],
    *,
    central: bool,
    attackers: torch.Tensor | None = None,
) -> tuple[int, int, list[str]]:
    """(messages compared, messages exempt, one line per differing message). `attackers`:
    (M,) bool, the clients an attack controls (their messages are exempt)."""
    if len(recorded) != len(replayed):
        return (
            0,
            0,
            [
                f"the replay made {len(replayed)} exchanges, the recorded run {len(recorded)}: the schedule "
                "depends on the records"
            ],
        )
    compared = exempt = 0
    differences: list[str] = []
    for a, b in zip(recorded, replayed):
        where = a.where
        if (a.exchange, a.phase, a.round_index) != (b.exchange, b.phase, b.round_index):
            return (
                compared,
                exempt,
                differences + [f"{where}: the replay ran exchange '{b.exchange}' there instead"],
            )
        if not (np.array_equal(a.src, b.src) and np.array_equal(a.dst, b.dst)):
            differences.append(
                f"{where}: the replay sent to other nodes (who talks to whom depends on the records)"
            )
            continue
        if a.layout != b.layout:
            differences.append(
                f"{where}: payload entries {sorted(b.layout)} on the replay, {sorted(a.layout)} recorded "
                "(or their shapes or dtypes differ)"
            )
            continue
        skip = a.src == a.dst
        if central:  # the trusted server's raw input
            skip |= (a.dst == SERVER_ID) & (a.src != SERVER_ID)
        if attackers is not None and len(attackers):
            controlled = attackers.cpu().numpy().astype(bool)
            sender = a.src.clip(0, len(controlled) - 1)
            skip |= (a.src >= 0) & (a.src < len(controlled)) & controlled[sender]
        exempt += int(skip.sum())
        compared += int((~skip).sum())
        keys = sorted(a.layout)
        if not keys:
            continue
        differs = (
            np.stack([(a.prints[k] != b.prints[k]).any(axis=1) for k in keys], axis=1)
            & ~skip[:, None]
        )
        for i in np.flatnonzero(differs.any(axis=1)).tolist():
            key = keys[int(np.flatnonzero(differs[i])[0])]  # the message's first differing entry
            differences.append(
                f"{where}: message {_node(int(a.src[i]))} -> {_node(int(a.dst[i]))} '{key}' differs "
                f"(norm {float(a.norms[key][i]):.6g} recorded, {float(b.norms[key][i]):.6g} on the "
                "replay)"
            )
    return compared, exempt, differences
