"""The DP noise of K linear-model steps computed in the span of a client's data (P4's
span path, `p4bench_p4.span`): how the K per-step Gaussian draws enter the
weights, the bias and the logits the later steps see.

After K steps the proxy's weights are W_K = W_0 - A_K X + sum_k u_k N_k, with N_k (L x d)
step k's standard normal draw and u_k = -lr std / E its factor (0 for a refused
release); the logits of step k see N_j X^T for j < k only. Two samplers (`NOISE_MODES`),
both exactly DP-SGD's per-step Gaussian noise:
- `streams`: the K draws N_k themselves, from the same per-client streams in the same
  order as K separate releases, projected as N_k X^T by the caller's GEMM (all but the
  last: no later logits see it). The same numbers as K generic releases.
- `basis` (default): with an orthonormal basis Q of the span of X (X^T = Q R, once
  per dataset: applied implicitly as Q = X^T R^-1 where n <= d, keeping only R,
  `p4bench.privacy.span_factor`; a stored Householder basis otherwise), split N_k = (N_k Q) Q^T + N_k (I - Q Q^T). The
  coordinates Z_k = N_k Q are i.i.d. standard normal because Q is orthonormal, and the
  run sees the noise only through Z_k (logits: N_k X^T = Z_k R) and through the sum
  sum_k u_k N_k, whose part outside the span is one Gaussian with std
  s = sqrt(sum_k u_k^2). So it draws Z_k (L x m, m = min(n, d)) per step and one
  G (L x d): sum_k u_k N_k = (sum_k u_k Z_k) Q^T + s (G - (G Q) Q^T). Every quantity
  the run computes has exactly the joint distribution of the `streams` draws
  (tests/test_p4_span.py, on moments), with 1/K of the Gaussian draws and a GEMM of 3L
  rows instead of (K+1)L; only the realisation for a given seed differs. The implicit
  basis inverts R: its error grows like eps32 cond(X), so a client whose data is
  ill-conditioned keeps a stored basis (`span_factor.MAX_IMPLICIT_CONDITION`).

The bias's noise is drawn per step in both modes. All draws go through the open
`Releases` transaction of the K releases (recorded before anything is computed).
"""

from __future__ import annotations

import torch

from p4bench.privacy.releases import Releases

__all__ = ["NOISE_MODES", "SpanNoise"]

NOISE_MODES = ("basis", "streams")


