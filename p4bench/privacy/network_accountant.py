"""The network-DP accountant as a plugin of the accountant kind.

`NetworkAccountant` (``--accountant network``, listed by `p4bench list`) answers two
questions. For one client's history alone, with no graph, the only observer it can speak of
is a direct neighbour, who sees every release: that is local DP, computed as `pld` does.
For a gossip run, `pairwise` takes the run's declared events (`p4bench.privacy.network_events`)
and returns the pairwise loss epsilon(u -> v) of every ordered pair
(`p4bench.privacy.network_dp.pairwise_epsilon`). A run uses its own accountant's `pairwise`
where the accountant has one (an outside plugin can bring another analysis, e.g. f-DP per
pair), else this one's (`network_accountant_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from p4bench.privacy.pld import PLDAccountant

if TYPE_CHECKING:
    import numpy as np

    from p4bench.privacy.network_dp import NetworkDP
    from p4bench.privacy.network_events import NetworkEvent

__all__ = ["NetworkAccountant", "network_accountant_for"]


class NetworkAccountant(PLDAccountant):
    """Pairwise network DP of gossip runs; local DP (pld) for a single history."""

    name = "network"
    description = (
        "pairwise network DP of gossip runs (linear-Gaussian views, MFDL bound, Poisson "
        "amplification, clipped to local DP); one client's history alone: pld's local DP"
    )
    relations = ("add-remove", "replace-one")

    def pairwise(
        self,
        events: Sequence[NetworkEvent],
        num_nodes: int,
        delta: float,
        *,
        colluders: int | Sequence[int] = 1,
        local_epsilon: float | np.ndarray | None = None,
        conversion: str = "gdp",
        relation: str = "add-remove",
    ) -> NetworkDP:
        """epsilon(u -> v) at `delta` of the run the `events` describe (see
        `p4bench.privacy.network_dp.pairwise_epsilon`)."""
        from p4bench.privacy.network_dp import pairwise_epsilon

        return pairwise_epsilon(
            events, num_nodes, delta, colluders=colluders, local_epsilon=local_epsilon,
            conversion=conversion, relation=relation,
        )  # fmt: skip


def network_accountant_for(accountant: Any) -> Any:
    """`accountant` if it analyses networks (has `pairwise`), else the built-in one."""
    return accountant if callable(getattr(accountant, "pairwise", None)) else NetworkAccountant()
