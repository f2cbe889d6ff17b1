"""Gradient canaries inserted into, and observed through, the DP mechanism.

Every client gets m canaries: records whose clipped gradient is C u_j for orthonormal
directions u_1..u_m of the flattened parameter space (shared by all clients; the
secret is each canary's inclusion bit b_j ~ Bernoulli(1/2), one per client and
canary). At each noisy release of a client, each of its canaries is Poisson-sampled
at the release's rate and, when sampled, adds C u_j to the clipped sum if b_j = 1
(add-remove: nothing if 0; replace-one: -C u_j, the record replaced by its opposite).

`AuditedMechanism` wraps any DP mechanism (composition, so it also wraps a faulty
one): it adds the canaries, lets the inner mechanism privatise the sum, and projects
the observation o_t = (noisy mean x expected batch) - clean sum = noise + canaries on
every u_j, in units of the claimed noise std. This is the white-box adversary of
DP-SGD's analysis: it sees every release and knows every other record and which of
them were sampled. Projections of isotropic Gaussian noise on orthonormal directions
are independent, so (client, canary) pairs are independent trials.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p4bench.audit.stats import release_scores
from p4bench.errors import IncompatibleError
from p4bench.privacy.mechanism import DPMechanism

if TYPE_CHECKING:
    from p4bench.models import Params
    from p4bench.privacy.releases import ReleaseContext

    # It stands in for the mechanism it wraps (`Job.wrap_mechanism` returns a DPMechanism),
    # so type checkers see a subclass; at run time it is a plain forwarder, since inherited
    # attributes (`decided_on_host`, ...) would shadow `__getattr__`'s forwarding.
    _Mechanism = DPMechanism
else:
    _Mechanism = object

__all__ = ["AuditedMechanism", "CanaryBank", "DEFAULT_MAX_CANARIES"]

DEFAULT_MAX_CANARIES = 1024  # per client, when the model has more parameters (cost m x P per release)
_DIRECTIONS, _SAMPLING = 1, 2  # independent streams of the audit seed


class CanaryBank:
    """The canaries of one run and their accumulated scores.

    Directions and bits are drawn on the first release, when the shapes of the
    DP-trained parameters are known; m = min(`per_client`, P). `scores[i, j]` sums
    the log-likelihood ratio of canary j of client i over the releases of client i.
    """

    def __init__(self, num_clients: int, per_client: int | None, seed: int) -> None:
        self.num_clients = num_clients
        self.requested = per_client
        self.seed = seed
        self.shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = None
        self.directions: torch.Tensor | None = None  # (m, P) orthonormal rows
        self.included: torch.Tensor | None = None  # (M, m) bool
        self.scores: torch.Tensor | None = None  # (M, m) float64
        self.releases = torch.zeros(num_clients, dtype=torch.int64)  # observed releases per client
        self.bypassed: list[str] = []  # noisy calls that did not go through `release`
        self._sampling = torch.Generator().manual_seed(_stream(seed, _SAMPLING))

    @property
    def per_client(self) -> int:
        return 0 if self.directions is None else int(self.directions.shape[0])

    def _setup(self, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        size = sum(int(np.prod(shape)) for _, shape in shapes)
        m = min(size, self.requested or min(size, DEFAULT_MAX_CANARIES))
        if m < 1:
            raise IncompatibleError("the audit needs at least one canary per client")
        generator = torch.Generator().manual_seed(_stream(self.seed, _DIRECTIONS))
        gaussian = torch.randn(size, m, generator=generator, dtype=torch.float64 if size * m <= 1 << 22 else torch.float32)
        basis, _ = torch.linalg.qr(gaussian)  # (P, m), orthonormal columns
        self.shapes = shapes
        self.directions = basis.T.to(torch.float32).contiguous()
        self.included = torch.rand(self.num_clients, m, generator=generator) < 0.5
        self.scores = torch.zeros(self.num_clients, m, dtype=torch.float64)

    def _check(self, sums: dict[str, torch.Tensor]) -> tuple[str, ...]:
        keys = tuple(sorted(sums))
        shapes = tuple((k, tuple(sums[k].shape[1:])) for k in keys)
        if self.shapes is None:
            self._setup(shapes)
        elif shapes != self.shapes:
            raise IncompatibleError(
                f"the audit places canaries in one parameter space, but this method releases gradients of "
                f"different shapes ({dict(self.shapes)} and {dict(shapes)})"
            )
        return keys

    def insert(
        self, rows: torch.Tensor, sums: dict[str, torch.Tensor], sample_rate: float, clip: float, neighbouring: str
    ) -> tuple[str, ...]:
        """Add the sampled canaries' clipped gradients of `rows` to `sums`, in place."""
        keys = self._check(sums)
        assert self.included is not None and self.directions is not None  # drawn by _check on the first release
        sampled = torch.rand(len(rows), self.per_client, generator=self._sampling) < sample_rate
        bits = self.included[rows]
        sign = bits.to(torch.float32) if neighbouring == "add-remove" else bits.to(torch.float32) * 2.0 - 1.0
        contribution = ((sampled.to(torch.float32) * sign) @ self.directions) * clip  # (C, P)
        offset = 0
        for key in keys:
            target = sums[key]
            width = target[0].numel()
            target.add_(contribution[:, offset : offset + width].reshape(target.shape).to(target.dtype))
            offset += width
        return keys

    def observe(
        self, rows: torch.Tensor, observation: torch.Tensor, released: torch.Tensor, sample_rate: float, mu: float, std: float,
        neighbouring: str,
    ) -> None:
        """Score the (C, P) observations (noise + canaries) of the released rows."""
        if not bool(released.any()):
            return
        assert self.directions is not None and self.scores is not None  # drawn by `insert`, which comes first
        chosen = rows[released]
        x = (observation[released] @ self.directions.T) / std  # (C', m) projections in units of the claimed std
        self.scores[chosen] += release_scores(x, sample_rate, mu, neighbouring)
        self.releases[chosen] += 1


