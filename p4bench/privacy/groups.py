"""Builds the DP mechanism of each group of clients a runtime holds, wired to the run's
ledger: the privacy harness's side of `Job.dp_factory`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p4bench.privacy.mechanism import DPMechanism, DPSettings
from p4bench.privacy.noise import NoiseStreams

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.job import Job, MechanismFactory

__all__ = ["attach_mechanisms"]


def attach_mechanisms(job: Job, settings: DPSettings) -> None:
    """Make `job` private with `settings`: each group's mechanism draws its clients' noise
    (secret per client where the runtime says so) and reports every release through
    `job.report_release`, subject to `job.release_allowed`, both looked up at each
    release, so observers attached after this call (the runner's hook relay, a device
    peer's own ledger) still see every release; the audit's `job.wrap_mechanism` is
    applied when the group is built."""
    job.dp = settings
    job.dp_factory = _factory(job, settings)


def _factory(job: Job, settings: DPSettings) -> MechanismFactory:
    def build(rows: torch.Tensor, secret: bool) -> DPMechanism:
        noise = NoiseStreams(
            job.config.seed, rows.tolist(), secure=secret, generator=noise_generator(job.config)
        )
        mechanism = DPMechanism(
            settings,
            noise,
            lambda release: job.report_release(release),
            lambda clients, rate, phase: job.release_allowed(clients, rate, phase),
        )
        return job.wrap_mechanism(mechanism) if job.wrap_mechanism is not None else mechanism

    return build


def noise_generator(config: RunConfig) -> str:
    """The seeded noise generator of a run: `config.noise_generator`, with `auto` meaning
    torch's CPU generators on the CPU and the device-independent Philox streams elsewhere."""
    if config.noise_generator != "auto":
        return config.noise_generator
    return "torch" if config.device == "cpu" else "philox"
