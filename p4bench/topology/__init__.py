"""Communication topologies between clients and their mixing matrices.

Topologies are plugins of kind ``topology`` (see :mod:`p4bench.topology.graphs`);
:func:`get_topology` builds one by name from the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from p4bench.lazy import lazy_exports

if TYPE_CHECKING:  # imported on first use (`p4bench.lazy`): the command line starts without scipy
    from p4bench.topology.graphs import (
        BUILTIN_TOPOLOGIES,
        CompleteGraph,
        EdgeListGraph,
        ErdosRenyiGraph,
        ExponentialGraph,
        RandomRegularGraph,
        RingGraph,
        Topology,
        TorusGraph,
        degree_stats,
        exponential_shift,
        is_connected,
        is_symmetric,
        read_edge_list,
        torus_shape,
    )
    from p4bench.topology.mixing import (
        is_doubly_stochastic,
        is_row_stochastic,
        metropolis_hastings,
        spectral_gap,
        uniform_averaging,
    )

__all__ = [
    "Topology",
    "CompleteGraph",
    "RingGraph",
    "TorusGraph",
    "RandomRegularGraph",
    "ErdosRenyiGraph",
    "ExponentialGraph",
    "EdgeListGraph",
    "BUILTIN_TOPOLOGIES",
    "get_topology",
    "degree_stats",
    "exponential_shift",
    "is_connected",
    "is_symmetric",
    "read_edge_list",
    "torus_shape",
    "metropolis_hastings",
    "uniform_averaging",
    "spectral_gap",
    "is_doubly_stochastic",
    "is_row_stochastic",
]


__getattr__ = lazy_exports(globals(), {
    "p4bench.topology.graphs": (
        "BUILTIN_TOPOLOGIES", "CompleteGraph", "EdgeListGraph", "ErdosRenyiGraph", "ExponentialGraph", "RandomRegularGraph",
        "RingGraph", "Topology", "TorusGraph", "degree_stats", "exponential_shift", "is_connected", "is_symmetric",
        "read_edge_list", "torus_shape",
    ),
    "p4bench.topology.mixing": (
        "is_doubly_stochastic", "is_row_stochastic", "metropolis_hastings", "spectral_gap", "uniform_averaging",
    ),
})


def get_topology(name: str, options: Mapping[str, Any] | None = None, *, registry: Any) -> Topology:
    """The topology `name` registered in `registry` (a `p4bench.plugin_manager.Registry`,
    e.g. `default_registry()`; passed in, as this package sits below the plugin host),
    built with `options`.

    Raises :class:`p4bench.errors.UnknownNameError` (listing the registered names) for
    an unknown name.
    """
    return registry.get("topology", name)(options)
