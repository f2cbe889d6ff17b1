"""An orthonormal basis of each client's data span, applied without being stored.

The span path's `basis` noise (`p4bench.privacy.span`) needs Q (d, m) with orthonormal
columns and X^T = Q R. A stored Q is as large as the data (2.6 GB on the CIFAR-shaped
bench); here, for n <= d, Q = X^T R^-1 is applied implicitly from the data already in
memory and R, the upper Cholesky factor of the Gram matrix X X^T (n x n per client):

    W Q = (W X^T) R^-1,    B Q^T = (B R^-T) X.

So the span path's two GEMMs run against X itself and the basis costs 3 n^2 numbers per
client instead of n d.

Numerics. Cholesky QR squares the condition number: the Gram matrix and its factor are
computed in float64 (the float32 samples' products are exact there), so R^-T X has
orthonormal rows to about 1e-16 cond(X)^2 in exact float32 data. What remains is the
float32 GEMM with X: an error of about eps32 cond(X) relative to the noise. A client
whose cond(X) exceeds `MAX_IMPLICIT_CONDITION` (or whose samples are linearly dependent,
so that R is singular) keeps an explicit Householder basis, computed and stored for it
alone (`SpanFactor.bases`): the fallback is per client and exact to rounding whatever
the conditioning. With d < n the basis spans R^d (m = d < n): R is not square and the
explicit basis is small anyway, so the caller keeps the data's stored basis
(`implicit_span_applies`).

Padding rows (zeros) have zero rows and columns in X X^T; their diagonal is set to the
clients' mean squared norm before the factorisation, so R stays invertible and
well-scaled, and their rows of the coordinates (`SpanFactor.coords`, X = coords^T Q^T)
are zero, as in a Householder R: Q's columns for them are zero, Q Q^T still projects
onto the span.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = [
    "MAX_IMPLICIT_CONDITION",
    "SpanFactor",
    "implicit_span_applies",
    "span_factors",
]

# eps32 * 1e3 ~ 1e-4: the largest relative error of the implicitly applied basis, against
# about 1e-7 for a stored one (tests/test_span_factor.py measures it at this conditioning)
MAX_IMPLICIT_CONDITION = 1e3


def implicit_span_applies(samples: int, dim: int) -> bool:
    """Whether the basis can be applied implicitly: R is square (n <= d)."""
    return samples <= dim


@dataclass(frozen=True)
class SpanFactor:
    """Per-client tables of the implicit basis, all (C, n, n) but `bases`.

    gram: X X^T (float32, computed in float64); coords: X = coords^T Q^T (float32: R with
    padding rows zeroed, or the Householder R of an explicit client); triangle: the float64
    factor Q^T = triangle^-T X applies through (R; the identity for an explicit client);
    explicit: (C,) bool, clients with a stored basis; bases: (F, n, d) their Q^T, in client
    order; condition: (C,) float64 cond(X) (inf where the samples are dependent).
    """

    gram: torch.Tensor
    coords: torch.Tensor
    triangle: torch.Tensor
    explicit: torch.Tensor
    bases: torch.Tensor
    condition: torch.Tensor

    def rows(self, index: torch.Tensor, width: int) -> SpanFactor:
        """The tables of the clients at `index`, trimmed to `width` samples (a subset's
        own longest length: the rows beyond it are padding for every client kept)."""
        explicit = self.explicit[index]
        slots = (
            torch.cumsum(self.explicit.long(), 0) - 1
        )  # position of each explicit client in `bases`
        return SpanFactor(
            self.gram[index, :width, :width],
            self.coords[index, :width, :width],
            self.triangle[index, :width, :width],
            explicit,
            self.bases[slots[index][explicit], :width],
            self.condition[index],
        )

    def to_span(self, rows: torch.Tensor) -> torch.Tensor:
        """(C, r, n) products P = W X^T of rows W with the data -> W Q = P R^-1 (float32)."""
        solved: torch.Tensor = torch.linalg.solve_triangular(  # torch.linalg is untyped
            self.triangle, rows.double(), upper=True, left=False
        )
        return solved.float()

    def from_span(self, coefficients: torch.Tensor) -> torch.Tensor:
        """(C, r, n) coefficients B in the basis -> B R^-T, whose product with X is B Q^T."""
        solved: torch.Tensor = torch.linalg.solve_triangular(
            self.triangle.transpose(1, 2), coefficients.double(), upper=False, left=False
        )
        return solved.float()

    def explicit_products(self, rows: torch.Tensor, products: torch.Tensor) -> None:
        """For the explicit clients, overwrite `products` (C, r, n), computed as P = W X^T,
        with W Q (their stored basis) so that `to_span` (identity there) leaves it as is."""
        if len(self.bases):
            products[self.explicit] = torch.bmm(rows[self.explicit], self.bases.transpose(1, 2))

    def nbytes(self) -> int:
        tensors = dataclasses.astuple(self)
        return sum(t.numel() * t.element_size() for t in tensors)


def span_factors(x: torch.Tensor, chunk: int = 4) -> SpanFactor:
    """The implicit-basis tables of every client's flattened samples x (C, n, ...), n <= d,
    in chunks of clients (the float64 temporaries are `chunk` clients' samples)."""
    flat = x.flatten(start_dim=2)
    count, width, dim = flat.shape
    gram = torch.empty(count, width, width, dtype=torch.float64, device=flat.device)
    for start in range(0, count, chunk):
        part = flat[start : start + chunk].double()
        gram[start : start + chunk] = torch.bmm(part, part.transpose(1, 2))
    diagonal = gram.diagonal(dim1=1, dim2=2)
    padding = diagonal <= 0  # zero rows: padding (or an all-zero sample, which spans nothing)
    samples = (~padding).sum(1).clamp_min(1)
    mean_norm = (diagonal * ~padding).sum(1) / samples
    mean_norm = torch.where(mean_norm > 0, mean_norm, torch.ones_like(mean_norm))
    padded = gram + torch.diag_embed(padding * mean_norm.unsqueeze(1))
    eigenvalues = torch.linalg.eigvalsh(padded)
    smallest, largest = eigenvalues[:, 0], eigenvalues[:, -1]
    condition = torch.where(
        smallest > 0,
        (largest / smallest.clamp_min(1e-300)).sqrt(),
        torch.full_like(largest, torch.inf),
    )
    triangle, info = torch.linalg.cholesky_ex(padded, upper=True)
    explicit = (info != 0) | ~(condition <= MAX_IMPLICIT_CONDITION)
    coords = (triangle * ~padding.unsqueeze(2)).float()
    chosen = explicit.nonzero().flatten().tolist()
    bases = torch.empty(len(chosen), width, dim, device=flat.device)
    eye = torch.eye(width, dtype=torch.float64, device=flat.device)
    for slot, client in enumerate(chosen):  # the fallback: a stored Householder basis
        q, r = torch.linalg.qr(flat[client].t())
        # R's diagonal made non-negative: for independent samples Q is then the implicit
        # one (QR with a positive diagonal is unique), so either route gives the same numbers
        signs = torch.where(r.diagonal() < 0, -1.0, 1.0)
        bases[slot] = q.t() * signs.unsqueeze(1)
        coords[client] = r * signs.unsqueeze(1)
        triangle[client] = eye
    return SpanFactor(gram.float(), coords, triangle, explicit, bases, condition)
