"""Between P4L's peers and the run's messages: the peers' protocol and cryptography run
on the host (`on_host`), read what arrives as host tensors (`host_rows`) and hand what
they send back as `Messages` on the run's device (`pack`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from p4bench.engine import Messages

__all__ = ["host_rows", "on_host", "pack"]


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """The peers' protocol and cryptography (Python ints, bytes, signatures) run on the
    host: inside, factory calls make CPU tensors even in a run on an accelerator."""
    if torch.get_default_device().type == "cpu":
        yield
        return
    with torch.device("cpu"):
        yield


def host_rows(inbox: Messages) -> list[dict[str, torch.Tensor]]:
    """Every message's payload as a flat dict of host tensors (no leading axis); the
    table is copied to the host once."""
    if not len(inbox):
        return []
    table = {k: v.cpu() for k, v in inbox.table.items()}
    return [{k: v[row] for k, v in table.items()} for row in inbox.table_rows().tolist()]


def pack(
    items: list[tuple[int, int, dict[str, torch.Tensor]]], device: torch.device, share: bool = False
) -> Messages:
    """Messages (src, dst, payload) on `device` (the run's) from the peers' host tensors;
    with `share`, consecutive messages with the same payload object share one table row
    (an aggregate sent to all members is stored once)."""
    if not items:
        return Messages.empty()
    keys = sorted(items[0][2])
    rows: list[int] = []
    payloads: list[dict[str, torch.Tensor]] = []
    for _, _, payload in items:
        if not (share and payloads and payloads[-1] is payload):
            payloads.append(payload)
        rows.append(len(payloads) - 1)
    table = {k: torch.stack([p[k] for p in payloads]).to(device) for k in keys}
    src = torch.tensor([s for s, _, _ in items], device=device)
    dst = torch.tensor([d for _, d, _ in items], device=device)
    return Messages(src, dst, table, rows=torch.tensor(rows, device=device))
