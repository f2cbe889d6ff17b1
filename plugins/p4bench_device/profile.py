"""Device profiles: hold a peer process to the CPU count and memory of a small device.

`apply_device_profile("rpi4")`, called inside a peer process at start-up, pins it to at
most 4 CPUs (`os.sched_setaffinity`), runs torch on at most that many threads, and caps its
address space at 4 GiB (`resource.setrlimit(RLIMIT_AS)`), where the OS allows each; the
returned dict says what was applied and what was not (and why), for the run's record.

What a profile does not emulate: CPU speed (a Pi 4's Cortex-A72 at 1.5 GHz is several
times slower per core than a server core; slowing a process down needs cgroup quotas,
i.e. privileges), memory bandwidth, and the OS's own share of the device's memory.

The address-space limit is RLIMIT_AS, not RLIMIT_DATA: it bounds everything the process
maps (heap, thread stacks, shared libraries), so a peer can never hold more than the
device's RAM; it over-counts reserved but untouched pages, which makes it stricter than
the device, not looser. Checked on Linux with torch 2.13 (CPU): a peer imports torch and
p4bench (about 0.8 GiB of address space) and trains under a 4 GiB limit, whether the
limit is set before or after the imports; a 4 GiB tensor is then refused
(tests/test_device_link.py runs this in a subprocess).
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from typing import Any

from p4bench.errors import UsageError

__all__ = ["DEVICE_PROFILES", "DeviceProfile", "apply_device_profile"]


@dataclass(frozen=True)
class DeviceProfile:
    """A device's CPU count and memory (bytes), as a peer process is held to them."""

    name: str
    description: str
    cpus: int
    memory_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """The profile's fields (recorded with the run)."""
        return asdict(self)


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    # Raspberry Pi 4 Model B: Broadcom BCM2711, 4 x Cortex-A72 at 1.5 GHz; the 4 GB variant is
    # Karras et al.'s (shared/papers/002: "10 Raspberry Pi model 4 devices, each with 4 GB memory
    # and a quad-core 1.5 GHz CPU"); the P4 paper's two Pi 4B clients state no RAM size.
    "rpi4": DeviceProfile(
        "rpi4",
        "Raspberry Pi 4 Model B, 4 GB: 4 x Cortex-A72 1.5 GHz",
        cpus=4,
        memory_bytes=4 * 2**30,
    )
}


def apply_device_profile(name: str, slot: int = 0) -> dict[str, Any]:
    """Hold this process to device profile `name` where the OS allows; returns what was
    applied (for the run's record). `slot` spreads peers that share a machine over
    disjoint CPUs: slot k takes the k-th block of the profile's CPU count among the CPUs
    this process may use (wrapping around when there are too few: `cpu_block_wrapped`; on
    a device of its own a peer keeps slot 0).
    Unknown names raise UsageError listing the valid ones."""
    profile = DEVICE_PROFILES.get(str(name).strip().lower())
    if profile is None:
        raise UsageError(
            f"unknown device profile {name!r}; valid: {', '.join(sorted(DEVICE_PROFILES))}"
        )
    record: dict[str, Any] = {
        "profile": profile.name,
        "description": profile.description,
        "wanted_cpus": profile.cpus,
        "wanted_memory_bytes": profile.memory_bytes,
        "slot": max(int(slot), 0),
        "applied": [],
        "not_applied": {},
    }
    not_applied: dict[str, str] = record["not_applied"]
    not_applied["cpu_speed"] = (
        "not emulated: the host's cores run at their own speed (slowing them needs cgroup quotas)"
    )

    cpus = _pin_cpus(profile.cpus, slot, record)
    record["cpus"], record["cpu_count"] = cpus, len(cpus)
    try:
        import torch

        # never more threads than CPUs pinned (or, unpinned, the device has), never more than before: an explicit
        # --threads (local peers sharing a host's cores) stays as low as it was
        torch.set_num_threads(max(1, min(torch.get_num_threads(), len(cpus), profile.cpus)))
        record["torch_threads"] = torch.get_num_threads()
        record["applied"].append("torch_threads")
    except Exception as exc:  # noqa: BLE001 - recorded; the run goes on with torch's default
        not_applied["torch_threads"] = repr(exc)

    _limit_address_space(profile.memory_bytes, record)
    return record


def _pin_cpus(count: int, slot: int, record: dict[str, Any]) -> list[int]:
    """Pin to `count` CPUs (block `slot`) of those allowed; the CPUs this process ends up on."""
    if not hasattr(os, "sched_setaffinity"):
        record["not_applied"]["cpu_affinity"] = "os.sched_setaffinity is not available on this OS"
        usable = os.cpu_count() or 1
        return list(range(min(count, usable)))
    allowed = sorted(os.sched_getaffinity(0))
    take = min(count, len(allowed))
    first = (max(int(slot), 0) * take) % len(allowed)
    chosen = sorted(allowed[(first + i) % len(allowed)] for i in range(take))
    # slot k's block wrapped round the allowed CPUs: peers of lower slots on this machine may run on them too
    record["cpu_block_wrapped"] = (max(int(slot), 0) + 1) * take > len(allowed)
    if take < count:
        record["not_applied"]["cpu_count"] = (
            f"only {len(allowed)} CPU(s) available to this process, {count} wanted"
        )
    try:
        os.sched_setaffinity(0, chosen)
        record["applied"].append("cpu_affinity")
    except OSError as exc:
        record["not_applied"]["cpu_affinity"] = repr(exc)
        return allowed
    return sorted(os.sched_getaffinity(0))


def _limit_address_space(limit: int, record: dict[str, Any]) -> None:
    """Cap RLIMIT_AS at `limit` bytes (never raising a lower limit already set)."""
    if not hasattr(resource, "RLIMIT_AS"):
        record["not_applied"]["address_space"] = "RLIMIT_AS is not available on this OS"
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    target = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= target:
        record["address_space_bytes"] = soft
        record["not_applied"]["address_space"] = (
            f"a lower limit was already set ({soft} bytes): kept"
        )
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (target, hard))
    except (OSError, ValueError) as exc:  # e.g. macOS refuses RLIMIT_AS below what is mapped
        record["not_applied"]["address_space"] = repr(exc)
        return
    record["address_space_bytes"] = resource.getrlimit(resource.RLIMIT_AS)[0]
    record["memory_limit"] = "RLIMIT_AS"
    record["applied"].append("address_space")
