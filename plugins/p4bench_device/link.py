"""Link profiles: shape a peer's traffic in the transport, as on the papers' testbeds.

`--link ethernet|wifi|MBPS[:LATENCY_MS]` gives every peer a `LinkShaper` that paces the
frames it writes to the rate of the link and adds its one-way latency, in the process
itself (no root, no `tc`), so the 100 Mbit/s and ~10 Mbit/s conditions of the Raspberry
Pi experiments are reproducible on one machine.

Where the numbers come from:
- rates: Karras et al., P2P FL on Raspberry Pis (shared/papers/002, section on the
  setup; reference seed-002 table "Network"): the Pis' network had 100/100 Mbit/s, "all of
  which was utilised on Ethernet, but only about 10% (10/10 Mbit/s) on Wi-Fi". The P4
  paper's two Raspberry Pi 4B clients talk over secure websockets and state no link
  speed, so these two conditions stand for both testbeds;
- latencies: no paper gives one; ours are typical one-way figures (not measured): 0.5 ms
  through a switch and a router on wired Ethernet, 5 ms over a home Wi-Fi access point.

The model (see `LinkShaper`): one serializer at the link's rate per peer (its NIC: every
destination shares it) followed by the one-way latency. A batch of B bytes written
back-to-back (one `FrameConnection.send`, or several sends started together) is complete
at its receiver (its end marker, written last, arrives) B * 8 / rate + latency seconds
after its first frame is written; so is the sender's send. The rate
applies to the bytes the transport writes (frame headers and bodies), not to TLS records
or TCP/IP headers: it is the link's goodput.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from p4bench.errors import UsageError

__all__ = ["LINKS", "LinkProfile", "LinkShaper", "compare_transfers", "parse_link"]

_SPIN_MIN_S, _SPIN_MAX_S = (
    0.0015,
    0.005,
)  # the last stretch of a wait spent spinning (see LinkShaper)
_FORMS = "ethernet (100 Mbit/s, 0.5 ms), wifi (10 Mbit/s, 5 ms), MBPS or MBPS:LATENCY_MS (e.g. 25 or 25:2.5)"


@dataclass(frozen=True)
class LinkProfile:
    """A link: its rate (bits per second, of the bytes the transport writes) and one-way latency."""

    name: str
    rate_bits_per_s: float
    latency_s: float

    def transfer_s(self, nbytes: int | float, batches: int = 1) -> float:
        """Seconds for `nbytes` written back-to-back in `batches` batches: bytes at the rate
        plus the latency once per batch."""
        return float(nbytes) * 8 / self.rate_bits_per_s + batches * self.latency_s

    def to_dict(self) -> dict[str, Any]:
        """The profile as recorded in a run: name, Mbit/s, latency in ms (and the raw fields)."""
        return {
            "name": self.name,
            "rate_bits_per_s": self.rate_bits_per_s,
            "latency_s": self.latency_s,
            "mbit_per_s": self.rate_bits_per_s / 1e6,
            "latency_ms": self.latency_s * 1e3,
        }


LINKS: dict[str, LinkProfile] = {
    # Karras et al. (shared/papers/002): 100/100 Mbit/s wired, fully used; latency: our assumption
    "ethernet": LinkProfile("ethernet", 100e6, 0.0005),
    # Karras et al.: "only about 10% (10/10 Mbit/s) on Wi-Fi"; latency: our assumption
    "wifi": LinkProfile("wifi", 10e6, 0.005),
}


def parse_link(spec: str) -> LinkProfile:
    """`ethernet`, `wifi`, `MBPS` or `MBPS:LATENCY_MS` (megabits per second > 0, latency in
    milliseconds >= 0, both finite). Anything else raises UsageError naming the valid forms."""
    text = str(spec).strip().lower()
    if text in LINKS:
        return LINKS[text]
    rate_text, sep, latency_text = text.partition(":")
    try:
        mbps = float(rate_text)
        latency_ms = float(latency_text) if sep else 0.0
    except ValueError:
        mbps = latency_ms = math.nan
    if not (math.isfinite(mbps) and mbps > 0 and math.isfinite(latency_ms) and latency_ms >= 0):
        raise UsageError(f"--link {spec!r} is not a link: use {_FORMS}")
    return LinkProfile(
        f"{mbps:g}mbps" + (f":{latency_ms:g}ms" if sep else ""), mbps * 1e6, latency_ms / 1e3
    )


class LinkShaper:
    """Paces one peer's egress to a `LinkProfile`: awaited by the transport right after it
    writes each frame (`await shaper.pace(nbytes)`), on the transport's event loop.

    A virtual clock, not a token count: `free_at` is when the link's serializer finishes the
    bytes paced so far. A frame of n bytes starts at max(free_at, when it is written), takes
    n * 8 / rate, and pace() returns when it has also crossed the latency. So concurrent
    senders (several destinations) share the rate, like one NIC, and B bytes cost
    B * 8 / rate whatever the frame sizes; a sleep that ends late does not delay the frames
    after it, since their times come from the clock.

    Latency is paid once per batch. The first frame a task paces (the transport runs one
    task per destination and exchange: a batch), or its first after `batch_gap_s` without
    pacing (a long-lived task answering now and then), starts when it is written and adds
    the latency. The task's next frames stream behind it: the sender got on only after the
    latency, `latency` behind a real sender, so they start at max(free_at, now - latency)
    (forgiving up to `catch_up_s` of the sender's own lateness) and do not pay it again.
    A batch of B bytes therefore returns, and its last frame is written, B * 8 / rate +
    latency after its first frame: when a receiver on that link would have the whole batch
    (its end marker is the last frame). Callers that know better pass `first=`.

    Frames due less than `min_sleep_s` from now do not sleep (end markers): the clock keeps
    their time, so the next frame pays for it. Sleeps end within about 0.1 ms of their time:
    asyncio's timer wakes late (epoll rounds up to whole milliseconds, and a virtual machine
    adds its own wake-up delay), so the last stretch of a wait yields to the loop in a tight
    loop; that stretch grows to 1.25 x the latest wake-ups seen (between 1.5 and 5 ms).
    """

    def __init__(
        self,
        profile: LinkProfile,
        min_sleep_s: float = 50e-6,
        catch_up_s: float = 0.002,
        batch_gap_s: float = 0.05,
    ) -> None:
        self.profile = profile
        self.min_sleep_s, self.catch_up_s, self.batch_gap_s = min_sleep_s, catch_up_s, batch_gap_s
        self.free_at = -math.inf
        self._seconds_per_byte = 8.0 / profile.rate_bits_per_s
        # when each task's last pace() returned: its next frame within batch_gap_s continues its batch
        self._last_paced: weakref.WeakKeyDictionary[asyncio.Task[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        self._spin_s, self._wakeups = (
            _SPIN_MIN_S,
            deque([0.0], maxlen=32),
        )  # how late recent timer wake-ups were
        self.bytes = self.frames = self.batches = 0
        self.paced_s = self.late_s = (
            0.0  # time inside pace(); how far past their deadlines its sleeps ended
        )

    async def pace(self, nbytes: int, first: bool | None = None) -> None:
        """Wait until the frame of `nbytes` just written would have reached the receiver.
        `first`: whether it opens a batch (pays the latency); None: the calling task's first
        frame does, or its first after `batch_gap_s` without pacing."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        latency = self.profile.latency_s
        task = asyncio.current_task()
        if first is None:
            last = self._last_paced.get(task) if task is not None else None
            first = last is None or now - last > self.batch_gap_s
        start = (
            max(self.free_at, now) if first else max(self.free_at, now - latency - self.catch_up_s)
        )
        self.free_at = start + nbytes * self._seconds_per_byte
        self.bytes += nbytes
        self.frames += 1
        self.batches += int(first)
        deadline = self.free_at + latency
        if deadline - now >= self.min_sleep_s:
            await self._sleep_until(loop, deadline)
            ended = loop.time()
            self.paced_s += ended - now
            self.late_s += max(ended - deadline, 0.0)
        if task is not None:
            self._last_paced[task] = loop.time()

    async def _sleep_until(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        wake = deadline - self._spin_s
        if wake > loop.time():
            await asyncio.sleep(wake - loop.time())
            self._wakeups.append(max(loop.time() - wake, 0.0))
            self._spin_s = min(max(_SPIN_MIN_S, 1.25 * max(self._wakeups)), _SPIN_MAX_S)
        while loop.time() < deadline:
            await asyncio.sleep(0)  # the loop still serves other tasks (readers) while spinning

    def figures(self) -> dict[str, Any]:
        """What was paced: bytes, frames, batches, seconds spent pacing (and past deadlines), the link."""
        return {
            "link": self.profile.to_dict(),
            "bytes_paced": self.bytes,
            "frames_paced": self.frames,
            "batches_paced": self.batches,
            "pacing_s": self.paced_s,
            "late_s": self.late_s,
        }


def compare_transfers(
    profile: LinkProfile,
    samples: Sequence[tuple[float, float]],
    protocol_s: float = 0.0,
    tolerance: float = 0.10,
) -> dict[str, Any]:
    """Measured transfers next to the link's capacity. `samples`: (bytes, measured seconds)
    of one batch each (one sender's frames of one exchange, written back-to-back), each
    predicted to take bytes * 8 / rate + latency. `protocol_s`: what such a batch takes on
    an unshaped link (encoding, hand-offs between threads, the TLS stream), subtracted to
    give the time the link added (`link_s`). Returns medians (bytes, predicted, measured,
    link seconds), `ratio` = median of link / predicted (`ratio_total`: measured /
    predicted) and whether `ratio` is within `tolerance` of 1 (`within_10pct`, for the
    default); None figures without samples."""
    if not samples:
        return {
            "batches": 0,
            "bytes": None,
            "predicted_s": None,
            "measured_s": None,
            "protocol_s": protocol_s,
            "link_s": None,
            "ratio": None,
            "ratio_total": None,
            "within_10pct": None,
        }
    predicted = [profile.transfer_s(nbytes) for nbytes, _ in samples]
    ratios = [(measured - protocol_s) / p for (_, measured), p in zip(samples, predicted)]
    ratio = statistics.median(ratios)
    return {
        "batches": len(samples),
        "bytes": statistics.median(n for n, _ in samples),
        "predicted_s": statistics.median(predicted),
        "measured_s": statistics.median(m for _, m in samples),
        "protocol_s": protocol_s,
        "link_s": statistics.median(m - protocol_s for _, m in samples),
        "ratio": ratio,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_total": statistics.median(m / p for (_, m), p in zip(samples, predicted)),
        "within_10pct": abs(ratio - 1) <= tolerance,
    }
