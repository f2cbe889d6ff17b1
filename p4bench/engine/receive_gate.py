"""The receive gate: what every node checks in the messages it receives, before its
method (and the run's defense) sees them.

Authenticated peers can still misbehave (a stolen key, a buggy plugin), so the round
driver holds every inbox to what the receiver itself knows, in every runtime alike:

- **count**: at most `Method.messages_per_pair` messages per sender and destination in
  one exchange (a broadcast counts once for every destination)
  (`Method.server_messages_per_pair` from the server, e.g. a relay
  forwarding every client's model); the first ones delivered are kept, the extras rejected
  (``extra message from <id>``), so repeated copies cannot outvote honest senders;
- **finite**: every floating payload entry finite (``non-finite from <id>``);
- **range**: entries the method bounds (`Method.payload_bounds`), and the conventional
  aggregation weight ``weight`` in [0, N] with N the training records of the data set
  (public: the default delta uses it), (``out of range <key> from <id>``);
- **declared size**: in a run, the ``weight`` (a declared record count) at most the
  sender's own partition's size, else a declared cap, else ignored (every message counts
  1) (`p4bench.engine.declared_sizes`; ``declared records above partition from <id>``);
- **new payload**: where the method declares an exchange's payloads fresh
  (`Method.fresh_payloads`), an ``update.*`` payload that repeats the sender's own last
  one or another sender's (``stale payload from <id>``, ``copied payload from <id>``;
  `p4bench.engine.payload_history`).

Rejections are counted per reason and sender in the round's metrics, as
``rejected <reason> from <id>`` (`REJECTED_PREFIX`); the run summary sums them and the
command line names them in its last line. A method may reject what only it can judge
(a sender's declared weight that changed) through `StepContext.reject`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from p4bench.engine.declared_sizes import DeclaredSizes
from p4bench.engine.messages import BROADCAST, Messages, update_keys
from p4bench.engine.payload_history import PayloadHistory, RepeatChecks
from p4bench.rng import SERVER_ID

if TYPE_CHECKING:
    from p4bench.config import RunConfig

__all__ = [
    "Declarations",
    "REJECTED_PREFIX",
    "WEIGHT_KEY",
    "ReceiveGate",
    "Rejections",
    "rejection_counts",
]

REJECTED_PREFIX = "rejected "
# The payload entry by which methods declare a message's aggregation weight; receivers
# never aggregate with it as sent (see FedAvg's `weighting`), and the gate bounds it.
WEIGHT_KEY = "weight"


class Rejections:
    """Counts of rejected messages by (reason, sender), for one block of a run."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}

    def add(self, reason: str, senders: torch.Tensor) -> None:
        """Count one rejected message per entry of `senders` (node ids)."""
        for sender in senders.reshape(-1).tolist():
            key = (reason, int(sender))
            self.counts[key] = self.counts.get(key, 0) + 1

    def metrics(self) -> dict[str, float]:
        """``rejected <reason> from <id>`` -> count (the round metrics' form)."""
        return {
            f"{REJECTED_PREFIX}{reason} from {sender}": float(n)
            for (reason, sender), n in sorted(self.counts.items())
        }

    def clear(self) -> None:
        self.counts.clear()


def rejection_counts(metrics: Mapping[str, float]) -> dict[str, int]:
    """``<reason> from <id>`` -> count, from (summed) round metrics."""
    return {
        k.removeprefix(REJECTED_PREFIX): int(v)
        for k, v in metrics.items()
        if k.startswith(REJECTED_PREFIX) and v
    }


class Declarations(Protocol):
    """What the gate reads from a method (`p4bench.engine.method.Method` has all of it)."""

    num_clients: int

    def messages_per_pair(self, exchange: str, phase: str, round_index: int) -> int: ...

    def server_messages_per_pair(self, exchange: str, phase: str, round_index: int) -> int: ...

    def payload_bounds(
        self, exchange: str, phase: str, round_index: int
    ) -> dict[str, tuple[float, float]]: ...


class PublicKnowledge(Protocol):
    """What the gate reads from a run (`p4bench.engine.job.Job` has all of it)."""

    @property
    def method(self) -> Declarations: ...

    @property
    def config(self) -> RunConfig: ...

    @property
    def public_records(self) -> int | None: ...

    @property
    def public_partition(self) -> torch.Tensor | None: ...


