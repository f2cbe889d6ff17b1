"""The equivocation check's own exchanges (`p4bench.engine.equivocation`): their names, and
how many messages one sender may send one destination in each, for the runtimes that cap
messages per pair before buffering them (a device peer)."""

from __future__ import annotations

from p4bench.engine.receive_gate import Declarations

__all__ = ["digests_exchange", "messages_per_pair", "signed_exchange"]


def signed_exchange(exchange: str) -> str:
    """The name of the exchange that carries the senders' signatures of `exchange`."""
    return f"signed:{exchange}"


def digests_exchange(exchange: str) -> str:
    """The name of the exchange that carries the receivers' reports on `exchange`."""
    return f"digests:{exchange}"


def messages_per_pair(
    method: Declarations, exchange: str, phase: str, round_index: int, nodes: int
) -> tuple[int, int]:
    """(per client, per server) the most messages one sender may send one destination in
    `exchange`, the check's own exchanges included: ``signed:<x>`` carries one message per
    message of `x` (its limits), ``digests:<x>`` one report entry per sender (N + 1)."""
    if exchange.startswith("digests:"):
        return nodes + 1, nodes + 1
    exchange = exchange.removeprefix("signed:")
    return (
        int(method.messages_per_pair(exchange, phase, round_index)),
        int(method.server_messages_per_pair(exchange, phase, round_index)),
    )