def _stream(seed: int, tag: int) -> int:
    return int(np.random.SeedSequence([int(seed), 0xA0D17, tag]).generate_state(1, np.uint64)[0] >> 1)


def _flat(params: dict[str, torch.Tensor], keys: tuple[str, ...]) -> torch.Tensor:
    return torch.cat([params[k].reshape(len(params[k]), -1).to(torch.float32) for k in keys], dim=1)


class AuditedMechanism(_Mechanism):
    """A DP mechanism with canaries: every `release` (and so `step`, `sgd`,
    `batch_gradient`) carries them; everything else is forwarded to the inner one.

    `step` and `sgd` run the inner class's own implementation with this wrapper as
    `self`, so their releases come back through `release`. Calls that add noise
    outside `release` (fused paths) are recorded in `bank.bypassed`.
    """

    def __init__(self, inner: DPMechanism, bank: CanaryBank) -> None:
        self.inner = inner
        self.bank = bank

    def __getattr__(self, name: str) -> Any:  # settings, noise, report, allowed, ...
        return getattr(self.inner, name)

    def take(self, positions: torch.Tensor) -> AuditedMechanism:
        return AuditedMechanism(self.inner.take(positions), self.bank)

    def _template(self) -> type[DPMechanism]:
        """The class whose step/sgd to run: the innermost mechanism's, if it is one."""
        base = self.inner
        while isinstance(base, AuditedMechanism):
            base = base.inner
        return type(base) if isinstance(base, DPMechanism) else DPMechanism

    # -- the observed path -------------------------------------------------------------
    def release(
        self, ctx: ReleaseContext, sums: Params, sample_rate: float, expected_batch: torch.Tensor
    ) -> tuple[Params, torch.Tensor]:
        settings = self.inner.settings
        clean = {k: v.detach().clone() for k, v in sums.items()}
        keys = self.bank.insert(ctx.rows, sums, sample_rate, settings.clip, settings.neighbouring)
        noisy, released = self.inner.release(ctx, sums, sample_rate, expected_batch)
        # the inverse of DPMechanism.add_noise's division by the expected batch size
        scale = expected_batch.to(torch.float32).clamp_min(1.0).reshape(-1, 1)
        observation = _flat(noisy, keys) * scale - _flat(clean, keys)
        std = float(settings.noise_std)
        self.bank.observe(ctx.rows, observation, released.to(torch.bool), sample_rate, settings.clip / std, std, settings.neighbouring)
        return noisy, released

    def step(
        self, ctx: Any, params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, sample_rate: float,
        expected_batch: torch.Tensor, *args: Any, **kwargs: Any,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        return self._template().step(self, ctx, params, x, y, mask, sample_rate, expected_batch, *args, **kwargs)

    def sgd(
        self, ctx: Any, params: Params, train: Any, steps: int, lr: float, sample_rate: float | None = None
    ) -> tuple[Params, torch.Tensor]:
        # the inner class's sgd with this wrapper as `self` (duck-typed), so its releases come through `release`
        return self._template().sgd(self, ctx, params, train, steps, lr, sample_rate)

    # -- noise outside `release`: forwarded, but the audit cannot see these releases ---
    def _bypass(self, name: str) -> None:
        if name not in self.bank.bypassed:
            self.bank.bypassed.append(name)

    def gradient(self, *args: Any, **kwargs: Any) -> tuple[Params, torch.Tensor]:
        self._bypass("gradient")
        return self.inner.gradient(*args, **kwargs)

    def add_noise(self, *args: Any, **kwargs: Any) -> Params:
        self._bypass("add_noise")
        return self.inner.add_noise(*args, **kwargs)

    def add_scaled_noise(self, *args: Any, **kwargs: Any) -> None:
        self._bypass("add_scaled_noise")
        self.inner.add_scaled_noise(*args, **kwargs)

    def draw_noise(self, *args: Any, **kwargs: Any) -> None:
        self._bypass("draw_noise")
        self.inner.draw_noise(*args, **kwargs)
