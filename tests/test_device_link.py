"""Link profiles and device profiles of the device runtime: parsing, the shaper's timing
(bytes at the rate plus the latency once per batch), the bench's transfer comparison,
and a peer-like process held to the Raspberry Pi 4 profile."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import selectors
import subprocess
import sys
from pathlib import Path

import pytest

from p4bench.errors import UsageError
from p4bench_device.link import LINKS, LinkProfile, LinkShaper, compare_transfers, parse_link
from p4bench_device.profile import DEVICE_PROFILES, apply_device_profile

ROOT = Path(__file__).resolve().parents[1]


# -- parse_link -------------------------------------------------------------------------
def test_parse_link_named_profiles():
    assert parse_link("ethernet") == LinkProfile("ethernet", 100e6, 0.0005)
    assert parse_link(" WiFi ") == LinkProfile("wifi", 10e6, 0.005)
    assert set(LINKS) == {"ethernet", "wifi"}


def test_parse_link_rates_and_latencies():
    assert parse_link("25") == LinkProfile("25mbps", 25e6, 0.0)
    profile = parse_link("2.5:12.5")
    assert profile.rate_bits_per_s == pytest.approx(2.5e6) and profile.latency_s == pytest.approx(
        0.0125
    )
    assert parse_link("1000:0").latency_s == 0.0


@pytest.mark.parametrize(
    "spec",
    ["", "fast", "0", "-5", "nan", "inf", "1e400", "10:-1", "10:abc", "10:5:3", ":5", "10:inf"],
)
def test_parse_link_rejects_bad_specs_naming_the_valid_forms(spec):
    with pytest.raises(UsageError) as info:
        parse_link(spec)
    message = str(info.value)
    assert (
        "\n" not in message
        and "ethernet" in message
        and "wifi" in message
        and "MBPS:LATENCY_MS" in message
    )


def test_profile_transfer_time_and_record():
    wifi = LINKS["wifi"]
    assert wifi.transfer_s(1_250_000) == pytest.approx(1.0 + 0.005)
    assert wifi.transfer_s(1_250_000, batches=3) == pytest.approx(1.0 + 0.015)
    assert LINKS["ethernet"].to_dict() == {
        "name": "ethernet",
        "rate_bits_per_s": 100e6,
        "latency_s": 0.0005,
        "mbit_per_s": 100.0,
        "latency_ms": 0.5,
    }


# -- LinkShaper ---------------------------------------------------------------------------
async def _batch(shaper: LinkShaper, sizes: list[int]) -> None:
    """One sender task writing frames back-to-back, pacing after each (as the transport does)."""
    for nbytes in sizes:
        await shaper.pace(nbytes)


class _NeverBlocks(selectors.DefaultSelector):
    """A selector whose waits take no real time: a wait of t seconds moves the clock by t
    (a zero wait, a spin, by 10 us, so that spins end). No test here waits on sockets."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        self.now += timeout if timeout else 1e-5
        return super().select(0)


class _VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: the shaper's schedule is checked by behaviour,
    whatever the machine's load (its wall-clock figures belong to bench/device.py)."""

    def __init__(self) -> None:
        self._clock = _NeverBlocks()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


def _virtual(coroutine):
    loop = _VirtualClockLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def _timed(coroutine_factory) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await coroutine_factory()
        return loop.time() - start

    return _virtual(main())


def test_shaper_paces_bytes_at_the_rate_plus_latency():
    shaper = LinkShaper(LINKS["wifi"])
    sizes = [16_384] * 76 + [1_250_000 - 16_384 * 76]  # 1.25 MB in frames: 1.0 s at 10 Mbit/s
    elapsed = _timed(lambda: asyncio.create_task(_batch(shaper, sizes)))
    assert elapsed == pytest.approx(1.0 + 0.005, abs=1e-3)
    figures = shaper.figures()
    assert (
        figures["bytes_paced"] == 1_250_000
        and figures["frames_paced"] == 77
        and figures["batches_paced"] == 1
    )
    assert figures["link"]["name"] == "wifi" and figures["pacing_s"] == pytest.approx(
        1.005, abs=1e-3
    )


