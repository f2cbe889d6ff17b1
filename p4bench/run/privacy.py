"""A private run's privacy set-up: the noise multiplier calibrated to the target epsilon
over the method's privacy plan (unless given), the ledger that accounts every release, and
the DP mechanism plugged into the job (`p4bench.run.runner.prepare` calls it)."""

from __future__ import annotations

from typing import Any

from p4bench.config import RunConfig
from p4bench.engine import Job, Method
from p4bench.host.manager import Registry
from p4bench.privacy.groups import attach_mechanisms
from p4bench.privacy.ledger import PrivacyLedger, accounted_epsilon
from p4bench.privacy.mechanism import DPSettings

__all__ = ["setup_privacy"]


def setup_privacy(
    config: RunConfig, registry: Registry, method: Method, job: Job, records: int
) -> PrivacyLedger:
    """Calibrate sigma (unless given), build the ledger and plug the mechanism into the job;
    `records`: the data set's training records, N of the default delta."""
    from p4bench.privacy.accountants import ReleaseSegment
    from p4bench.privacy.calibration import calibrate_noise, default_delta

    accountant = registry.get("accountant", config.accountant)()
    reference = registry.get("accountant", "rdp")()
    pld = registry.get("accountant", "pld")()  # reported next to rdp: tight for both relations
    neighbouring = config.neighbouring or method.default_neighbouring
    delta = config.delta if config.delta is not None else default_delta(records)
    plan = method.privacy_plan()
    # In P2P (and for an honest-but-curious server) the receiver sees individual
    # updates, so the noble bound's honest default is the aggregator view.
    view = str(config.options.get("noble_view", "aggregator"))
    context = {
        "local_steps": {p.phase: p.local_steps for p in plan},
        "client_rate": {p.phase: p.client_rate for p in plan},
        "clients": config.clients,
        "view": view,
    }

    def planned_epsilon(sigma: float, of: Any = accountant) -> float:
        history = [
            ReleaseSegment(
                sigma,
                p.sample_rate,
                p.steps,
                p.local_steps,
                p.rounds,
                p.client_rate,
                config.clients,
                view,
            )
            for p in plan
            if p.steps > 0
        ]
        return accounted_epsilon(of, history, delta, neighbouring)

    sigma = config.noise_multiplier
    if sigma is None:
        assert (
            config.epsilon is not None
        )  # a private run without a noise multiplier has a target epsilon
        sigma = calibrate_noise(
            planned_epsilon, config.epsilon, tolerance=min(0.01, 0.01 * config.epsilon)
        )
    settings = DPSettings(
        clip=config.clip, noise_multiplier=float(sigma), neighbouring=neighbouring
    )
    ledger = PrivacyLedger(
        settings, accountant, reference, config.clients, delta, config.epsilon, context, pld=pld
    )
    attach_mechanisms(job, settings)
    job.release_allowed = ledger.allowed
    return ledger
