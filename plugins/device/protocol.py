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
from dataclasses import asdict, dataclass, fields
from typing import Any

from p4bench.engine.messages import PROTOCOL_VERSION
from p4bench.errors import ConfigError
from p4bench.options import Option

__all__ = [
    "WIRE_VERSION", "KIND_MESSAGE", "KIND_END", "KIND_CONTROL", "KIND_REPORT", "KIND_STATE",
    "FrameError", "RejectedFrame", "Limits", "DEVICE_OPTIONS", "frame_header", "pack", "read_frame", "dump_json",
    "load_json",
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
    """Sizes and timeouts of the device transport (run options ``device_*``)."""

    max_message_bytes: int = 64 * 1024 * 1024  # largest frame body accepted
    exchange_timeout_s: float = 120.0  # wait for every live peer's end-of-exchange marker
    send_timeout_s: float = 60.0  # one batch of frames to one peer
    connect_timeout_s: float = 10.0  # TCP connect plus TLS handshake
    retries: int = 3  # extra attempts per send, with exponential backoff
    backoff_s: float = 0.2  # first backoff; doubles per attempt
    round_timeout_s: float = 900.0  # launcher: wait for a round report from a connected peer
    startup_timeout_s: float = 180.0  # launcher: peers reachable and ready (imports, data)
    max_ahead: int = 64  # exchanges a sender may run ahead of this peer
    max_connections: int = 256  # simultaneous inbound connections

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = int if f.type in ("int", int) else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"device_{f.name}", f"must be a number, got {value!r}")
            value = kind(value)
            minimum = 0 if f.name in ("retries", "backoff_s") else (1024 if f.name == "max_message_bytes" else 1e-3)
            if value < minimum:
                raise ConfigError(f"device_{f.name}", f"must be >= {minimum}, got {value!r}")
            object.__setattr__(self, f.name, value)

    @property
    def max_buffered_bytes(self) -> int:
        """Bytes buffered per sender for exchanges this peer has not reached yet."""
        return 4 * self.max_message_bytes + MAX_JSON_BYTES

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


_LIMIT_HELP = {
    "max_message_bytes": "largest frame body accepted, in bytes",
    "exchange_timeout_s": "wait for every live peer's end-of-exchange marker",
    "send_timeout_s": "send one batch of frames to one peer",
    "connect_timeout_s": "TCP connect plus TLS handshake",
    "retries": "extra attempts per send, with exponential backoff",
    "backoff_s": "first backoff; doubles per attempt",
    "round_timeout_s": "launcher: wait for a round report from a connected peer",
    "startup_timeout_s": "launcher: peers reachable and ready (imports, data)",
    "max_ahead": "exchanges a sender may run ahead of a peer",
    "max_connections": "simultaneous inbound connections of a peer",
}

# The device runtime's run options: the transport limits (the same bounds as
# Limits.__post_init__) and how the launcher finds its peers.
def _limit_option(f: Any) -> Option:
    integer = f.type in ("int", int)
    low = 0 if f.name in ("retries", "backoff_s") else 1024 if f.name == "max_message_bytes" else 1 if integer else 1e-3
    return Option(f"device_{f.name}", int if integer else float, f.default, _LIMIT_HELP[f.name], low=low)


DEVICE_OPTIONS: tuple[Option, ...] = tuple(_limit_option(f) for f in fields(Limits)) + (
    Option("device_max_message_mb", float, None, "largest frame body in MiB (sets device_max_message_bytes)",
           low=0, low_open=True),
    Option("device_local_peers", int, None, "run N peers on 127.0.0.1 (`--local-peers N`, N = --clients)", low=1),
    Option("device_peers", str, None, "peers file (set by `p4bench device launch --peers`)"),
    Option("device_tls_dir", str, None, "TLS folder (set by `p4bench device launch --tls-dir`)"),
    Option("device_power_command", str, None, "local peers: a command printing watts, sampled while running"),
    Option("device_power_interval_s", float, 1.0, "local peers: seconds between power samples", low=0, low_open=True),
    Option("device_keep_logs", bool, False, "local peers: keep their log folder"),
)


def frame_header(kind: int, seq: int, body_length: int) -> bytes:
    """The header of a frame whose body has `body_length` bytes."""
    return _HEADER.pack(_AFTER_LENGTH + body_length, WIRE_VERSION, kind, seq)


def pack(kind: int, seq: int, body: bytes) -> bytes:
    """One frame's bytes."""
    return frame_header(kind, seq, len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_body: int) -> tuple[int, int, bytes]:
    """(kind, seq, body) of the next frame. Raises FrameError when the length field is
    impossible, RejectedFrame for a wrong version or kind (the frame is consumed), and
    asyncio.IncompleteReadError at the end of the stream."""
    head = await reader.readexactly(4)
    (length,) = struct.unpack("!I", head)
    if length < _AFTER_LENGTH or length > max_body + _AFTER_LENGTH:
        raise FrameError(f"frame length {length} outside [{_AFTER_LENGTH}, {max_body + _AFTER_LENGTH}]")
    rest = await reader.readexactly(length)
    version, kind, seq = struct.unpack("!BBQ", rest[:_AFTER_LENGTH])
    if version != WIRE_VERSION:
        raise RejectedFrame("wire version", f"{version}, expected {WIRE_VERSION}")
    if kind not in KINDS:
        raise RejectedFrame("unknown frame kind", str(kind))
    return kind, seq, rest[_AFTER_LENGTH:]


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
    return json.dumps({"v": PROTOCOL_VERSION, **_plain(obj)}, separators=(",", ":"), allow_nan=False).encode()


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("non-finite number")
    return value


def load_json(body: bytes, required: Mapping[str, type | tuple[type, ...]] | None = None) -> dict[str, Any]:
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
        raise RejectedFrame("protocol version", repr(str(data.get('v'))[:40]))
    for name, kind in (required or {}).items():
        value = data.get(name)
        if isinstance(value, bool) and kind is not bool and (kind is int or (isinstance(kind, tuple) and bool not in kind)):
            raise RejectedFrame("wrongly typed field", f"{name!r} is a boolean")
        if not isinstance(value, kind):
            raise RejectedFrame("wrongly typed field", f"{name!r} missing or not {kind}")
    return data
