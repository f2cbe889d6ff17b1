"""Stale and copied payloads: the receive gate's check that a message's model is new.

Where a method declares an exchange's payloads fresh (`Method.fresh_payloads`: every
honest message carries a model that went through a DP release with fresh noise since
the sender's last message of the exchange), an honest ``update.*`` payload never repeats
bit for bit, neither the sender's own earlier message nor another sender's. A repeat is
therefore a peer that did not do its round:

- **stale**: the payload is the one the same sender sent to the same receiver the last
  time the exchange ran (free riding: an old model re-sent as the current one);
- **copied**: the payload is one another sender sent to the same receiver, earlier in
  the same exchange (the first delivered keeps it: a copier can only re-send what it
  has received, so on a real network the original arrives first) or the last time the
  exchange ran (a peer re-sending another's model under its own identity).

Each message is judged at its receiver only, from what that receiver got, so a device
peer and the simulator (which holds every receiver) decide alike. An all-zero update is
never judged: a client that took no step (its privacy budget spent) honestly sends one.

Payloads are compared by a 64-bit digest per table row, computed batched on the
payload's bits (chunks of columns, never a loop over clients); a current-exchange copy
is confirmed bit for bit before it is rejected. The history keeps one digest per
(receiver, sender) pair and exchange name, the latest: a device peer one per sender,
the simulator at most one per edge of the exchange's graph. It never grows with rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p4bench.engine.messages import Messages, update_keys

__all__ = ["PayloadHistory", "RepeatChecks", "row_digests"]

# splitmix64's constants, as signed 64-bit integers (torch has no unsigned int64 arithmetic)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX_A = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX_B = -7723592293110705685  # 0x94D049BB133111EB
# int64 elements hashed at once (bounds the temporaries: a few of these per chunk)
_CHUNK_ELEMENTS = 1 << 21
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _shift_right(value: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (value >> bits) & ((1 << (64 - bits)) - 1)


def _mix(value: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: every input bit reaches every output bit (wrapping int64)."""
    value = (value ^ _shift_right(value, 30)) * _MIX_A
    value = (value ^ _shift_right(value, 27)) * _MIX_B
    return value ^ _shift_right(value, 31)


