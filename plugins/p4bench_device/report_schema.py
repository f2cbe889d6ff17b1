"""The reports peers send the launcher, as types: validated once, on arrival (`parse_report`).

A peer is a separate party: its report is read against what the launcher knows (the
peers file, the method's schedule) before anything of it is used. A report is rejected
(`ReportError`, one reason naming the peer) when it is not a JSON object of this
protocol, its type is unknown, a field is missing or of the wrong type, a number is not
finite, its ``peer`` is not the sender (the certificate's name) or its ``node`` not the
sender's client, its phase and round are not a block of the schedule, or a peer it names
(absent, dropped as slow) is not in the peers file. The rest of the launcher reads typed
attributes only.

``null`` in a number field is what `protocol.dump_json` writes for a value that was not
finite on the peer (a diverged loss): read as None, never as a number. Two things stay
the launcher's own and are not taken from a report: the run's epsilon (`report_check`
charges it from the schedule) and the weights (from the states peers send).

Release claims are parsed one by one: a malformed entry is kept as `MalformedRelease`,
not a reason to reject the report, because it is evidence for the release check (a
mismatch that makes the run uncertified, `report_check`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from p4bench_device.peers import PeersFile
from p4bench_device.protocol import RejectedFrame, load_json

__all__ = [
    "ReportError",
    "Measure",
    "ReleaseClaim",
    "MalformedRelease",
    "Absence",
    "SlowDrop",
    "Ready",
    "Failure",
    "BlockReport",
    "FinalReport",
    "PeerReport",
    "ReportContext",
    "parse_report",
    "parse_releases",
]

JsonObject = dict[
    str, Any
]  # a peer's figures passed on to the summary as they are (transport, profile, link)
T = TypeVar("T")
MAX_NAME = 200  # phase and exchange names (markers are held to the same)


class ReportError(ValueError):
    """A peer's report that the launcher rejects: `peer` sent it, `what` says why."""

    def __init__(self, peer: str, what: str) -> None:
        super().__init__(f"report from peer {peer} rejected: {what}")
        self.peer, self.what = peer, what


@dataclass(frozen=True)
class Measure:
    """One block's measurements on one peer (`measure.RoundClock.finish`, its wire bytes
    and the evaluation that followed): seconds, MB, bytes."""

    wall_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    cpu_s: float = 0.0
    eval_s: float = 0.0
    between_rounds_s: float = 0.0  # the previous block's evaluation and report
    peak_rss_mb: float = 0.0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    compute_segments: tuple[float, ...] = ()  # compute between consecutive exchanges
    exchanges: Mapping[str, Mapping[str, float]] = field(
        default_factory=dict
    )  # per exchange name: summed figures
    power_w: float | None = None  # with a power meter that read something


@dataclass(frozen=True)
class ReleaseClaim:
    """One DP release a peer says it made (checked against the launcher's own figures)."""

    clients: tuple[int, ...]
    sample_rate: float
    noise_multiplier: float
    steps: int
    phase: str
    clip: float | None  # None: the peer ran without a clip setting


@dataclass(frozen=True)
class MalformedRelease:
    """A release entry that does not parse: a mismatch of the release check."""

    why: str


@dataclass(frozen=True)
class Absence:
    """Peers the reporter went without in one exchange."""

    exchange: str
    peers: tuple[str, ...]


@dataclass(frozen=True)
class SlowDrop:
    """A peer the reporter dropped as slow (`liveness`)."""

    peer: str
    seq: int
    phase: str
    round: int
    exchange: str
    reason: str


@dataclass(frozen=True)
class Ready:
    """The peer built its data and method and waits for go."""

    peer: str
    node: int


@dataclass(frozen=True)
class Failure:
    """The peer could not start or run (type ``error``)."""

    peer: str
    node: int
    message: str


@dataclass(frozen=True)
class BlockReport:
    """A peer's report of one block: a round (``kind`` "round") or a phase's setup ("setup", round -1)."""

    kind: Literal["round", "setup"]
    peer: str
    node: int
    phase: str
    round: int
    accuracy: float | None  # None: no client (the server's peer), a setup, or not finite
    extra: Mapping[str, float | None]  # the method's extra accuracies of the peer's client
    losses: tuple[float | None, ...]
    bytes_sent: int
    node_bytes_sent: int
    node_bytes_received: int
    measure: Measure
    releases: tuple[ReleaseClaim | MalformedRelease, ...]
    absent: tuple[Absence, ...]
    slow_dropped: tuple[SlowDrop, ...]
    receive_errors: int
    metrics: Mapping[str, float | None]  # the method's counters on this peer


