"""Equivocation detection: receivers compare signed digests of what one sender sent them.

A sender that must send every receiver the same message (a broadcast; a gossip node's one
model to each neighbour, `Method.identical_messages`) could send different ones: a
poisoned model to some neighbours only, which no per-receiver defense can see. After
every exchange the method declares so, the round driver runs two small exchanges through
the run's own `Network` (so every runtime, a device peer over TLS included, does the same):

1. ``signed:<exchange>``: with each message it sent, a sender sends the same receiver an
   Ed25519 signature over the statement (phase, round, exchange and its occurrence in the
   block, sender, digest), the digest a 128-bit BLAKE2b of the declared payload entries.
   The receiver recomputes the digest of what it got and checks the signature; a message
   without a matching valid signature is rejected (``unsigned message from <id>``).
2. ``digests:<exchange>``: every node sends every other (a broadcast) its report: one entry
   per sender it received from, with the digest it got and the sender's signature over it
   (one message per entry, all of one layout: a node may send up to N + 1 of them,
   `check_messages_per_pair`).

Each node then compares, per sender, the digests reported by all receivers (its own
included). Where all agree nothing else is done (the honest path has no signature check
beyond the receipts). Where they differ, every reported signature is checked: a sender
with two valid signatures over different digests of the same exchange is an
**equivocator** (``equivocation from <id>``, counted once per message of its that this
process's nodes received; with option ``equivocation = drop``, the default, those
messages are left out of `receive`); a report whose signature is not valid names its
**reporter** (``false digest report from <id>``), never the sender.

Trust model. Soundness rests on the signatures: a lying receiver can only report what the
sender signed, and an honest sender signs one digest per exchange occurrence, so it cannot
be framed; a sender that signs two digests has equivocated, whoever reports them. A
reporter can withhold its report or send different reports to different nodes: that can
hide an equivocation from some nodes (a node only concludes from the reports it got), never
name an honest node. Completeness needs two receivers that report what they got; the
equivocator's own (colluding) receivers need not. Keys: a runtime's network may hand the
driver its nodes' keys (attribute ``node_keys``, a `NodeKeys`); otherwise every node's
key is derived from the run seed (`SeedKeys`): the simulator's harness holds all of them,
which models honest-but-separate keys for the simulated attacks (the harness signs for
every node what it sends). A device peer's network hands over its peer's own TLS key and
the certificates the other peers presented (`p4bench_device.signing_keys`), so no peer
can sign for another. Statements do not name the run: a run with the same seed and
keys could replay another's signatures.

Privacy: a digest is a function of a message its receivers already got (post-processing of
a DP release); the digest exchange shows it to nodes that did not receive the message,
which the local-DP guarantee of each release already covers (it holds against every
observer). Cost: per covered exchange, one signed message per message sent, and one
89-byte report entry per message received, sent to every other node (O(N^2 d) bytes on a
graph of in-degree d: the reports must reach receivers that are not neighbours); hashing and signing are host work per
message (a Python loop over messages, not a per-message device sync: the payload is read
from the device once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from p4bench.engine.check_exchanges import digests_exchange, messages_per_pair, signed_exchange
from p4bench.engine.messages import BROADCAST, Messages
from p4bench.engine.network import Network
from p4bench.engine.receive_gate import Rejections
from p4bench.engine.signed_digests import (
    SIGNATURE_BYTES,
    NodeKeys,
    SeedKeys,
    Statement,
    first_per,
    host_field,
    row_digests,
    sign_all,
    verify_all,
)
from p4bench.engine.traffic import TrafficLedger
from p4bench.options import Option
from p4bench.rng import SERVER_ID

if TYPE_CHECKING:
    from p4bench.engine.job import Job

__all__ = [
    "EQUIVOCATION_MODES",
    "EQUIVOCATION_OPTION",
    "EquivocationCheck",
    "digests_exchange",
    "equivocation_check",
    "messages_per_pair",
    "signed_exchange",
]

EQUIVOCATION_MODES = ("drop", "name", "none")
EQUIVOCATION_OPTION = Option(
    "equivocation",
    str,
    "drop",
    "equivocation check of exchanges whose messages must be the same for every receiver "
    "(receivers compare the senders' signed digests): drop (name the equivocator and leave "
    "its messages of the exchange out), name (name it only) or none (no digest exchanges)",
    choices=EQUIVOCATION_MODES,
)
DIGEST = "digest"  # (2,) int64: a 128-bit BLAKE2b of the covered payload entries
SIGNATURE = "signature"  # (64,) uint8: the sender's Ed25519 signature over the statement
SENDER = "sender"  # () int64: the node a report entry is about (-1: the server)


class _Declares(Protocol):
    def identical_messages(
        self, exchange: str, phase: str, round_index: int
    ) -> bool | frozenset[str]: ...


@dataclass
class _Receipts:
    """Per inbox message (host tensors): its digest, the signature that came with it, and
    whether that signature is the sender's over the digest (messages to oneself: True)."""

    digests: torch.Tensor  # (n, 2) int64
    signatures: torch.Tensor  # (n, 64) uint8
    valid: torch.Tensor  # (n,) bool


