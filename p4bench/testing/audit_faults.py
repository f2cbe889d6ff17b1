"""Planted privacy faults the method-level audit must flag (its tests and
`bench/audit_method.py`). For tests and benchmarks only: never in a real run.

- `unclipped`: a `Job.wrap_mechanism` whose clipping is removed (clip norm 1e12)
  while the noise and the ledger still use the claimed C.
- `oversampled(factor)`: a `Job.wrap_mechanism` whose DP-SGD (`DPMechanism.sgd`)
  samples at factor x the claimed rate while the ledger records the claimed rate.
- `LeakyProxyFL` (`leaky-proxyfl`, registered by `FAULTY_METHODS`): a third-party
  method that sends its non-DP private (personal) model instead of its DP proxy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from p4bench.engine.messages import UPDATE_PREFIX
from p4bench.engine.method_kit import send_along
from p4bench.engine.state import flatten
from p4bench.hookspecs import hookimpl
from p4bench.privacy.mechanism import DPMechanism, DPSettings
from p4bench_baselines.proxyfl import ProxyFL

if TYPE_CHECKING:
    from p4bench.engine.messages import Messages
    from p4bench.engine.method import Method, StepContext
    from p4bench.engine.state import State
    from p4bench.models import Params
    from p4bench.privacy.releases import ReleaseContext

__all__ = ["FAULTY_METHODS", "LeakyProxyFL", "oversampled", "unclipped"]

NO_CLIP = 1e12  # no per-example gradient of a finite model reaches it


@dataclass(frozen=True)
class _UnclippedSettings(DPSettings):
    """Clips at `clip` (huge) but adds the noise of the claimed clip norm."""

    claimed_clip: float = 1.0

    @property
    def noise_std(self) -> float:
        factor = 2.0 if self.neighbouring == "replace-one" else 1.0
        return factor * self.noise_multiplier * self.claimed_clip


def unclipped(mechanism: DPMechanism) -> DPMechanism:
    """The run's mechanism with clipping removed; noise and ledger unchanged."""
    s = mechanism.settings
    settings = _UnclippedSettings(NO_CLIP, s.noise_multiplier, s.neighbouring, claimed_clip=s.clip)
    return DPMechanism(settings, mechanism.noise, mechanism.report, mechanism.allowed)


class _Oversampling(DPMechanism):
    """DP-SGD sampling at `factor` x the rate it reports to the ledger."""

    factor = 5.0

    def take(self, positions: torch.Tensor) -> _Oversampling:
        taken = _Oversampling(self.settings, self.noise.take(positions), self.report, self.allowed)
        taken.factor = self.factor
        return taken

    def sgd(
        self,
        ctx: Any,
        params: Params,
        train: Any,
        steps: int,
        lr: float,
        sample_rate: float | None = None,
    ) -> tuple[Params, torch.Tensor]:
        rate = ctx.config.data_rate if sample_rate is None else sample_rate
        return super().sgd(ctx, params, train, steps, lr, min(1.0, self.factor * rate))

    def admit(self, ctx: ReleaseContext, sample_rate: float) -> torch.Tensor:
        return super().admit(ctx, sample_rate / self.factor)

    def record(self, ctx: ReleaseContext, released: torch.Tensor, sample_rate: float) -> None:
        super().record(ctx, released, sample_rate / self.factor)


def oversampled(factor: float = 5.0) -> Callable[[DPMechanism], DPMechanism]:
    """A `Job.wrap_mechanism`: DP-SGD samples at `factor` x the claimed rate."""
    if not factor >= 1.0 or math.isinf(factor):
        raise ValueError(f"factor must be finite and >= 1, got {factor}")

    def wrap(mechanism: DPMechanism) -> DPMechanism:
        faulty = _Oversampling(
            mechanism.settings, mechanism.noise, mechanism.report, mechanism.allowed
        )
        faulty.factor = factor
        return faulty

    return wrap


class LeakyProxyFL(ProxyFL):
    """ProxyFL that sends its private model (trained without DP) where it should send
    its DP proxy; the ledger still counts the proxy's DP steps."""

    name = "leaky-proxyfl"
    description = "test fault: ProxyFL sending its non-DP private model"

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        return send_along(
            ctx.rows, self.mixing(ctx.round) != 0, flatten(state["private"], UPDATE_PREFIX)
        )


class _FaultyMethods:
    """A plugin registering `LeakyProxyFL` (`plugin_manager.register(FAULTY_METHODS)`)."""

    @hookimpl
    def register_methods(self) -> list[type[Method]]:
        return [LeakyProxyFL]


FAULTY_METHODS = _FaultyMethods()
