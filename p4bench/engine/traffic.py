"""The communication ledger of one block (a round, or a phase's setup steps): the bytes
each client sent and received over the network, and the block's totals. A node does not
send to itself over the network; the server (id -1) has no row. The counts stay where the
messages are (no host read per exchange) and are read once, in the block's report."""

from __future__ import annotations

import torch

from p4bench.engine.messages import Messages, broadcast_receipts

__all__ = ["TrafficLedger"]


class TrafficLedger:
    """Bytes sent and received in one block, per client and in all."""

    def __init__(self, num_clients: int) -> None:
        self.sent, self.received = (
            torch.zeros(num_clients, dtype=torch.int64),
            torch.zeros(num_clients, dtype=torch.int64),
        )
        self.bytes_sent, self.bytes_received = (
            torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64),
        )

    def account(
        self,
        outgoing: Messages,
        sent_sizes: torch.Tensor,
        inbox: Messages,
        inbox_sizes: torch.Tensor,
        exchange: str,
        round_index: int,
        broadcasts: bool,
    ) -> None:
        """Add one exchange: what was sent (`outgoing`, sizes as sent) and what arrived
        (`inbox`); with `broadcasts`, every client but the sender got a copy."""
        for messages, sizes, total, per_client, node in (
            (outgoing, sent_sizes, self.bytes_sent, self.sent, outgoing.src),
            (inbox, inbox_sizes, self.bytes_received, self.received, inbox.dst),
        ):
            if not len(messages):
                continue
            sizes = sizes.to(total.device)
            wire = (messages.src != messages.dst).to(total.device)
            total += (sizes * wire).sum()  # no host read: masks, not boolean indexing
            if broadcasts and per_client is self.received:  # every client but the sender got a copy
                per_client += broadcast_receipts(
                    exchange, round_index, messages, len(per_client)
                ).to(total.device)
                wire &= ~messages.is_broadcast().to(total.device)
            client = wire & (node.to(total.device) >= 0)
            per_client.index_add_(0, node.to(total.device).clamp_min(0), sizes * client)