class SpanNoise:
    """The noise of K proxy steps of `count` rows with `classes` x `dim` weights.

    The caller stacks `rows` noise rows under its weights so that one GEMM with its data
    (Q with `basis`, X with `streams`) projects the first `projected` of them, and calls
    `draw`, `seen`, `step` (each step) and `finish` in that order.
    """

    def __init__(
        self,
        releases: Releases,
        mode: str,
        lr: float,
        expected_batch: torch.Tensor,
        classes: int,
        steps: int,
    ) -> None:
        if mode not in NOISE_MODES:
            raise ValueError(
                f"span noise mode must be one of {', '.join(NOISE_MODES)}, got {mode!r}"
            )
        self.releases, self.mode, self.classes, self.steps = releases, mode, classes, steps
        self.basis = mode == "basis"
        # the DP mean divides by the expected batch; u_k folds the noise std into the step size
        self.step_sizes = releases.mean_step(lr, expected_batch).float()  # (K, C)
        self.scale = -self.step_sizes * releases.noise_std  # (K, C): u_k per row
        self.rows = classes if self.basis else steps * classes
        # the last step's noise is seen by no later logits: `streams` does not project it
        self.projected = classes if self.basis else (steps - 1) * classes
        # set by `draw`: (C, K, L) per-step bias draws, (C, K, L, m) Z_k (`basis`), (C, K, L, d) N_k
        # (`streams`: views of the caller's rows)
        self.bias = self.coordinates = self.blocks = torch.empty(0)

    def draw(self, rows: torch.Tensor, width: int) -> None:
        """Draw every step's noise: into `rows` (C, `self.rows`, d), the caller's stacked noise
        rows (G with `basis`, N_0..N_K-1 with `streams`), and into own buffers; `width` is
        m, the basis size (`basis` only)."""
        count, steps, classes = rows.shape[0], self.steps, self.classes
        self.bias = torch.empty(count, steps, classes)
        if self.basis:
            self.coordinates = torch.empty(count, steps, classes, width)
            parts = [
                part for k in range(steps) for part in (self.bias[:, k], self.coordinates[:, k])
            ]
            self.releases.draw([*parts, rows])  # then G, for the part outside the span
        else:
            self.blocks = rows.view(count, steps, classes, rows.shape[2])
            self.releases.draw(
                [part for k in range(steps) for part in (self.bias[:, k], self.blocks[:, k])]
            )

    def seen(self, projections: torch.Tensor, coords: torch.Tensor | None) -> torch.Tensor:
        """(C, (K-1) L, n): N_k X^T for k < K-1, from the GEMM's `projections` of the noise
        rows (`streams`) or from Z_k and the coordinates R (C, m, n) of the data (`basis`)."""
        if not self.basis:
            return projections
        assert coords is not None, "the basis sampler needs the data's coordinates R"
        count = projections.shape[0]
        earlier = self.coordinates[:, : self.steps - 1].reshape(
            count, (self.steps - 1) * self.classes, coords.shape[1]
        )
        return torch.bmm(earlier, coords)  # N_k X^T = Z_k R

    def step(
        self, k: int, seen: torch.Tensor, noise_logits: torch.Tensor, proxy_bias: torch.Tensor
    ) -> None:
        """Step k's noise: into the proxy's bias (C, L), and into the logits (C, L, n) later steps see."""
        count, classes = proxy_bias.shape
        if k < self.steps - 1:  # the last step's noise is seen by no later logits
            noise_logits.addcmul_(
                seen[:, k * classes : (k + 1) * classes], self.scale[k].view(count, 1, 1)
            )
        proxy_bias.addcmul_(self.bias[:, k], self.scale[k].view(count, 1))

    def finish(
        self,
        weight: torch.Tensor,
        coefficients: torch.Tensor,
        projections: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Add sum_k u_k N_k to the proxy's final weights W_K = `weight` - `coefficients` (data),
        in place: `weight` (C, L, d) the initial weights, `coefficients` (C, L, m) the
        proxy's coefficients in the basis (`basis`; unused with `streams`), `projections`
        the GEMM's projections of the noise rows and `rows` the noise rows of `draw`."""
        if self.basis:
            # sum_k u_k N_k = (sum_k u_k Z_k) Q^T + s (G - (G Q) Q^T)
            coefficients.add_(self.in_span(projections))
            self.add_outside(weight, rows)
        else:
            count = weight.shape[0]
            for k in range(self.steps):
                weight.addcmul_(self.blocks[:, k], self.scale[k].view(count, 1, 1))

    def in_span(self, projections: torch.Tensor) -> torch.Tensor:
        """(C, L, m) the coefficients in the basis of what `finish` subtracts for the noise,
        -(sum_k u_k Z_k) + s (G Q), from `projections` (C, L, m), G Q (`basis` only)."""
        count = projections.shape[0]
        inside = (self.coordinates * self.scale.t().reshape(count, self.steps, 1, 1)).sum(dim=1)
        return projections * self.spread().view(count, 1, 1) - inside

    def add_outside(self, weight: torch.Tensor, rows: torch.Tensor) -> None:
        """Add s G, the noise rows of `draw` (C, L, d) scaled, to `weight` in place: with
        `in_span`'s part projected out of it by the caller (`basis` only)."""
        weight.addcmul_(rows, self.spread().view(weight.shape[0], 1, 1))

    def spread(self) -> torch.Tensor:
        """(C,) s = sqrt(sum_k u_k^2) per row: the std of the summed noise outside the span."""
        spread: torch.Tensor = self.scale.square().sum(dim=0).sqrt()
        return spread