@dataclass(frozen=True)
class FinalReport:
    """A peer's last report (its state, when it holds a client, comes as the frame before)."""

    peer: str
    node: int
    accuracy: float | None
    extra: Mapping[str, float | None]
    receive_errors: int
    stopped_after_step: int
    finish_after: int | None
    transport: JsonObject  # its transport's figures (`PeerTransport.snapshot`)
    profile: JsonObject | None  # the device profile it applied
    link: JsonObject | None  # its link shaper's figures


PeerReport = Ready | Failure | BlockReport | FinalReport


@dataclass(frozen=True)
class ReportContext:
    """What the launcher knows to read reports against: the peers and the schedule's
    blocks, as (kind, phase, round) with round -1 for a setup."""

    peers: PeersFile
    blocks: frozenset[tuple[str, str, int]]


def parse_report(body: bytes, sender: str, context: ReportContext) -> PeerReport:
    """The report in frame `body` from the peer `sender` (its certificate's name), typed
    and checked (see the module docstring); ReportError otherwise."""
    try:
        data = load_json(body)
    except RejectedFrame as exc:
        raise ReportError(sender, str(exc)) from None
    kind = data.get("type")
    read = _Fields(data, sender, f"{kind} report" if isinstance(kind, str) else "report")
    if kind not in ("ready", "error", "round", "setup", "final"):
        raise read.error("type", f"is {str(kind)[:40]!r}, not ready, error, round, setup or final")
    if read.text("peer") != sender:
        raise read.error("peer", f"is {str(data['peer'])[:70]!r}, not the sender")
    node = read.integer("node")
    expected = context.peers.by_id[sender].node
    if node != expected:
        raise read.error("node", f"is {node}, but peer {sender} holds {_node(expected)}")
    if kind == "ready":
        return Ready(sender, node)
    if kind == "error":
        return Failure(sender, node, read.text("message")[:2000])
    if kind == "final":
        return FinalReport(
            sender,
            node,
            read.optional_number("accuracy"),
            read.numbers("extra"),
            read.integer("receive_errors", 0),
            read.integer("stopped_after_step", 0),
            read.optional(read.integer, "finish_after"),
            read.mapping("transport"),
            read.optional(read.mapping, "profile"),
            read.optional(read.mapping, "link"),
        )
    phase, round_index = read.text("phase"), read.integer("round")
    block: Literal["round", "setup"] = "round" if kind == "round" else "setup"
    if (block, phase, round_index) not in context.blocks:
        raise ReportError(
            sender,
            f"{kind} report: {block} {round_index} of phase {phase[:MAX_NAME]!r} is not in the schedule",
        )
    known = set(context.peers.by_id) - {sender}
    return BlockReport(
        block,
        sender,
        node,
        phase,
        round_index,
        read.optional_number("accuracy"),
        read.numbers("extra"),
        tuple(read.items("losses", _optional_number)),
        read.integer("bytes_sent", 0),
        read.integer("node_bytes_sent", 0),
        read.integer("node_bytes_received", 0),
        _measure(read.sub("measure")),
        parse_releases(read.array("releases")),
        tuple(_absence(entry, known) for entry in read.subs("absent")),
        tuple(_slow_drop(entry, known) for entry in read.subs("slow_dropped")),
        read.integer("receive_errors", 0),
        read.numbers("metrics"),
    )


def parse_releases(entries: Sequence[object]) -> tuple[ReleaseClaim | MalformedRelease, ...]:
    """A report's release claims, entry by entry (see the module docstring)."""
    return tuple(_release(entry) for entry in entries)


def _release(entry: object) -> ReleaseClaim | MalformedRelease:
    if not isinstance(entry, dict):
        return MalformedRelease("not an object")
    read = _Fields(entry, "", "release")
    try:
        clients = tuple(sorted(set(read.items("clients", _integer))))
        claim = ReleaseClaim(
            clients,
            read.number("sample_rate"),
            read.number("noise_multiplier"),
            read.integer("steps", 1),
            read.text("phase")[:100],
            read.optional_number("clip"),
        )
    except ReportError as exc:
        return MalformedRelease(exc.what)
    return claim if clients else MalformedRelease("no clients")


def _measure(read: _Fields) -> Measure:
    seconds = {
        name: read.number(name)
        for name in ("wall_s", "compute_s", "comm_s", "cpu_s", "eval_s", "between_rounds_s")
    }
    peak, sent, received = (
        read.number("peak_rss_mb"),
        read.integer("wire_bytes_sent", 0),
        read.integer("wire_bytes_received", 0),
    )
    segments = tuple(read.items("compute_segments", _number))
    exchanges: dict[str, dict[str, float]] = {}
    for name, figures in read.mapping("exchanges").items():
        inner = read.nested(figures, f"exchange {name[:MAX_NAME]!r}")
        exchanges[name[:MAX_NAME]] = {key: inner.number(key) for key in inner.data}
    power = (
        read.optional_number("power_w") if "power_w" in read.data else None
    )  # only with a power meter
    return Measure(
        **seconds,
        peak_rss_mb=peak,
        wire_bytes_sent=sent,
        wire_bytes_received=received,
        compute_segments=segments,
        exchanges=exchanges,
        power_w=power,
    )


