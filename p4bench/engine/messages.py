"""Messages between nodes, batched for the simulator and as bytes for transports.

A `Messages` value holds n messages at once: sources, destinations and payload
tensors stacked along a leading message axis. Transports that cross process or
machine boundaries encode each message separately with safetensors (never pickle),
so nothing a peer sends can execute code on the receiver.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

PROTOCOL_VERSION = "1"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# Payload naming, shared by every method, attack and defense: `update.*` entries are the
# model or model update a message carries (what message attacks replace and defenses
# inspect); `model.*` entries are a model sent to be used as is (a server's or an
# aggregator's broadcast), which defenses do not filter.
UPDATE_PREFIX = "update."
MODEL_PREFIX = "model."

# Destination of a message to every client but its sender (one stored message in the
# simulator, one frame per receiver on a real network: `Messages.expand_broadcasts`).
BROADCAST = -2


def prefixed_keys(payload: Mapping[str, object], prefix: str) -> list[str]:
    """The payload keys named `prefix`*, sorted (the order parameters are flattened in)."""
    return sorted(k for k in payload if k.startswith(prefix))


def update_keys(payload: Mapping[str, object]) -> list[str]:
    """The ``update.*`` keys of a payload, sorted."""
    return prefixed_keys(payload, UPDATE_PREFIX)


# What a method declares for an exchange (`Method.message_layout`): payload key ->
# (dtype, shape of one message's tensor, without the message axis).
PayloadLayout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def params_layout(params: Mapping[str, torch.Tensor], prefix: str) -> PayloadLayout:
    """The layout of parameters (one model, no client axis) sent under `prefix`
    (``update.`` or ``model.``), as `flatten(params, prefix)` writes them."""
    return {f"{prefix}{k}": (v.dtype, tuple(v.shape)) for k, v in params.items()}


def message_layout_of(message: Messages) -> PayloadLayout:
    """The layout of a batch's payload (every message of a batch shares it)."""
    return {k: (v.dtype, tuple(v.shape[1:])) for k, v in message.table.items()}


class MessageFormatError(ValueError):
    """A byte string that is not a valid p4bench message."""


