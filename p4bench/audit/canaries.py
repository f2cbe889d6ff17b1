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

Releases of clipped values alone (`Releases.privatise`, PDSL's and DP-CGA's one release
of k cross-gradients) go through `privatise_sums`: the canaries are directions of that
release's space (k slots x P) and their norm is the release's sensitivity (scale x C),
so their shift is C / noise_std in units of the row's noise, as above.
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

DEFAULT_MAX_CANARIES = (
    1024  # per client, when the model has more parameters (cost m x P per release)
)
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
        gaussian = torch.randn(
            size,
            m,
            generator=generator,
            dtype=torch.float64 if size * m <= 1 << 22 else torch.float32,
        )
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
        self,
        rows: torch.Tensor,
        sums: dict[str, torch.Tensor],
        sample_rate: float,
        clip: float | torch.Tensor,
        neighbouring: str,
    ) -> tuple[str, ...]:
        """Add the sampled canaries' clipped gradients of `rows` to `sums`, in place: each
        canary's norm is `clip`, or clip[i] for row i (a (C,) tensor)."""
        keys = self._check(sums)
        assert (
            self.included is not None and self.directions is not None
        )  # drawn by _check on the first release
        sampled = torch.rand(len(rows), self.per_client, generator=self._sampling) < sample_rate
        bits = self.included[rows]
        sign = (
            bits.to(torch.float32)
            if neighbouring == "add-remove"
            else bits.to(torch.float32) * 2.0 - 1.0
        )
        norm = clip.to(torch.float32).reshape(-1, 1) if isinstance(clip, torch.Tensor) else clip
        contribution = ((sampled.to(torch.float32) * sign) @ self.directions) * norm  # (C, P)
        offset = 0
        for key in keys:
            target = sums[key]
            width = target[0].numel()
            target.add_(
                contribution[:, offset : offset + width].reshape(target.shape).to(target.dtype)
            )
            offset += width
        return keys

    def observe(
        self,
        rows: torch.Tensor,
        observation: torch.Tensor,
        released: torch.Tensor,
        sample_rate: float,
        mu: float | torch.Tensor,
        std: float,
        neighbouring: str,
    ) -> None:
        """Score the (C, P) observations (noise + canaries) of the released rows; `mu`, the
        canary's shift in units of `std`, is one figure or one per row ((C,) tensor)."""
        if not bool(released.any()):
            return
        assert (
            self.directions is not None and self.scores is not None
        )  # drawn by `insert`, which comes first
        chosen = rows[released]
        x = (
            observation[released] @ self.directions.T
        ) / std  # (C', m) projections in units of the claimed std
        shift = mu[released].reshape(-1, 1) if isinstance(mu, torch.Tensor) else mu
        self.scores[chosen] += release_scores(x, sample_rate, shift, neighbouring)
        self.releases[chosen] += 1


def _stream(seed: int, tag: int) -> int:
    return int(
        np.random.SeedSequence([int(seed), 0xA0D17, tag]).generate_state(1, np.uint64)[0] >> 1
    )


def privatised_norm(settings: Any, factor: torch.Tensor) -> torch.Tensor:
    """(C,) the norm of a canary in a `privatise` release whose row i gets noise of std
    factor[i] x noise_std: factor[i] C, the release's sensitivity (`AuditedMechanism.privatise_sums`).

    That reading needs the noise std to be calibrated to the clip in force, noise_std =
    sigma C (2 sigma C under replace-one), as every `DPSettings` is. A planted fault may
    break it (`p4bench.testing.audit_faults.unclipped`: clip 1e12, noise for the claimed
    C), and then the factor means two things: per-example clipping scales the noise by
    sqrt(k) whatever the clip (the sensitivity is sqrt(k) x 1e12), batch clipping reads
    the clip into its factor (2 sqrt(k) x 1e12 / C: its noise follows the clip, and the
    release is as private as claimed). The mechanism cannot tell them apart, so the canary
    takes the reading that no release of clipped values can exceed: factor[i] x min(C, the
    C of the noise std, noise_std / sigma, halved under replace-one), and at least C (one
    record's clipped value, in one slot). Both are
    factor[i] C for consistent settings; with clipping removed, per-example clipping gets
    1e12 (the fault shows) and batch clipping 2 sqrt(k) x 1e12 (no fault: none to show).
    """
    relation = 2.0 if settings.neighbouring == "replace-one" else 1.0
    clip, sigma = float(settings.clip), float(settings.noise_multiplier)
    calibrated = (
        float(settings.noise_std) / (relation * sigma) if sigma > 0 else clip
    )  # the C of the noise std
    return (factor.to(torch.float64) * min(clip, calibrated)).clamp_min(clip)


