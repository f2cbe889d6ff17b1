"""Networks: how one exchange's messages travel between the nodes of a run.

The round driver (`p4bench.engine.driver`) is the same in every runtime; only the
network object it is handed differs. A network takes the messages that the nodes held
by this process send in one exchange and returns the messages those nodes receive,
with the bytes each message took on the wire (the communication ledger counts them).

- `InProcessNetwork`: every node lives in this process; messages are handed over as
  they are (the simulator and the reference runtime). Frame sizes are computed exactly
  without serialising.
- `BytesNetwork`: every message is encoded to a safetensors frame and decoded by its
  receiver, as a one-process-per-client deployment does.
- The device plugin's TLS network sends frames to peers on other machines.

A node may message itself: such messages are delivered like any other but never cross
the network, so they count no bytes. A message to BROADCAST (every client but its
sender) stays one message on networks that `carry_broadcasts`; on the others the driver
sends one copy per receiver.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from p4bench.engine.messages import Messages, decode, encode, frame_sizes

__all__ = ["Delivery", "Network", "InProcessNetwork", "BytesNetwork", "ObservedNetwork"]


@dataclass
class Delivery:
    """The outcome of one exchange for the nodes of this process."""

    inbox: Messages  # every message addressed to a node of this process, any order
    inbox_sizes: torch.Tensor  # (len(inbox),) int64 bytes each took on the wire
    sent_sizes: torch.Tensor  # (len(outgoing),) int64 bytes each outgoing message took

    @staticmethod
    def local(outgoing: Messages, sizes: torch.Tensor) -> Delivery:
        """Everything sent is received in this process."""
        return Delivery(outgoing, sizes, sizes)


class Network(ABC):
    """Carries the messages of one exchange; one instance per run and process."""

    # Messages come from other parties that may misbehave: the driver then survives a
    # `receive` that fails on them (the node goes on with its own messages only).
    untrusted: ClassVar[bool] = False

    def carry_broadcasts(self, num_clients: int) -> bool:
        """Called once by the round driver: True when this network delivers messages to
        BROADCAST as they are (one message, the receivers find theirs) in a run of
        `num_clients` clients; otherwise the driver sends one message per receiver."""
        return False

    def begin_round(self, phase: str, round_index: int) -> None:
        """Called before the steps of every round (and of a phase's setup, round -1)."""

    def steps_finished(self, phase: str, round_index: int) -> None:
        """Called when the round's steps are done (before evaluation)."""

    def start_exchange(self, exchange: str) -> None:
        """Called before the exchange's messages are computed."""

    def finish_exchange(self, exchange: str) -> None:
        """Called when every node of this process has received the exchange."""

    def computing(self) -> AbstractContextManager[None]:
        """Wraps the driver's computation (as opposed to communication), for runtimes
        that measure the two apart; default: not measured."""
        return nullcontext()

    def receive_failed(self, exchange: str, messages: int) -> None:
        """An untrusted network's `receive` failed on `messages` messages (the driver
        counts it and goes on); log it here."""

    @abstractmethod
    def exchange(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> Delivery:
        """Send `outgoing` (the messages of this process's nodes) and return what this
        process's nodes receive in the exchange."""


class InProcessNetwork(Network):
    """All nodes in this process: delivery is a hand-over. A broadcast stays one message
    (memory grows with senders, not with pairs); its size counts every receiver's frame."""

    def __init__(self) -> None:
        self.num_clients = 0

    def carry_broadcasts(self, num_clients: int) -> bool:
        self.num_clients = num_clients
        return True

    def exchange(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> Delivery:
        return Delivery.local(
            outgoing, frame_sizes(exchange, round_index, outgoing, self.num_clients)
        )


class BytesNetwork(Network):
    """Every message is serialised to its wire frame and parsed back by the receiver."""

    def exchange(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> Delivery:
        frames = [encode(exchange, round_index, m) for m in outgoing.split()]
        received = []
        for frame in frames:
            got_exchange, got_round, message = decode(frame)
            if (got_exchange, got_round) != (exchange, round_index):
                raise RuntimeError(
                    f"message for {got_exchange}/{got_round} delivered during {exchange}/{round_index}"
                )
            received.append(message)
        sizes = torch.tensor([len(frame) for frame in frames], dtype=torch.int64)
        return Delivery.local(Messages.concat(received), sizes)


class ObservedNetwork(Network):
    """Another network, unchanged, with every exchange's outgoing messages shown to
    `on_send(exchange, phase, round_index, outgoing)` before they travel (the privacy
    checks observe what a curious receiver gets)."""

    def __init__(self, inner: Network, on_send: Callable[[str, str, int, Messages], None]) -> None:
        self.inner, self.on_send = inner, on_send
        self.untrusted = inner.untrusted  # type: ignore[misc]  # the wrapped network's policy

    def carry_broadcasts(self, num_clients: int) -> bool:
        return self.inner.carry_broadcasts(num_clients)

    def begin_round(self, phase: str, round_index: int) -> None:
        self.inner.begin_round(phase, round_index)

    def steps_finished(self, phase: str, round_index: int) -> None:
        self.inner.steps_finished(phase, round_index)

    def start_exchange(self, exchange: str) -> None:
        self.inner.start_exchange(exchange)

    def finish_exchange(self, exchange: str) -> None:
        self.inner.finish_exchange(exchange)

    def computing(self) -> AbstractContextManager[None]:
        return self.inner.computing()

    def receive_failed(self, exchange: str, messages: int) -> None:
        self.inner.receive_failed(exchange, messages)

    def exchange(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> Delivery:
        self.on_send(exchange, phase, round_index, outgoing)
        return self.inner.exchange(exchange, phase, round_index, outgoing)