def test_shaper_pays_latency_once_per_batch_not_per_frame():
    shaper = LinkShaper(LinkProfile("slow-start", 1e9, 0.05))
    elapsed = _timed(
        lambda: asyncio.create_task(_batch(shaper, [100] * 100))
    )  # 100 tiny frames: ~0.05 s, not 5 s
    assert elapsed == pytest.approx(0.05, abs=2e-3)

    async def two_batches() -> None:  # two exchanges one after the other: two tasks, two latencies
        await asyncio.create_task(_batch(shaper, [100, 100]))
        await asyncio.create_task(_batch(shaper, [100, 100]))

    elapsed = _timed(two_batches)
    assert elapsed == pytest.approx(0.1, abs=2e-3)
    assert shaper.figures()["batches_paced"] == 3


def test_shaper_long_lived_task_pays_latency_again_after_a_pause():
    """A task that paces now and then (answering pings) starts a new batch after a pause."""
    shaper = LinkShaper(LinkProfile("l", 1e9, 0.03), batch_gap_s=0.05)

    async def answers() -> list[float]:
        loop, times = asyncio.get_running_loop(), []
        for pause in (0.0, 0.01, 0.1):
            await asyncio.sleep(pause)
            start = loop.time()
            await shaper.pace(100)
            times.append(loop.time() - start)
        return times

    first, soon, later = _virtual(answers())
    assert first >= 0.029 and soon < 0.002 and later >= 0.029, (first, soon, later)
    assert shaper.figures()["batches_paced"] == 2


def test_shaper_explicit_first_flag():
    shaper = LinkShaper(LinkProfile("l", 1e9, 0.03))

    async def frames() -> None:
        await shaper.pace(100, first=True)
        await shaper.pace(100, first=False)
        await shaper.pace(100, first=True)  # the caller says a new batch starts: the latency again

    elapsed = _timed(frames)
    assert elapsed == pytest.approx(0.06, abs=2e-3)


def test_concurrent_senders_share_the_link():
    """Two destinations at once (one task each) share one NIC: all their bytes at the rate,
    the latencies overlapping."""
    shaper = LinkShaper(LinkProfile("10mbps:5ms", 10e6, 0.005))

    async def both() -> None:
        await asyncio.gather(
            _batch(shaper, [312_500, 80]), _batch(shaper, [312_500, 80])
        )  # 0.25 s each

    elapsed = _timed(both)
    assert elapsed == pytest.approx(0.5 + 0.005, abs=2e-3)


def test_shaper_tiny_frames_do_not_sleep_but_are_paid_for():
    shaper = LinkShaper(LinkProfile("fast", 1e9, 0.0))
    elapsed = _timed(lambda: asyncio.create_task(_batch(shaper, [10] * 1000)))  # 80 us in total
    assert elapsed < 1e-3
    assert shaper.free_at > 0 and shaper.figures()["bytes_paced"] == 10_000


# -- the bench's comparison -------------------------------------------------------------
def test_compare_transfers_predicts_bytes_over_rate_plus_latency():
    wifi = LINKS["wifi"]
    batch = 123_330  # a phase-2 message with its header and end marker
    predicted = batch * 8 / 10e6 + 0.005
    samples = [
        (batch, predicted + 0.001),
        (batch, predicted + 0.002),
        (batch, predicted * 1.5 + 0.001),
    ]
    result = compare_transfers(wifi, samples, protocol_s=0.001)
    assert result["predicted_s"] == pytest.approx(predicted)
    assert result["batches"] == 3 and result["bytes"] == batch
    assert result["link_s"] == pytest.approx(predicted + 0.001)
    assert result["ratio"] == pytest.approx((predicted + 0.001) / predicted)
    assert result["ratio_max"] == pytest.approx(1.5) and result["within_10pct"] is True
    assert compare_transfers(wifi, [(batch, predicted * 1.2)])["within_10pct"] is False
    assert compare_transfers(wifi, [(batch, predicted * 0.85)])["within_10pct"] is False
    empty = compare_transfers(wifi, [])
    assert empty["batches"] == 0 and empty["within_10pct"] is None


