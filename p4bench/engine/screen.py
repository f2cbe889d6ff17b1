"""The screen in front of every defense: what no aggregation rule may ever trust.

Before a defense's `select` or `aggregate` runs, `Defense` (p4bench.engine.threats)
passes its input through `screen`, so every defense, built-in or third-party, gets the
same guarantees without deriving them itself:

- an update with a non-finite entry (NaN, +inf, -inf) is masked out and its row zeroed:
  a NaN row makes every distance to it NaN (Krum used to rank that as the best score),
  inf sorts into coordinate-wise order statistics, and 0 * NaN = NaN in every weighted
  sum, so masking alone would not keep it out;
- an update whose weight is non-finite or negative is masked out (weight 0): rules that
  ignore weights (median, Krum) would otherwise still count it;
- where the sender ids are known (`senders` (B, n), -1 = padding), a sender counts once
  per aggregation: its first usable update is kept and its repeats are masked out, so one
  sender's copies cannot outvote the honest updates (m-Krum scores identical copies 0);
- afterwards (`Screened.finish`), a receiver left with no usable update, or whose rule
  still produced a non-finite aggregate (finite updates so large their mean overflows),
  gets the zero aggregate with every update marked dropped. Zero is "no step" where
  updates are deltas; methods that mix whole models include the receiver's own model,
  so there it only happens when that model is itself non-finite.

Screened-out updates are reported dropped (`kept` False), also by defenses that drop
nothing by design (`filters = False`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch


def finite_rows(updates: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, n) bool: the updates (B, n, P) (within `mask`, if given) whose entries are all finite.

    One reduction and no (B, n, P) temporary: a row's sum is non-finite exactly when an
    entry is NaN or +-inf, or when finite entries overflow the sum (no training update
    comes near float32's 3e38; such a row would overflow every distance too)."""
    finite = torch.isfinite(updates.sum(dim=-1))
    return finite if mask is None else finite & mask


def usable_weights(weights: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: finite, non-negative weights (zero is a valid weight)."""
    return torch.isfinite(weights) & (weights >= 0)


def first_per_sender(senders: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: the entries of `mask` whose sender (`senders` (B, n), ids >= 0) has no
    earlier entry of `mask` in the same row: the first copy is kept, its repeats are not.

    A stable sort per row puts each sender's copies side by side in arrival order, so
    the repeats are the sorted slots equal to their left neighbour (O(n log n), no n x n)."""
    key = torch.where(mask, senders.to(torch.int64), -1)
    ordered, order = torch.sort(key, dim=1, stable=True)
    repeat = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    duplicate = torch.zeros_like(mask).scatter(1, order[:, 1:], repeat)
    return mask & ~duplicate


@dataclass(frozen=True)
class Screened:
    """A defense's input after `screen`: `mask` marks the usable updates, `updates` has its
    non-finite rows zeroed, `weights` is 0 outside `mask`."""

    updates: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor

    def select(self, kept: torch.Tensor) -> torch.Tensor:
        """A rule's (B, n) selection, restricted to the usable updates."""
        return kept & self.mask

    def finish(
        self, aggregate: torch.Tensor, kept: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aggregate, kept) of a rule: kept restricted to the usable updates; a receiver
        with none, or with a non-finite aggregate, gets zeros and keeps nothing."""
        good = self.mask.any(dim=1) & torch.isfinite(aggregate).all(dim=1)
        aggregate = torch.where(
            good.unsqueeze(1),
            aggregate,
            torch.zeros((), dtype=aggregate.dtype, device=aggregate.device),
        )
        return aggregate, kept & self.mask & good.unsqueeze(1)


def screen(
    updates: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    senders: torch.Tensor | None = None,
) -> Screened:
    """The input of a defense with non-finite updates, bad weights and (given `senders`)
    repeated senders masked out. The updates are copied only when a row is non-finite."""
    finite = finite_rows(updates)
    usable = mask & finite & usable_weights(weights)
    if senders is not None:
        usable = first_per_sender(senders, usable)
    if not bool(finite.all()):  # the one read back: copy only when there is a row to zero
        updates = updates.masked_fill(~finite.unsqueeze(-1), 0)
    weights = torch.where(
        usable, weights, torch.zeros((), dtype=weights.dtype, device=weights.device)
    )
    return Screened(updates, weights, usable)


RuleT = TypeVar("RuleT", bound=Callable[..., Any])


def screened(rule: RuleT) -> RuleT:
    """`rule`, a defense's `select` or `aggregate`, run on screened input and its result
    restricted to the usable updates. `Defense` applies this to every subclass's own
    `select`/`aggregate` (`__init_subclass__`), so nested calls (a subclass calling
    `super().aggregate`, p4-secure calling its layers) screen again: idempotent.

    The sender ids are used for de-duplication whenever the caller gives them (the
    `Aggregator` always does); the rule itself gets the identities only where its class
    declares `uses_identities`, as before."""
    if getattr(rule, "screened", False):
        return rule
    aggregates = rule.__name__ == "aggregate"

    @functools.wraps(rule)
    def wrapper(
        self: Any,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> Any:
        clean = screen(updates, weights, mask, identities.get("senders"))
        given = identities if self.uses_identities else {}
        result = rule(self, clean.updates, clean.weights, clean.mask, **given)
        return clean.finish(*result) if aggregates else clean.select(result)

    wrapper.screened = True  # type: ignore[attr-defined]
    return cast(RuleT, wrapper)  # same signature as the rule: callers keep its types


__all__ = ["Screened", "finite_rows", "first_per_sender", "screen", "screened", "usable_weights"]
