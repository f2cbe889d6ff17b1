"""The device wire protocol: length-prefixed frames on TLS streams, and their limits.

Every frame is ``length (u32) | wire version (u8) | kind (u8) | seq (u64) | body`` where
`length` counts everything after itself. Bodies are never unpickled: method messages
(`KIND_MESSAGE`) and final states (`KIND_STATE`) are safetensors bytes written by
`p4bench.engine.messages.encode` (which carries the engine's protocol version in its
metadata); everything else is a small JSON object carrying ``"v": PROTOCOL_VERSION``.

A frame whose length field is out of bounds breaks the framing, so the connection is
closed (`FrameError`); any other bad frame is rejected and the connection goes on
(`RejectedFrame`).
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, fields
from typing import Any

from p4bench.engine.messages import PROTOCOL_VERSION
from p4bench.errors import ConfigError
from p4bench.options import Option
from p4bench_device.limit_help import LIMIT_HELP as _LIMIT_HELP

__all__ = [
    "WIRE_VERSION",
    "KIND_MESSAGE",
    "KIND_END",
    "KIND_CONTROL",
    "KIND_REPORT",
    "KIND_STATE",
    "FrameError",
    "RejectedFrame",
    "Limits",
    "DEVICE_OPTIONS",
    "frame_header",
    "pack",
    "read_frame",
    "read_header",
    "header_problem",
    "skip_body",
    "dump_json",
    "load_json",
    "MAX_JSON_BYTES",
    "MAX_IDLE_BODY_BYTES",
    "BUFFER_MIN_MODELS",
    "BUFFER_HEADROOM_BYTES",
]

WIRE_VERSION = 1
_HEADER = struct.Struct("!IBBQ")  # length, version, kind, seq
_AFTER_LENGTH = _HEADER.size - 4  # version + kind + seq
HEADER_BYTES = _HEADER.size
KIND_MESSAGE = ord("M")  # a method message (peer -> peer), safetensors
KIND_END = ord("E")  # end of one exchange from one sender (peer -> peer), JSON
KIND_CONTROL = ord("C")  # launcher -> peer, JSON
KIND_REPORT = ord("R")  # peer -> launcher, JSON
KIND_STATE = ord("S")  # peer -> launcher: its final state, safetensors
KINDS = {KIND_MESSAGE, KIND_END, KIND_CONTROL, KIND_REPORT, KIND_STATE}
MAX_JSON_BYTES = 4 * 1024 * 1024  # configs, reports and markers are small
# Largest frame body a peer reads from another peer outside a run: no data is legitimate then
# (every peer begins the run before any sends), so only small frames are read, to be rejected.
MAX_IDLE_BODY_BYTES = 64 * 1024
# The per-sender buffer never falls below this many models (plus headroom for frame headers
# and safetensors metadata): a message may hold two (params and a tracker or control variate),
# and a sender may be one exchange ahead of this peer, so a legitimate exchange always fits.
BUFFER_MIN_MODELS = 4
BUFFER_HEADROOM_BYTES = 64 * 1024


class FrameError(ValueError):
    """The byte stream cannot be split into frames any more: close the connection."""


class RejectedFrame(ValueError):
    """One well-delimited frame that is invalid: drop it, keep the connection. `reason`
    is one of a few fixed categories (counted and logged per category)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Limits:
    """Sizes and timeouts of the device transport (run options ``device_*``).

    Admission: before its TLS handshake completes a connection only counts against the
    handshake budget (`max_handshakes_per_source`, `max_handshakes`, each at least the
    number of peers; the oldest pending handshake is evicted when full, see `admission`);
    once authenticated it counts against `max_connections` and `max_connections_per_identity` only.

    Memory: outside a run a peer buffers nothing (data frames are refused, and none larger
    than `MAX_IDLE_BODY_BYTES` is read). During a run each sender may have at most
    ``min(max(buffer_floor_bytes, buffer_model_factor * M), max(buffer_budget_bytes // S,
    BUFFER_MIN_MODELS * M + BUFFER_HEADROOM_BYTES))`` buffered (`buffer_caps`; M the model's
    bytes, S the other peers): its share of the peer's inbound budget (`--memory-budget`, else
    1 GiB), never below two exchanges of params-plus-tracker messages. All senders together
    may have three times that, or a quarter of it per other peer when there are more than
    twelve (a server receives from every client in the same exchange).

    Slow and late peers: a receiver drops a sender slow or late in `slow_peer_exchanges` of
    the last `slow_peer_window` exchanges in which it expected it; a sender is late when its
    batch is not complete by its deadline from the exchange's start, ``max(late_peer_grace_s
    + its bytes / slow_peer_rate_bytes_s, late_peer_factor * the exchange's median
    completion time)`` (see `liveness`).
    """

    max_message_bytes: int = 64 * 1024 * 1024  # largest frame body accepted
    exchange_timeout_s: float = 120.0  # wait for every live peer's end-of-exchange marker
    send_timeout_s: float = 60.0  # one batch of frames to one peer
    connect_timeout_s: float = 10.0  # TCP connect plus TLS handshake
    retries: int = 3  # extra attempts per send, with exponential backoff
    backoff_s: float = 0.2  # first backoff; doubles per attempt
    round_timeout_s: float = 900.0  # launcher: wait for a round report from a connected peer
    startup_timeout_s: float = 180.0  # launcher: peers reachable and ready (imports, data)
    max_ahead: int = 64  # exchanges a sender may run ahead of this peer
    max_connections: int = 256  # simultaneous authenticated inbound connections
    max_connections_per_identity: int = 8  # ... per peer or launcher; its oldest closed beyond
    max_handshakes: int = 64  # inbound connections still in their TLS handshake
    max_handshakes_per_source: int = 16  # ... from one source address
    handshake_timeout_s: float = 3.0  # inbound TLS handshake
    idle_timeout_s: float = 120.0  # close an inbound connection with no frame for this long
    min_rate_bytes_s: int = 64 * 1024  # a frame body's least rate (after min(idle, 10 s))
    buffer_model_factor: float = 16.0  # per-sender buffer during a run, in model sizes
    buffer_floor_bytes: int = 8 << 20  # per-sender buffer at least (also before the model size)
    buffer_budget_bytes: int = 1 << 30  # all senders' buffers (the run's --memory-budget if set)
    # slow or late peers (`liveness`): dropped by a receiver when slow or late in this many ...
    slow_peer_exchanges: int = 2
    slow_peer_window: int = 6  # ... of the last this many exchanges in which it was expected
    late_peer_grace_s: float = (
        2.0  # deadline from the exchange's start: this plus bytes at the rate, ...
    )
    late_peer_factor: float = 4.0  # ... or this many times the exchange's median completion time
    slow_peer_rate_bytes_s: int = (
        64 * 1024
    )  # a sender's batch arrives at least this fast (0: no rate check) ...
    slow_peer_grace_s: float = 5.0  # ... after this grace (its first frame to its end marker)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            integer = f.type in ("int", int)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ConfigError(f"device_{f.name}", f"must be a number, got {value!r}")
            value = int(value) if integer else float(value)
            minimum = _minimum(f.name, integer)
            if value < minimum:
                raise ConfigError(f"device_{f.name}", f"must be >= {minimum}, got {value!r}")
            object.__setattr__(self, f.name, value)

    def buffer_caps(self, model_bytes: int, senders: int) -> tuple[int, int]:
        """(per-sender, total) bytes of messages buffered during a run whose model has
        `model_bytes` bytes, with `senders` other peers (see the class docstring)."""
        model_bytes, senders = max(model_bytes, 0), max(senders, 1)
        by_model = max(self.buffer_floor_bytes, int(self.buffer_model_factor * model_bytes))
        legitimate = BUFFER_MIN_MODELS * model_bytes + BUFFER_HEADROOM_BYTES
        per_sender = min(by_model, max(self.buffer_budget_bytes // senders, legitimate))
        return per_sender, per_sender * max(3, -(-senders // 4))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Limits:
        names = {f.name for f in fields(Limits)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError("device limits", f"unknown keys {unknown}")
        return Limits(**data)

    @staticmethod
    def from_options(options: dict[str, Any]) -> Limits:
        """Limits from run options: ``device_exchange_timeout_s=30``, ``device_max_message_mb=16``, ..."""
        values: dict[str, Any] = {}
        for f in fields(Limits):
            if f"device_{f.name}" in options:
                values[f.name] = options[f"device_{f.name}"]
        if "device_max_message_mb" in options:
            megabytes = options["device_max_message_mb"]
            if isinstance(megabytes, bool) or not isinstance(megabytes, (int, float)):
                raise ConfigError("device_max_message_mb", f"must be a number, got {megabytes!r}")
            values["max_message_bytes"] = int(megabytes * 1024 * 1024)
        return Limits(**values)


def _minimum(name: str, integer: bool) -> float:
    """The smallest value of a Limits field (shared by Limits and its run options)."""
    if name in (
        "retries",
        "backoff_s",
        "slow_peer_rate_bytes_s",
        "slow_peer_grace_s",
        "late_peer_grace_s",
    ):
        return 0
    if name in ("max_message_bytes", "buffer_floor_bytes", "min_rate_bytes_s"):
        return 1024
    if name in ("buffer_model_factor", "late_peer_factor"):
        return 1.0
    return 1 if integer else 1e-3


# The device runtime's run options: the transport limits (the same bounds as
# Limits.__post_init__) and how the launcher finds its peers.
def _limit_option(f: Field[Any]) -> Option:
    integer = f.type in ("int", int)
    return Option(
        f"device_{f.name}",
        int if integer else float,
        f.default,
        _LIMIT_HELP[f.name],
        low=_minimum(f.name, integer),
    )


# buffer_budget_bytes is no option of its own: the run's --memory-budget sets it (`runtime`)
DEVICE_OPTIONS: tuple[Option, ...] = tuple(
    _limit_option(f) for f in fields(Limits) if f.name in _LIMIT_HELP
) + (
    Option(
        "device_max_message_mb",
        float,
        None,
        "largest frame body in MiB (sets device_max_message_bytes)",
        low=0,
        low_open=True,
    ),
    Option(
        "device_local_peers",
        int,
        None,
        "run N peers on 127.0.0.1 (`--local-peers N`, N = --clients)",
        low=1,
    ),
    Option("device_peers", str, None, "peers file (set by `p4bench device launch --peers`)"),
    Option("device_tls_dir", str, None, "TLS folder (set by `p4bench device launch --tls-dir`)"),
    Option(
        "device_power_command",
        str,
        None,
        "local peers: a command printing watts, sampled while running",
    ),
    Option(
        "device_power_interval_s",
        float,
        1.0,
        "local peers: seconds between power samples",
        low=0,
        low_open=True,
    ),
    Option("device_keep_logs", bool, False, "local peers: keep their log folder"),
    Option(
        "device_link", str, None, "shape every peer's traffic: ethernet | wifi | MBPS[:LATENCY_MS]"
    ),
    Option(
        "device_profile",
        str,
        None,
        "limit each local peer process like a device: rpi4 (4 cores, 4 GiB address space) where the OS allows",
    ),
)


def frame_header(kind: int, seq: int, body_length: int) -> bytes:
    """The header of a frame whose body has `body_length` bytes."""
    return _HEADER.pack(_AFTER_LENGTH + body_length, WIRE_VERSION, kind, seq)


def pack(kind: int, seq: int, body: bytes) -> bytes:
    """One frame's bytes."""
    return frame_header(kind, seq, len(body)) + body


async def read_header(reader: asyncio.StreamReader, max_body: int) -> tuple[int, int, int, int]:
    """(version, kind, seq, body length) of the next frame, its body still unread. Raises
    FrameError when the length field is impossible (beyond `max_body`: checked before
    anything more is read) and asyncio.IncompleteReadError at the end of the stream."""
    (length,) = struct.unpack("!I", await reader.readexactly(4))
    if length < _AFTER_LENGTH or length > max_body + _AFTER_LENGTH:
        raise FrameError(
            f"frame length {length} outside [{_AFTER_LENGTH}, {max_body + _AFTER_LENGTH}]"
        )
    version, kind, seq = struct.unpack("!BBQ", await reader.readexactly(_AFTER_LENGTH))
    return version, kind, seq, length - _AFTER_LENGTH


def header_problem(version: int, kind: int) -> RejectedFrame | None:
    """Why a frame with this header is rejected whatever its body (None: it is not)."""
    if version != WIRE_VERSION:
        return RejectedFrame("wire version", f"{version}, expected {WIRE_VERSION}")
    if kind not in KINDS:
        return RejectedFrame("unknown frame kind", str(kind))
    return None


async def skip_body(reader: asyncio.StreamReader, length: int) -> bytes:
    """Read and discard `length` bytes in small pieces (a rejected frame's body is never held whole)."""
    while length > 0:
        length -= len(await reader.readexactly(min(length, 65536)))
    return b""


async def read_frame(reader: asyncio.StreamReader, max_body: int) -> tuple[int, int, bytes]:
    """(kind, seq, body) of the next frame. Raises FrameError when the length field is
    impossible, RejectedFrame for a wrong version or kind (the frame is consumed), and
    asyncio.IncompleteReadError at the end of the stream."""
    version, kind, seq, length = await read_header(reader, max_body)
    problem = header_problem(version, kind)
    if problem is not None:
        await skip_body(reader, length)
        raise problem
    return kind, seq, await reader.readexactly(length)


def _plain(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become null (a diverged loss must not lose a report)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if hasattr(value, "item"):  # numpy and torch scalars
        return _plain(value.item())
    return str(value)


def dump_json(obj: dict[str, Any]) -> bytes:
    """A JSON body with the protocol version."""
    return json.dumps(
        {"v": PROTOCOL_VERSION, **_plain(obj)}, separators=(",", ":"), allow_nan=False
    ).encode()


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("non-finite number")
    return value


def load_json(
    body: bytes, required: Mapping[str, type | tuple[type, ...]] | None = None
) -> dict[str, Any]:
    """Parse a JSON body: an object with the right protocol version and, for each
    `required` field, a value of the given type. RejectedFrame otherwise."""
    if len(body) > MAX_JSON_BYTES:
        raise RejectedFrame("oversized JSON", f"{len(body)} bytes > {MAX_JSON_BYTES}")
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=lambda name: _finite(float(name)))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RejectedFrame("malformed JSON", str(exc)[:120]) from None
    if not isinstance(data, dict):
        raise RejectedFrame("malformed JSON", "not an object")
    if data.get("v") != PROTOCOL_VERSION:
        raise RejectedFrame("protocol version", repr(str(data.get("v"))[:40]))
    for name, kind in (required or {}).items():
        value = data.get(name)
        if (
            isinstance(value, bool)
            and kind is not bool
            and (kind is int or (isinstance(kind, tuple) and bool not in kind))
        ):
            raise RejectedFrame("wrongly typed field", f"{name!r} is a boolean")
        if not isinstance(value, kind):
            raise RejectedFrame("wrongly typed field", f"{name!r} missing or not {kind}")
    return data