class EquivocationCheck:
    """The signed-digest comparison of the covered exchanges of one process (module docstring).

    `held`: the node ids this process holds; `carry_broadcasts`: whether the network
    delivers a broadcast as one message (else one copy per receiver is sent)."""

    def __init__(
        self,
        method: _Declares,
        network: Network,
        rejections: Rejections,
        keys: NodeKeys,
        mode: str,
        held: torch.Tensor,
        num_clients: int,
        carry_broadcasts: bool,
    ) -> None:
        self.method, self.network, self.rejections, self.keys = method, network, rejections, keys
        self.mode, self.nodes, self.carry_broadcasts = mode, num_clients, carry_broadcasts
        self.held = torch.sort(held.cpu()).values
        self.traffic = TrafficLedger(num_clients)
        self._occurrences: dict[str, int] = {}
        self._unfinished = False
        # table -> its rows' digests, within one check: in process, what was sent is what arrived
        self._digests: dict[tuple[int, ...], torch.Tensor] = {}

    def begin_block(self, traffic: TrafficLedger) -> None:
        """A new block, whose ledger counts the check's exchanges; occurrences restart at 0."""
        self.traffic = traffic
        self._occurrences.clear()

    def covered_keys(self, exchange: str, phase: str, round_index: int) -> tuple[str, ...] | None:
        """The payload keys that must be the same for every receiver in this exchange (empty:
        all of them), or None where it is not checked (not declared, or equivocation = none)."""
        declared = self.method.identical_messages(exchange, phase, round_index)
        if self.mode == "none" or declared is False or not declared:
            return None
        return () if declared is True else tuple(sorted(declared))

    def admit(
        self, exchange: str, phase: str, round_index: int, outgoing: Messages, inbox: Messages
    ) -> Messages:
        """`inbox` after the check where the exchange is covered (the main exchange is then
        timed as finished before the check's own), else `inbox` as it is."""
        keys = self.covered_keys(exchange, phase, round_index)
        self._unfinished = keys is None
        if keys is None:
            return inbox
        self.network.finish_exchange(exchange)
        return self.check(exchange, phase, round_index, keys, outgoing, inbox)

    def finish_exchange(self, exchange: str) -> None:
        """Tell the network the exchange is over, unless `admit` already did."""
        if self._unfinished:
            self.network.finish_exchange(exchange)

    def check(
        self,
        exchange: str,
        phase: str,
        round_index: int,
        keys: tuple[str, ...],
        outgoing: Messages,
        inbox: Messages,
    ) -> Messages:
        """`inbox` (what this process's nodes received and admitted) less what the check
        drops, after its two exchanges; `outgoing`: what they sent, `keys` the covered ones."""
        occurrence = self._occurrences.get(exchange, 0)
        self._occurrences[exchange] = occurrence + 1
        where: Statement = (phase, round_index, exchange, occurrence)
        admitted, outgoing = inbox, outgoing.expand_broadcasts(self.nodes)
        inbox = inbox.expand_broadcasts(self.nodes)  # a broadcast: one copy per receiver
        chosen = keys or tuple(sorted(outgoing.table)) or tuple(sorted(inbox.table))
        self._digests.clear()
        sent = self._signed(outgoing, chosen, where)
        receipts = self._receipts(
            inbox, chosen, self._send(signed_exchange(exchange), where, sent), where
        )
        self._digests.clear()
        reports = self._reports(inbox, receipts)
        received = self._send(digests_exchange(exchange), where, reports)
        equivocators = self._compare(Messages.concat([reports, received]), where)
        foreign = (
            (inbox.src != inbox.dst) & torch.isin(inbox.dst, self.held.to(inbox.dst.device))
        ).cpu()
        drop = self.mode == "drop"
        keep = (
            receipts.valid | ~foreign
            if drop
            else torch.ones(len(inbox), dtype=torch.bool, device="cpu")
        )
        if len(equivocators):
            named = foreign & torch.isin(inbox.src.cpu(), equivocators)
            if bool(named.any()):
                self.rejections.add("equivocation", inbox.src.cpu()[named])
            if drop:
                keep &= ~named
        return admitted if bool(keep.all()) else inbox.select(keep.to(inbox.src.device))

    def _send(self, name: str, where: Statement, outgoing: Messages) -> Messages:
        """One of the check's exchanges, carried by the run's network and counted in the
        block's ledger like the method's (timed as an exchange of its own)."""
        phase, round_index = where[0], where[1]
        self.network.start_exchange(name)
        if not self.carry_broadcasts:
            outgoing = outgoing.expand_broadcasts(self.nodes)
        broadcasts = len(outgoing) > 0 and bool(outgoing.is_broadcast().any())
        delivery = self.network.exchange(name, phase, round_index, outgoing)
        self.traffic.account(
            outgoing,
            delivery.sent_sizes,
            delivery.inbox,
            delivery.inbox_sizes,
            name,
            round_index,
            broadcasts,
        )
        self.network.finish_exchange(name)
        return delivery.inbox

    # -- the senders' signatures ---------------------------------------------------------
    def _message_digests(self, messages: Messages, keys: Sequence[str]) -> torch.Tensor:
        """(n, 2) int64 on the host: each message's digest (each table hashed once per check)."""
        if not len(messages):
            return torch.zeros((0, 2), dtype=torch.int64, device="cpu")
        table = tuple(id(messages.table[k]) for k in keys if k in messages.table)
        if table not in self._digests:
            self._digests[table] = row_digests(messages, keys)
        return self._digests[table][messages.table_rows().cpu()]

    def _signed(self, outgoing: Messages, keys: Sequence[str], where: Statement) -> Messages:
        """One message per message sent to another node: its digest, the sender's signature."""
        away = (outgoing.src != outgoing.dst).cpu()
        digests = self._message_digests(outgoing, keys)[away]
        sent = outgoing.select(away.to(outgoing.src.device))
        signatures = sign_all(self.keys, sent.src, digests, where)
        device = sent.src.device
        payload = {DIGEST: digests.to(device), SIGNATURE: signatures.to(device)}
        return Messages(sent.src, sent.dst, payload)

    def _receipts(
        self, inbox: Messages, keys: Sequence[str], signed: Messages, where: Statement
    ) -> _Receipts:
        """Each inbox message's digest and signature (the first signed message of its sender
        to its receiver); messages without a valid one are counted as unsigned."""
        src, dst = inbox.src.cpu(), inbox.dst.cpu()
        foreign = src != dst
        digests = self._message_digests(inbox, keys)
        signatures = torch.zeros((len(inbox), SIGNATURE_BYTES), dtype=torch.uint8, device="cpu")
        valid = ~foreign
        their_digests = host_field(signed, DIGEST, torch.int64, (2,))
        their_signatures = host_field(signed, SIGNATURE, torch.uint8, (SIGNATURE_BYTES,))
        if (
            bool(foreign.any())
            and len(signed)
            and their_digests is not None
            and their_signatures is not None
        ):
            span = self.nodes + 3  # ids -2 .. N
            signed_pairs = (signed.src.cpu() + 2) * span + (signed.dst.cpu() + 2)
            first = first_per(signed_pairs).nonzero().squeeze(1)
            pairs, order = torch.sort(signed_pairs[first])
            wanted = (src + 2) * span + (dst + 2)
            at = torch.searchsorted(pairs, wanted).clamp_max(len(pairs) - 1)
            index = first[order][at]
            match = foreign & (pairs[at] == wanted) & (their_digests[index] == digests).all(dim=1)
            signatures[match] = their_signatures[index][match]
            valid = valid | match
            valid[match] = verify_all(
                self.keys, src[match], digests[match], signatures[match], where
            )
        unsigned = foreign & ~valid
        if bool(unsigned.any()):
            self.rejections.add("unsigned message", src[unsigned])
        return _Receipts(digests, signatures, valid)

    # -- the receivers' reports -----------------------------------------------------------
    def _reports(self, inbox: Messages, receipts: _Receipts) -> Messages:
        """One broadcast entry per (held receiver, sender) it got a valid signed message from:
        the sender, the digest and the sender's signature over it. Entries, not a slot per
        node: a report costs what its receiver got (its in-degree), not the federation's size."""
        held = self.held
        src, dst = inbox.src.cpu(), inbox.dst.cpu()
        ok = receipts.valid & (src != dst) & torch.isin(dst, held)
        ok &= (src >= SERVER_ID) & (src < self.nodes)
        chosen = ok.nonzero().squeeze(1)
        chosen = chosen[first_per(dst[chosen] * (self.nodes + 2) + src[chosen] + 1)]  # one per pair
        device = inbox.src.device
        payload = {
            SENDER: src[chosen],
            DIGEST: receipts.digests[chosen],
            SIGNATURE: receipts.signatures[chosen],
        }
        return Messages(
            dst[chosen].to(device),
            torch.full((len(chosen),), BROADCAST, device=device),
            {k: v.to(device) for k, v in payload.items()},
        )

    def _compare(self, reports: Messages, where: Statement) -> torch.Tensor:
        """The senders that two valid reports show signing different digests; reporters of
        an invalid signature are counted as false reporters."""
        none = torch.zeros(0, dtype=torch.int64, device="cpu")
        sender = host_field(reports, SENDER, torch.int64, ())
        digest = host_field(reports, DIGEST, torch.int64, (2,))
        signature = host_field(reports, SIGNATURE, torch.uint8, (SIGNATURE_BYTES,))
        if sender is None or digest is None or signature is None or not len(reports):
            return none
        reporter = reports.src.cpu()
        # one entry per (reporter, sender), from known nodes, never about the reporter itself
        usable = (reporter >= SERVER_ID) & (reporter < self.nodes) & (sender >= SERVER_ID)
        usable &= (sender < self.nodes) & (sender != reporter)
        usable &= first_per((reporter + 1) * (self.nodes + 2) + sender.clamp(-1, self.nodes) + 1)
        reporter, sender = reporter[usable], sender[usable]
        digest, signature = digest[usable], signature[usable]
        if not len(sender):
            return none
        order = torch.argsort(sender, stable=True)
        grouped = sender[order]
        _, counts = torch.unique_consecutive(grouped, return_counts=True)
        starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        differs = (digest[order] != digest[order][starts]).any(dim=1)
        if not bool(differs.any()):  # the honest path: one host read, no signature checked
            return none
        equivocators, liars = [], []
        for who in torch.unique(grouped[differs]).tolist():  # senders reported inconsistently
            rows = (sender == who).nonzero().squeeze(1)
            claimed = torch.full((len(rows),), who, dtype=torch.int64, device="cpu")
            ok = verify_all(self.keys, claimed, digest[rows], signature[rows], where)
            if len({tuple(d) for d in digest[rows[ok]].tolist()}) > 1:
                equivocators.append(who)
            liars += reporter[rows[~ok]].tolist()
        clients = self.held[self.held >= 0]
        for liar in sorted(set(liars)):  # once per held client that received the report
            self.rejections.add(
                "false digest report",
                torch.full((int((clients != liar).sum()),), liar, device="cpu"),
            )
        return torch.tensor(equivocators, dtype=torch.int64, device="cpu")


def equivocation_check(
    job: Job,
    network: Network,
    rejections: Rejections,
    group_rows: Sequence[torch.Tensor],
    holds_server: bool,
    carry_broadcasts: bool,
) -> EquivocationCheck:
    """The run's check: option ``equivocation`` (declared by the methods that declare
    `identical_messages`), the network's node keys where it has them (attribute
    ``node_keys``, a `NodeKeys`), else keys derived from the run seed (`SeedKeys`)."""
    given = job.config.options.get("equivocation")
    mode = EQUIVOCATION_OPTION.resolve(given, "options.equivocation")
    inner = getattr(network, "inner", None)  # a wrapped network (the privacy checks observe it)
    given_keys = getattr(network, "node_keys", None) or getattr(inner, "node_keys", None)
    keys: NodeKeys = given_keys or SeedKeys(job.config.seed)
    nodes = job.data.num_clients
    server = [torch.tensor([SERVER_ID], device="cpu")] if holds_server else []
    held = torch.cat([rows.cpu() for rows in group_rows] + server)
    return EquivocationCheck(
        job.method, network, rejections, keys, mode, held, nodes, carry_broadcasts
    )