class ReceiveGate:
    """Admits the messages of one inbox that the receiver can accept (module docstring)."""

    def __init__(
        self,
        method: Declarations,
        public_records: int | None,
        rejections: Rejections,
        declared_sizes: DeclaredSizes | None = None,
    ) -> None:
        self.method = method
        self.public_records = public_records
        self.rejections = rejections
        # per sender, the records it may declare; None: only [0, N] (a gate built outside a run)
        self.declared_sizes = declared_sizes
        self.history = PayloadHistory(int(method.num_clients))

    @classmethod
    def for_job(cls, job: PublicKnowledge, rejections: Rejections) -> ReceiveGate:
        """The gate of a run (a `Job`): its method's declarations and what the run knows
        publicly (the data set's records N, every client's partition, the options)."""
        sizes = DeclaredSizes.of_run(job.public_partition, job.config.options, job.public_records)
        return cls(job.method, job.public_records, rejections, sizes)

    def bounds(self, exchange: str, phase: str, round_index: int) -> dict[str, tuple[float, float]]:
        """Payload key -> inclusive (low, high) for this exchange: the method's, and the
        conventional weight's unless the method bounds it itself."""
        bounds = dict(self.method.payload_bounds(exchange, phase, round_index))
        if self.public_records is not None:
            bounds.setdefault(WEIGHT_KEY, (0.0, float(self.public_records)))
        elif self.declared_sizes is not None:
            bounds.setdefault(WEIGHT_KEY, (0.0, float("inf")))  # the sizes give the upper bound
        return bounds

    def admit(self, exchange: str, phase: str, round_index: int, inbox: Messages) -> Messages:
        """The messages of `inbox` that pass; the others are counted in `rejections`."""
        if not len(inbox):
            return inbox
        nodes = int(self.method.num_clients)
        wide = inbox.is_broadcast()
        known = (
            (inbox.src >= SERVER_ID)
            & (inbox.src < nodes)
            & (((inbox.dst >= SERVER_ID) & (inbox.dst < nodes)) | wide)
        )
        checks = [
            ("unknown node", known),
            ("extra message", self._within_count(exchange, phase, round_index, inbox, nodes)),
            ("non-finite", self._finite(inbox)),
        ]
        checks += self._range_checks(exchange, phase, round_index, inbox)
        repeats = self._repeats(exchange, phase, round_index, inbox)
        if repeats is not None:
            checks += [("copied payload", repeats.not_copied), ("stale payload", repeats.not_stale)]
        passed = torch.stack([ok for _, ok in checks]).all(dim=0)
        if repeats is not None:
            self.history.record(exchange, inbox, repeats, passed)
        inbox = self._weights_as_counted(exchange, phase, round_index, inbox)
        if bool(passed.all()):  # the one host read of an honest exchange
            return inbox
        failed_before = torch.zeros_like(passed)
        for (
            reason,
            ok,
        ) in checks:  # each rejected message counted once, under its first failed check
            first = ~ok & ~failed_before
            if bool(first.any()):
                self.rejections.add(reason, inbox.src[first])
            failed_before |= ~ok
        return inbox.select(passed)

    def _range_checks(
        self, exchange: str, phase: str, round_index: int, inbox: Messages
    ) -> list[tuple[str, torch.Tensor]]:
        """(reason, ok) of the bounded entries: the method's, [0, N] for the weight, and each
        sender's declared size (where the method does not bound the weight itself)."""
        sizes = self._declared_sizes(exchange, phase, round_index, inbox)
        checks = []
        for key, (low, high) in self.bounds(exchange, phase, round_index).items():
            if key in inbox.table:
                if key == WEIGHT_KEY and sizes is not None:
                    high = float("inf")  # the sizes' check names the reason of a count too high
                checks.append((f"out of range {key}", _within(inbox, key, low, high)))
        if sizes is not None:
            checks.append((sizes.reason, sizes.within(inbox.src, inbox.value(WEIGHT_KEY))))
        return checks

    def _declared_sizes(
        self, exchange: str, phase: str, round_index: int, inbox: Messages
    ) -> DeclaredSizes | None:
        """The sizes the inbox's weights are held to, if they bound them."""
        sizes = self.declared_sizes
        if sizes is None or sizes.uniform or WEIGHT_KEY not in inbox.table:
            return None
        return (
            None
            if WEIGHT_KEY in self.method.payload_bounds(exchange, phase, round_index)
            else sizes
        )

    def _weights_as_counted(
        self, exchange: str, phase: str, round_index: int, inbox: Messages
    ) -> Messages:
        """`inbox` with every declared weight 1 where no bound is known (uniform), else as sent."""
        sizes = self.declared_sizes
        if sizes is None or not sizes.uniform or WEIGHT_KEY not in inbox.table:
            return inbox
        if WEIGHT_KEY in self.method.payload_bounds(exchange, phase, round_index):
            return inbox  # the method bounds its weight itself: it is what the method says it is
        return _with_entry(inbox, WEIGHT_KEY, sizes.ignore(inbox.table[WEIGHT_KEY]))

    def _repeats(
        self, exchange: str, phase: str, round_index: int, inbox: Messages
    ) -> RepeatChecks | None:
        """Stale and copied payloads, where the method declares this exchange's fresh."""
        fresh = getattr(
            self.method, "fresh_payloads", None
        )  # a Method has it; other declarations may not
        if fresh is None or not update_keys(inbox.table) or not fresh(exchange, phase, round_index):
            return None
        return self.history.check(exchange, inbox)

    def _within_count(
        self, exchange: str, phase: str, round_index: int, inbox: Messages, nodes: int
    ) -> torch.Tensor:
        """(n,) bool: the message is among the first `messages_per_pair` from its sender
        to its destination, in delivery order."""
        limit = torch.where(
            inbox.src == SERVER_ID,
            int(self.method.server_messages_per_pair(exchange, phase, round_index)),
            int(self.method.messages_per_pair(exchange, phase, round_index)),
        )
        span = (
            nodes + 2
        )  # ids -2 (broadcast), -1 (the server) .. nodes - 1; others are rejected as unknown
        src = inbox.src.clamp(SERVER_ID, nodes - 1)
        pair = (src + 1) * span + (inbox.dst.clamp(BROADCAST, nodes - 1) + 2)
        order = torch.argsort(pair, stable=True)
        _, counts = torch.unique_consecutive(pair[order], return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank_sorted = torch.arange(len(pair), device=pair.device) - torch.repeat_interleave(
            starts, counts
        )
        rank = torch.empty_like(rank_sorted)
        rank[order] = rank_sorted
        # a broadcast reaches every client: it counts against each of its sender's pairs (no host read)
        wide = inbox.is_broadcast()
        broadcasts = torch.zeros(nodes + 1, dtype=torch.int64, device=src.device).index_add_(
            0, src + 1, wide.long()
        )
        return rank + torch.where(wide, 0, broadcasts[src + 1]) < limit

    @staticmethod
    def _finite(inbox: Messages) -> torch.Tensor:
        """(n,) bool: every floating payload entry of the message is finite (checked once
        per table row: a model sent to many receivers is stored once)."""
        ok_rows = torch.ones(_table_rows(inbox), dtype=torch.bool, device=inbox.src.device)
        for value in inbox.table.values():
            if value.is_floating_point() or value.is_complex():
                ok_rows &= (
                    torch.isfinite(value).reshape(len(value), -1).all(dim=1).to(ok_rows.device)
                )
        return ok_rows[inbox.table_rows().to(ok_rows.device)]


def _with_entry(inbox: Messages, key: str, value: torch.Tensor) -> Messages:
    """`inbox` with table entry `key` replaced (same rows, addresses and other entries)."""
    return Messages(inbox.src, inbox.dst, {**inbox.table, key: value}, inbox.rows)


def _table_rows(inbox: Messages) -> int:
    return len(next(iter(inbox.table.values()))) if inbox.table else len(inbox)


def _within(inbox: Messages, key: str, low: float, high: float) -> torch.Tensor:
    """(n,) bool: every element of the message's `key` entry lies in [low, high] (NaN fails)."""
    value = inbox.table[key]
    flat = value.reshape(len(value), -1)
    if not flat.shape[1]:
        return torch.ones(len(inbox), dtype=torch.bool, device=inbox.src.device)
    # each row's extremes, compared in float64 (NaN propagates and fails): no copy of the payload
    smallest, largest = torch.aminmax(flat.double() if value.dtype == torch.bool else flat, dim=1)
    ok_rows = (smallest.double() >= low) & (largest.double() <= high)
    return ok_rows[inbox.table_rows().to(ok_rows.device)].to(inbox.src.device)
