"""Late sending: a compromised device peer holds every batch back until just before the
receiver would stop waiting for it.

Nothing in a message is wrong: the peer sends its honest update, only late. Timed from
its own first frame, such a sender looks fast, so before per-exchange deadlines a peer
that waited `late_fraction` (default 0.9) of the exchange timeout before sending stretched
every exchange to nearly the timeout (FedAvg with a 10 s timeout: 99.9 s against 5.2 s).
On the device runtime the peer's network (`p4bench_device.network.TLSNetwork`) reads
`send_delay_s` and sends its batches that long after each exchange starts, in the
background, so that the late peer itself is not held up; its receivers judge it against
their deadlines from the exchange's start (`p4bench_device.liveness`), stop waiting for
it there, and drop and name it once it is late in 2 of the last K exchanges.

The simulator delivers every exchange at once and has no clock to be late against: there
the malicious clients behave honestly, and the run says so once (a warning).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from p4bench.engine import Attack
from p4bench.options import Option

if TYPE_CHECKING:
    from p4bench.config import RunConfig

log = logging.getLogger("p4bench.attacks")

__all__ = ["LateSender"]

CLOCKED_RUNTIMES = ("device",)  # runtimes whose network honours `send_delay_s`


class LateSender(Attack):
    """Malicious peers send each exchange's batches just before the exchange timeout."""

    name = "late-sender"
    description = (
        "malicious device peers send every batch late_fraction of the exchange timeout after the "
        "exchange starts (honest in the simulator, which has no clock)"
    )
    options = Attack.options + (
        Option(
            "late_fraction",
            float,
            0.9,
            "send each batch this fraction of the exchange timeout after the exchange starts",
            low=0.0,
            high=1.0,
        ),
    )

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        super().__init__(config, num_classes)
        self.fraction = float(self.option_values["late_fraction"])
        self.clocked = config.runtime in CLOCKED_RUNTIMES
        if not self.clocked:
            log.warning(
                "late-sender: the %s runtime has no clock to be late against; its malicious clients "
                "behave honestly (run it with --runtime device)",
                config.runtime,
            )

    def send_delay_s(self, exchange_timeout_s: float) -> float:
        """Seconds a malicious peer holds each batch back after its exchange starts (read by
        the device network; 0 where the runtime has no clock)."""
        return self.fraction * exchange_timeout_s if self.clocked else 0.0
