"""Free riding: re-sending an old model instead of computing a new one.

A peer that does not train can still take part: it sends, as this round's model, one it
sent before (``stale_mode = own``: its own message of the last time the exchange ran),
or one another peer sent (``stale_mode = copy``: the message another sender sent the
same receiver the last time the exchange ran, under its own identity; that needs the
omniscient view of the simulator, and falls back to `own` where the attacker observes
nothing, as a lone device peer). Its first message of an exchange is its honest one:
there is nothing to replay yet. Only the ``update.*`` entries are replayed.

Where a method declares an exchange's payloads fresh (`Method.fresh_payloads`: DP
methods whose every message follows a noisy step), the receive gate rejects both,
naming the sender: ``stale payload from <id>``, ``copied payload from <id>``
(`p4bench.engine.payload_history`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p4bench.engine import Attack, Messages
from p4bench.engine.threats import update_vectors, with_update_vectors
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.rng import ClientRng

MODES = ("own", "copy")


@dataclass
class _Sent:
    """Per sender (sorted ids), the ``update.*`` vector it last sent in one exchange, and
    the (sender, receiver) pairs of those messages (sorted by receiver, then sender)."""

    senders: torch.Tensor
    vectors: torch.Tensor
    pairs_dst: torch.Tensor
    pairs_src: torch.Tensor


def _latest(previous: _Sent | None, messages: Messages, vectors: torch.Tensor) -> _Sent:
    """`previous` updated with `messages` (their vectors): the last vector of each sender."""
    senders, dst = messages.src, messages.dst
    if previous is not None:  # a sender's vector of this call after its older one: the last wins
        keep = ~torch.isin(previous.pairs_src, senders)
        vectors = torch.cat([previous.vectors, vectors.to(previous.vectors.dtype)])
        senders = torch.cat([previous.senders, senders])
        dst = torch.cat([previous.pairs_dst[keep], dst])
        pair_src = torch.cat([previous.pairs_src[keep], messages.src])
    else:
        pair_src = messages.src
    order = torch.argsort(senders, stable=True)
    senders, vectors = senders[order], vectors[order]
    last = torch.ones(len(senders), dtype=torch.bool)
    last[:-1] = senders[:-1] != senders[1:]
    by_pair = torch.argsort(dst * (1 << 32) + pair_src, stable=True)
    return _Sent(senders[last], vectors[last], dst[by_pair], pair_src[by_pair])


class StaleReplay(Attack):
    """Malicious clients re-send an earlier model: their own, or another sender's."""

    name = "stale-replay"
    description = (
        "malicious clients re-send their own last model of the exchange (stale_mode=own) or "
        "another sender's (stale_mode=copy) instead of a new one"
    )
    omniscient = True  # copy mode reads the others' messages (`observed`)
    options = Attack.options + (
        Option(
            "stale_mode",
            str,
            "own",
            "own: re-send one's own last message of the exchange; copy: the one another "
            "sender last sent the same receiver (needs the simulator's omniscient view)",
            choices=MODES,
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.mode = str(self.option_values["stale_mode"])
        self.sent: dict[str, _Sent] = {}  # own messages, per exchange
        self.seen: dict[str, _Sent] = {}  # the honest messages observed, per exchange

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
        observed: Messages | None = None,
        colluding: Messages | None = None,
    ) -> Messages:
        honest = update_vectors(messages.payload)
        vectors = honest.clone()
        others = self.seen.get(exchange)
        if self.mode == "copy" and others is not None and len(others.senders):
            vectors = self._copied(messages, others, vectors)
        else:
            vectors = self._own(exchange, messages, vectors)
        self.sent[exchange] = _latest(self.sent.get(exchange), messages, vectors)
        if self.mode == "copy" and observed is not None and len(observed):  # copied next time
            self.seen[exchange] = _latest(None, observed, update_vectors(observed.payload))
        return Messages(messages.src, messages.dst, with_update_vectors(messages.payload, vectors))

    def _own(self, exchange: str, messages: Messages, vectors: torch.Tensor) -> torch.Tensor:
        """Each sender's last sent vector where it has one (else its honest one)."""
        before = self.sent.get(exchange)
        if before is None or not len(before.senders):
            return vectors
        position = torch.searchsorted(before.senders, messages.src).clamp_max(
            len(before.senders) - 1
        )
        known = before.senders[position] == messages.src
        vectors[known] = before.vectors[position[known]].to(vectors.dtype)
        return vectors

    @staticmethod
    def _copied(messages: Messages, others: _Sent, vectors: torch.Tensor) -> torch.Tensor:
        """Each message's vector: another sender's last one to the same receiver (else
        any other sender's), so that the receiver got the original too."""
        key = others.pairs_dst * (1 << 32) + others.pairs_src
        last = len(key) - 1
        first = torch.searchsorted(key, messages.dst * (1 << 32)).clamp_max(
            last
        )  # its first sender
        # the receiver's first sender may be the attacker itself: take the next one then
        chosen = torch.where(
            others.pairs_src[first] == messages.src, (first + 1).clamp_max(last), first
        )
        source = others.pairs_src[chosen]
        to_receiver = (others.pairs_dst[chosen] == messages.dst) & (source != messages.src)
        source = torch.where(to_receiver, source, others.senders[0].expand_as(source))
        position = torch.searchsorted(others.senders, source).clamp_max(len(others.senders) - 1)
        return others.vectors[position].to(vectors.dtype)