def _bench_device():
    spec = importlib.util.spec_from_file_location("bench_device", ROOT / "bench" / "device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_takes_each_exchange_from_its_sender():
    bench = _bench_device()
    rounds = [
        {
            "device.0.wall_s": 1.0,
            "device.0.exchange.upload.comm_s": 0.020,
            "device.0.exchange.upload.wire_bytes_sent": 90.0,
            "device.0.exchange.upload.messages_sent": 0.0,
            "device.1.exchange.upload.comm_s": 0.106,
            "device.1.exchange.upload.wire_bytes_sent": 123_330.0,
            "device.1.exchange.upload.messages_sent": 1.0,
            "device.0.exchange.distribute.comm_s": 0.105,
            "device.0.exchange.distribute.wire_bytes_sent": 123_270.0,
            "device.0.exchange.distribute.messages_sent": 1.0,
            "device.1.exchange.distribute.comm_s": 0.2,
            "device.1.exchange.distribute.wire_bytes_sent": 90.0,
            "device.1.exchange.distribute.messages_sent": 0.0,
            "device.0.exchange.announce.comm_s": 0.01,
            "device.0.exchange.announce.messages_sent": 1.0,
            "device.0.exchange.announce.wire_bytes_sent": 200.0,
        },
        {
            "device.1.exchange.distribute.comm_s": 0.107,
            "device.1.exchange.distribute.wire_bytes_sent": 123_270.0,
            "device.1.exchange.distribute.messages_sent": 1.0,
        },
    ]
    samples = bench.exchange_samples(rounds)
    assert samples == {
        "upload": [(123_330.0, 0.106)],
        "distribute": [(123_270.0, 0.105), (123_270.0, 0.107)],
    }
    baseline = {
        "upload": [(123_330.0, 0.003)],
        "distribute": [(123_270.0, 0.001), (123_270.0, 0.001)],
    }
    figures = bench.transfer_figures(LINKS["wifi"], samples, baseline)
    assert figures["distribute"]["protocol_s"] == pytest.approx(0.001)
    assert figures["distribute"]["predicted_s"] == pytest.approx(123_270 * 8 / 10e6 + 0.005)
    assert figures["distribute"]["within_10pct"] is True
    unshaped = bench.transfer_figures(None, baseline)
    assert unshaped["distribute"] == {"batches": 2, "bytes": 123_270.0, "measured_s": 0.001}
    assert bench.exchange_samples([{"device.0.wall_s": 1.0}]) == {"upload": [], "distribute": []}


# -- device profiles ---------------------------------------------------------------------
def test_unknown_device_profile_lists_the_valid_ones():
    with pytest.raises(UsageError, match="valid: rpi4"):
        apply_device_profile("pi5")
    assert DEVICE_PROFILES["rpi4"].cpus == 4 and DEVICE_PROFILES["rpi4"].memory_bytes == 4 * 2**30


_PEER = """
import json, os, sys
import torch
from p4bench_device.profile import apply_device_profile
default_threads = torch.get_num_threads()
record = apply_device_profile("rpi4", slot=int(sys.argv[1]))
x = torch.randn(256, 256, requires_grad=True)
(x @ x).sum().backward()  # a peer still trains
refused = None
if "address_space" in record["applied"]:
    try:
        torch.empty(5 * 2**30, dtype=torch.uint8)
        refused = False
    except (RuntimeError, MemoryError):
        refused = True
affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
print(json.dumps({"record": record, "grad": bool(torch.isfinite(x.grad).all()), "refused": refused,
                  "threads": torch.get_num_threads(), "default_threads": default_threads, "affinity": affinity}))
"""


@pytest.mark.parametrize("slot", [0, 1])
def test_rpi4_profile_in_a_peer_process(slot):
    """In a fresh process (the limits last for its lifetime): torch imported first, as in
    `device serve`; the profile pins CPUs, lowers torch's threads to them and caps the address space;
    training still runs and a 5 GiB allocation is refused."""
    done = subprocess.run(
        [sys.executable, "-c", _PEER, str(slot)],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a limit on the work
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    record = result["record"]
    assert result["grad"] is True
    assert record["profile"] == "rpi4" and record["wanted_cpus"] == 4 and record["slot"] == slot
    assert "cpu_speed" in record["not_applied"]
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        assert "cpu_affinity" in record["applied"]
        assert result["affinity"] == record["cpus"] and set(record["cpus"]) <= set(allowed)
        assert record["cpu_count"] == min(4, len(allowed))
        assert (
            result["threads"]
            == record["torch_threads"]
            == min(result["default_threads"], record["cpu_count"])
        )
        assert record["cpu_block_wrapped"] == ((slot + 1) * record["cpu_count"] > len(allowed))
    if sys.platform.startswith("linux"):
        assert "address_space" in record["applied"] and record["address_space_bytes"] == 4 * 2**30
        assert record["memory_limit"] == "RLIMIT_AS" and result["refused"] is True