@dataclass(frozen=True)
class Messages:
    """n messages: src (n,), dst (n,) node ids (-1 is the server) and their payloads.

    Payload tensors are stored in `table`. Without `rows`, table entries are (n, ...)
    and message i carries row i. With `rows` (n,), message i carries table row
    rows[i]: a client that sends the same model to many peers stores it once, and
    selecting or reordering messages never copies payloads (the simulator's memory
    then grows with clients, not with messages).
    """

    src: torch.Tensor
    dst: torch.Tensor
    table: dict[str, torch.Tensor]
    rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def payload(self) -> dict[str, torch.Tensor]:
        """Each message's payload, (n, ...) per key (gathered from the table when shared)."""
        if self.rows is None:
            return self.table
        return {k: v[self.rows] for k, v in self.table.items()}

    def value(self, key: str) -> torch.Tensor:
        """(n, ...) payload entry `key` of every message."""
        return self.table[key] if self.rows is None else self.table[key][self.rows]

    def table_rows(self) -> torch.Tensor:
        """(n,) the table row each message carries."""
        return torch.arange(len(self)) if self.rows is None else self.rows

    @staticmethod
    def empty() -> Messages:
        none = torch.zeros(0, dtype=torch.int64)
        return Messages(none, none, {})

    @staticmethod
    def concat(parts: list[Messages]) -> Messages:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Messages.empty()
        keys = sorted(parts[0].table)
        for p in parts:
            if sorted(p.table) != keys:
                raise ValueError(
                    f"cannot concatenate messages with payload keys {sorted(p.table)} and {keys}"
                )
        src, dst = torch.cat([p.src for p in parts]), torch.cat([p.dst for p in parts])
        if all(p.rows is None for p in parts):
            return Messages(src, dst, {k: torch.cat([p.table[k] for p in parts]) for k in keys})
        offsets = torch.cumsum(
            torch.tensor([0] + [len(next(iter(p.table.values()))) for p in parts[:-1]]), 0
        )
        rows = torch.cat([p.table_rows() + int(offset) for p, offset in zip(parts, offsets)])
        return Messages(src, dst, {k: torch.cat([p.table[k] for p in parts]) for k in keys}, rows)

    def select(self, mask_or_index: torch.Tensor) -> Messages:
        if self.rows is not None:
            return Messages(
                self.src[mask_or_index],
                self.dst[mask_or_index],
                self.table,
                self.rows[mask_or_index],
            )
        return Messages(
            self.src[mask_or_index],
            self.dst[mask_or_index],
            {k: v[mask_or_index] for k, v in self.table.items()},
        )

    def sorted(self) -> Messages:
        """Ordered by (dst, src): the order every runtime delivers in, so results agree."""
        order = torch.argsort(self.dst * (1 << 32) + self.src, stable=True)
        return self.select(order)

    def is_broadcast(self) -> torch.Tensor:
        """(n,) bool: the message goes to every client but its sender (dst BROADCAST)."""
        return self.dst == BROADCAST

    def expand_broadcasts(self, num_clients: int) -> Messages:
        """The same messages with each broadcast replaced by one message to every client
        0..num_clients-1 but its sender (in sender order; no payload is copied)."""
        wide = self.is_broadcast()
        if not bool(wide.any()):
            return self
        index = wide.nonzero().squeeze(1)
        senders = self.src[index]
        receivers = torch.arange(num_clients, device=self.src.device)
        dst = receivers.repeat(len(index))
        which = torch.arange(len(index), device=self.src.device).repeat_interleave(num_clients)
        keep = dst != senders[which]
        which, dst = which[keep], dst[keep]
        expanded = Messages(senders[which], dst, self.table, self.table_rows()[index[which]])
        return Messages.concat([self.select(~wide), expanded]) if bool((~wide).any()) else expanded

    def payload_nbytes(self) -> torch.Tensor:
        """(n,) raw tensor bytes of each message's payload."""
        per = sum(v[0].numel() * v.element_size() for v in self.table.values()) if len(self) else 0
        return torch.full((len(self),), int(per), dtype=torch.int64)

    def split(self) -> list[Messages]:
        return [self.select(torch.tensor([i])) for i in range(len(self))]


def frame_sizes(
    exchange: str, round_index: int, messages: Messages, num_clients: int = 0
) -> torch.Tensor:
    """(n,) exact byte length of each message as `encode` would write it, without
    serialising any message: a frame's length depends only on the payload's shapes and
    dtypes and on how many characters the round, src and dst take, so one placeholder
    frame is measured per such signature (cached) and no payload leaves its device.
    A broadcast counts the frames to all its `num_clients` - 1 receivers."""
    if not len(messages):
        return torch.zeros(0, dtype=torch.int64, device="cpu")
    src, dst = torch.stack([messages.src, messages.dst]).cpu()  # one read of the addresses
    src_width, dst_width = _digits(src), _digits(dst)
    table = _length_table(
        exchange,
        round_index,
        messages,
        max(int(src_width.max()), int(dst_width.max())),
        num_clients,
    )
    sizes = table[src_width, dst_width]
    wide = dst == BROADCAST
    if bool(wide.any()):  # the frames to every client but the sender
        to_all = table[:, _digits(torch.arange(num_clients, device="cpu"))].sum(
            dim=1
        )  # (src width,) over all receivers
        sizes[wide] = to_all[src_width[wide]] - table[src_width[wide], src_width[wide]]
    return sizes


def broadcast_receipts(
    exchange: str, round_index: int, messages: Messages, num_clients: int
) -> torch.Tensor:
    """(num_clients,) on the host: bytes each client receives through the broadcasts among
    `messages` (each sends one frame to every client but its sender)."""
    src, dst = torch.stack([messages.src, messages.dst]).cpu()
    senders = src[dst == BROADCAST]
    if not len(senders):
        return torch.zeros(num_clients, dtype=torch.int64, device="cpu")
    table = _length_table(exchange, round_index, messages, int(_digits(senders).max()), num_clients)
    receiver_width = _digits(torch.arange(num_clients, device="cpu"))
    per_sender_width = torch.bincount(
        _digits(senders), minlength=len(table)
    )  # broadcasts by sender width
    received = (per_sender_width.unsqueeze(1) * table[:, receiver_width]).sum(dim=0)
    own = senders[(senders >= 0) & (senders < num_clients)]
    received.index_add_(
        0, own, -table[receiver_width[own], receiver_width[own]]
    )  # nobody receives its own
    return received