def _bits(value: torch.Tensor) -> torch.Tensor:
    """(rows, width) the raw bits of each row as integers (a bitwise view, no rounding):
    64-bit words where a row's bytes divide into them (half the words of float32)."""
    flat = value.reshape(len(value), -1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    if flat.is_complex():
        flat = torch.view_as_real(flat.contiguous()).reshape(len(value), -1)
    flat = flat.contiguous()
    if (flat.shape[1] * flat.element_size()) % 8 == 0:
        return flat.view(torch.int64)
    return flat.view(_BITS[flat.element_size()])


def row_digests(table: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """((rows,) int64 digest, (rows,) bool nonzero) of the ``update.*`` entries of each
    table row: a sum over its 64-bit words of each word, salted by its position, multiplied
    by an odd constant and folded; equal rows give equal digests, and different ones
    (noisy models) practically never do. `nonzero` is False for a row whose update bits
    are all zero."""
    keys = update_keys(table)
    rows = len(table[keys[0]]) if keys else 0
    device = table[keys[0]].device if keys else torch.device("cpu")
    digest = torch.zeros(rows, dtype=torch.int64, device=device)
    nonzero = torch.zeros(rows, dtype=torch.bool, device=device)
    offset = 0
    for key in keys:
        bits = _bits(table[key])
        width = bits.shape[1]
        step = max(1, _CHUNK_ELEMENTS // max(rows, 1))
        for start in range(0, width, step):  # chunks of columns: every row at once
            part = bits[:, start : start + step].to(torch.int64)
            position = torch.arange(
                offset + start, offset + start + part.shape[1], dtype=torch.int64, device=device
            )
            salt = _mix(position * _GOLDEN + 1)  # per column: the same word elsewhere hashes apart
            word = (part ^ salt) * _MIX_A
            digest += (word ^ (word >> 32)).sum(dim=1)
            nonzero |= (part != 0).any(dim=1)
        offset += width
    return digest, nonzero


def _receiver_keys(dst: torch.Tensor, digests: torch.Tensor) -> torch.Tensor:
    """A digest bound to its receiver: equal only for the same payload at the same receiver."""
    return _mix(digests + (dst + 2) * _GOLDEN)


@dataclass
class _Seen:
    """One exchange's history: the latest digest of each (receiver, sender) pair."""

    pairs: torch.Tensor  # (h,) sorted pair keys
    digests: torch.Tensor  # (h,) aligned with `pairs`
    at_receiver: torch.Tensor  # (h,) sorted `_receiver_keys` of the same entries


@dataclass
class RepeatChecks:
    """The verdicts on one inbox (module docstring), one entry per message."""

    not_stale: torch.Tensor  # (n,) bool
    not_copied: torch.Tensor  # (n,) bool
    judged: torch.Tensor  # (n,) bool: the messages recorded once admitted
    digests: torch.Tensor  # (n,) int64


class PayloadHistory:
    """Per exchange name, the digest each receiver last accepted from each sender."""

    def __init__(self, nodes: int) -> None:
        self.span = nodes + 2  # ids -2 (broadcast), -1 (the server) .. nodes - 1
        self.seen: dict[str, _Seen] = {}

    def entries(self) -> int:
        """Digests held over every exchange (what the history's memory grows with)."""
        return sum(len(s.pairs) for s in self.seen.values())

    def _pair_keys(self, inbox: Messages) -> torch.Tensor:
        src = inbox.src.clamp(-1, self.span - 3)
        dst = inbox.dst.clamp(-2, self.span - 3)
        return (dst + 2) * self.span + (src + 1)

    def check(self, exchange: str, inbox: Messages) -> RepeatChecks:
        """Stale and copied messages of `inbox` (nothing is recorded: see `record`)."""
        digests_of_rows, nonzero_rows = row_digests(inbox.table)
        rows = inbox.table_rows().to(digests_of_rows.device)
        digests, judged = digests_of_rows[rows], nonzero_rows[rows]
        device = digests.device
        src, dst = inbox.src.to(device), inbox.dst.to(device)
        at_receiver = _receiver_keys(dst, digests)
        stale = torch.zeros(len(inbox), dtype=torch.bool, device=device)
        copied = self._copied_now(inbox, at_receiver, src, judged)
        seen = self.seen.get(exchange)
        if seen is not None and len(seen.pairs):
            pairs = self._pair_keys(inbox).to(device)
            position = torch.searchsorted(seen.pairs, pairs).clamp_max(len(seen.pairs) - 1)
            stale = (seen.pairs[position] == pairs) & (seen.digests[position] == digests) & judged
            # the same payload at this receiver from anyone: more than the sender's own entry is a copy
            matches = torch.searchsorted(
                seen.at_receiver, at_receiver, right=True
            ) - torch.searchsorted(seen.at_receiver, at_receiver)
            copied |= (matches - stale.long() > 0) & judged & ~stale
        return RepeatChecks(~stale, ~copied, judged, digests)

    @staticmethod
    def _copied_now(
        inbox: Messages, at_receiver: torch.Tensor, src: torch.Tensor, judged: torch.Tensor
    ) -> torch.Tensor:
        """(n,) bool: the message repeats, bit for bit, one another sender delivered
        earlier to the same receiver in this exchange."""
        count = len(at_receiver)
        copied = torch.zeros(count, dtype=torch.bool, device=at_receiver.device)
        if count < 2:
            return copied
        order = torch.argsort(at_receiver, stable=True)  # within a payload: delivery order
        ordered = at_receiver[order]
        starts = torch.ones(count, dtype=torch.bool, device=ordered.device)
        starts[1:] = ordered[1:] != ordered[:-1]
        group = torch.cumsum(starts.long(), 0) - 1
        owner = order[starts][group]  # the first delivered message of each payload, per message
        suspect = torch.zeros_like(copied)
        suspect[order] = src[order] != src[owner]
        suspect &= judged
        if not bool(suspect.any()):  # the one host read of an honest exchange
            return copied
        index = suspect.nonzero().squeeze(1)
        first = torch.empty_like(order)
        first[order] = owner
        confirmed = _same_rows(inbox, index, first[index])  # a digest collision is not a copy
        copied[index[confirmed]] = True
        return copied

    def record(
        self, exchange: str, inbox: Messages, checks: RepeatChecks, admitted: torch.Tensor
    ) -> None:
        """Keep the digests of the `admitted` judged messages, the latest per pair."""
        keep = (admitted.to(checks.judged.device)) & checks.judged
        pairs = self._pair_keys(inbox).to(keep.device)[keep]
        digests = checks.digests[keep]
        old = self.seen.get(exchange)
        if old is not None:  # new entries after the old ones: the last of equal keys wins
            pairs, digests = torch.cat([old.pairs, pairs]), torch.cat([old.digests, digests])
        if not len(pairs):
            return
        order = torch.argsort(pairs, stable=True)
        pairs, digests = pairs[order], digests[order]
        last = torch.ones(len(pairs), dtype=torch.bool, device=pairs.device)
        last[:-1] = pairs[:-1] != pairs[1:]
        pairs, digests = pairs[last], digests[last]
        dst = torch.div(pairs, self.span, rounding_mode="floor") - 2
        self.seen[exchange] = _Seen(pairs, digests, torch.sort(_receiver_keys(dst, digests)).values)


def _same_rows(inbox: Messages, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """(k,) bool: message first[i]'s ``update.*`` payload equals message second[i]'s bit for bit."""
    rows = inbox.table_rows().to(first.device)
    same = torch.ones(len(first), dtype=torch.bool, device=first.device)
    for key in update_keys(inbox.table):
        bits = _bits(inbox.table[key])
        same &= (bits[rows[first]] == bits[rows[second]]).all(dim=1)
    return same