def _absence(read: _Fields, known: set[str]) -> Absence:
    peers = tuple(read.items("peers", _text))
    unknown = sorted(set(peers) - known)
    if unknown:
        raise read.error(
            "peers",
            f"names {', '.join(p[:70] for p in unknown[:3])}: not another peer of the peers file",
        )
    return Absence(read.text("exchange", MAX_NAME), peers)


def _slow_drop(read: _Fields, known: set[str]) -> SlowDrop:
    peer = read.text("peer")
    if peer not in known:
        raise read.error("peer", f"is {peer[:70]!r}: not another peer of the peers file")
    return SlowDrop(
        peer,
        read.integer("seq", 0),
        read.text("phase", MAX_NAME),
        read.integer("round", -1),
        read.text("exchange", MAX_NAME),
        read.text("reason")[:300],
    )


# -- typed reads of JSON values ------------------------------------------------------------
class _Invalid(ValueError):
    """A JSON value not of the type read; its message completes "'field' ...": "is not a string"."""


def _number(value: object) -> float:
    """A finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("is not a number")
    if not math.isfinite(value):
        raise _Invalid("is not finite")
    return float(value)


def _optional_number(value: object) -> float | None:
    """A number, or None for null (a value that was not finite on the peer)."""
    return None if value is None else _number(value)


def _integer(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid("is not an integer")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise _Invalid("is not a string")
    return value


def _node(node: int) -> str:
    return "no client (the server)" if node < 0 else f"client {node}"


class _Fields:
    """Typed reads of one JSON object's fields; the first problem raises ReportError
    naming the peer, the object (`where`) and the field."""

    def __init__(self, data: Mapping[str, object], peer: str, where: str) -> None:
        self.data, self.peer, self.where = data, peer, where

    def error(self, name: str, problem: str) -> ReportError:
        return ReportError(self.peer, f"{self.where}: {name!r} {problem}")

    def read(self, name: str, convert: Callable[[object], T]) -> T:
        if name not in self.data:
            raise self.error(name, "is missing")
        try:
            return convert(self.data[name])
        except _Invalid as exc:
            raise self.error(name, str(exc)) from None

    def number(self, name: str) -> float:
        return self.read(name, _number)

    def optional_number(self, name: str) -> float | None:
        return self.read(name, _optional_number)

    def integer(self, name: str, minimum: int | None = None) -> int:
        value = self.read(name, _integer)
        if minimum is not None and value < minimum:
            raise self.error(name, f"is {value}, below {minimum}")
        return value

    def text(self, name: str, limit: int | None = None) -> str:
        value = self.read(name, _text)
        if limit is not None and len(value) > limit:
            raise self.error(name, f"is longer than {limit} characters")
        return value

    def mapping(self, name: str) -> JsonObject:
        return self.read(name, _object)

    def array(self, name: str) -> list[object]:
        return self.read(name, _list)

    def optional(self, read: Callable[[str], T], name: str) -> T | None:
        """`read(name)`, or None for null."""
        return None if self.read(name, lambda value: value) is None else read(name)

    def items(self, name: str, convert: Callable[[object], T]) -> list[T]:
        """Every entry of the list `name`, converted (one that does not convert: rejected)."""
        converted = []
        for index, value in enumerate(self.array(name)):
            try:
                converted.append(convert(value))
            except _Invalid as exc:
                raise self.error(name, f"entry {index} {exc}") from None
        return converted

    def numbers(self, name: str) -> dict[str, float | None]:
        """An object of numbers (null: not finite on the peer)."""
        inner = self.sub(name)
        return {key: inner.optional_number(key) for key in inner.data}

    def nested(self, value: object, where: str) -> _Fields:
        if not isinstance(value, dict):
            raise ReportError(self.peer, f"{self.where}: {where} is not an object")
        return _Fields(value, self.peer, f"{self.where}: {where}")

    def sub(self, name: str) -> _Fields:
        return self.nested(self.mapping(name), repr(name))

    def subs(self, name: str) -> list[_Fields]:
        return [
            self.nested(entry, f"{name!r} entry {index}")
            for index, entry in enumerate(self.array(name))
        ]


def _object(value: object) -> JsonObject:
    if not isinstance(value, dict):
        raise _Invalid("is not an object")
    return value


def _list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise _Invalid("is not a list")
    return value