def _length_table(
    exchange: str, round_index: int, messages: Messages, widest_id: int, num_clients: int
) -> torch.Tensor:
    """(w, w) frame length by (characters of src, of dst) for `messages`' payload layout, for
    ids up to `widest_id` characters and the clients' own."""
    layout = tuple(sorted((k, tuple(v.shape[1:]), str(v.dtype)) for k, v in messages.table.items()))
    width = len(str(round_index))
    widest = max(widest_id, len(str(max(num_clients - 1, 0))))
    return torch.tensor(
        [
            [
                _frame_length(exchange, width, a, b, layout) if a and b else 0
                for b in range(widest + 1)
            ]
            for a in range(widest + 1)
        ],
        dtype=torch.int64,
        device="cpu",
    )


def _digits(ids: torch.Tensor) -> torch.Tensor:
    """(n,) characters `str(id)` takes (a minus sign counts), for ids above -10**18."""
    magnitude = ids.abs().clamp_min(1)
    digits = torch.ones_like(magnitude)
    power = 10
    for _ in range(18):
        digits += (magnitude >= power).long()
        power *= 10
    return digits + (ids < 0).long()


@functools.lru_cache(maxsize=4096)
def _frame_length(
    exchange: str,
    round_width: int,
    src_width: int,
    dst_width: int,
    layout: tuple[tuple[str, tuple[int, ...], str], ...],
) -> int:
    """Length of `encode`'s frame for a payload of `layout` ((key, shape, dtype) each) and
    metadata values of the given widths (the bytes written do not depend on the values)."""
    tensors = {
        key: torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device="cpu")
        for key, shape, dtype in layout
    }
    meta = {
        "p4bench_protocol": PROTOCOL_VERSION,
        "exchange": exchange,
        "round": "9" * round_width,
        "src": "9" * src_width,
        "dst": "9" * dst_width,
    }
    return len(st_save(tensors, metadata=meta))


def encode(exchange: str, round_index: int, message: Messages) -> bytes:
    """Bytes of a single message (len(message) == 1)."""
    if len(message) != 1:
        raise ValueError("encode takes exactly one message")
    tensors = {k: v[0].contiguous() for k, v in message.payload.items()}
    meta = {
        "p4bench_protocol": PROTOCOL_VERSION,
        "exchange": exchange,
        "round": str(round_index),
        "src": str(int(message.src[0])),
        "dst": str(int(message.dst[0])),
    }
    return st_save(tensors, metadata=meta)


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[str, int, Messages]:
    """(exchange, round, message) from `encode`'s bytes; MessageFormatError if invalid."""
    if len(data) > max_bytes:
        raise MessageFormatError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < 8:
        raise MessageFormatError("message shorter than its header length field")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise MessageFormatError("header length exceeds message size")
    try:
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        if meta.get("p4bench_protocol") != PROTOCOL_VERSION:
            raise MessageFormatError(
                f"unsupported protocol version {meta.get('p4bench_protocol')!r}"
            )
        tensors = st_load(data)
        src, dst, round_index = int(meta["src"]), int(meta["dst"]), int(meta["round"])
        exchange = str(meta["exchange"])
    except MessageFormatError:
        raise
    except Exception as exc:  # malformed JSON, bad dtype, truncated buffer, missing keys
        raise MessageFormatError(f"malformed message: {exc}") from None
    device = (
        torch.get_default_device()
    )  # the run's (p4bench.engine.devices.device_scope): parsed on the host, moved there
    payload = {k: v.unsqueeze(0).to(device) for k, v in tensors.items()}
    return exchange, round_index, Messages(torch.tensor([src]), torch.tensor([dst]), payload)