def _flat(params: dict[str, torch.Tensor], keys: tuple[str, ...]) -> torch.Tensor:
    return torch.cat([params[k].reshape(len(params[k]), -1).to(torch.float32) for k in keys], dim=1)


class AuditedMechanism(_Mechanism):
    """A DP mechanism with canaries: every `release` (and so `step`, `sgd`,
    `batch_gradient`) and every `privatise_sums` (`Releases.privatise`: PDSL's and
    DP-CGA's cross-gradients) carries them; everything else is forwarded to the inner one.

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
        self.bank.observe(
            ctx.rows,
            observation,
            released.to(torch.bool),
            sample_rate,
            settings.clip / std,
            std,
            settings.neighbouring,
        )
        return noisy, released

    def privatise_sums(
        self,
        ctx: ReleaseContext,
        sums: Params,
        scale: torch.Tensor | None,
        sample_rate: float,
        released: torch.Tensor,
    ) -> None:
        """`Releases.privatise`'s release (PDSL's and DP-CGA's cross-gradients): `sums` hold the
        release's clipped values alone, and the inner mechanism adds noise of std
        scale[i] x noise_std to row i. The canaries go in first, as one more record's clipped
        values would, and the observation is sums after minus sums before: noise + canaries.

        A canary's norm is the release's sensitivity, scale[i] C (`privatised_norm`): the
        noise is scaled by the factor that the concatenation multiplies the sensitivity by,
        so in units of the row's noise std the shift is C / noise_std, as in `release`.
        - per-example clipping (Poisson rate q): scale sqrt(k) over k models, each model's
          gradient of a record clipped to C: the canary is a record in the batch at rate q
          whose clipped gradients (norm sqrt(k) C together) enter all k slots at once.
        - batch clipping (PDSL's default, rate 1): a record has no clipped term of its own,
          it moves each model's clipped batch mean, by up to 2C (any two points of the
          C-ball), which is the sensitivity the accountant charges (under both relations).
          A canary of norm C per model would be half of that, an audit of a multiplier 2
          sigma, weaker than the claim. Here scale is 2 sqrt(k) under add-remove (the canary
          is 2C per model) and sqrt(k) under replace-one (+-C per model, 2C apart): each
          release moves by the accountant's own sensitivity, mu = 1 / sigma at rate 1, so
          the audit is of the claim the accountant makes (white-box: the canary record
          dominates its batch, as the mechanism level's gradient canaries are for DP-SGD).
        The canaries are orthonormal directions of the whole release (k models x P
        parameters, a row's padding slots included): the noise is isotropic, so only the
        norm of a shift matters, not how it splits over the models.
        """
        settings = self.inner.settings
        factor = (
            torch.ones(len(ctx.rows), dtype=torch.float64)
            if scale is None
            else scale.detach().double().reshape(-1)
        )
        norm = privatised_norm(settings, factor)
        clean = {k: v.detach().clone() for k, v in sums.items()}
        keys = self.bank.insert(ctx.rows, sums, sample_rate, norm, settings.neighbouring)
        self.inner.privatise_sums(ctx, sums, scale, sample_rate, released)
        # in units of the mechanism's noise std: row i's noise is factor[i] x noise_std
        observation = (_flat(sums, keys) - _flat(clean, keys)) / factor.to(torch.float32).reshape(
            -1, 1
        )
        std = float(settings.noise_std)
        self.bank.observe(
            ctx.rows,
            observation,
            released.to(torch.bool),
            sample_rate,
            norm / factor / std,
            std,
            settings.neighbouring,
        )

    def step(
        self,
        ctx: Any,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        sample_rate: float,
        expected_batch: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        return self._template().step(
            self, ctx, params, x, y, mask, sample_rate, expected_batch, *args, **kwargs
        )

    def sgd(
        self,
        ctx: Any,
        params: Params,
        train: Any,
        steps: int,
        lr: float,
        sample_rate: float | None = None,
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
