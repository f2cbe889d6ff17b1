"""Communication topologies between clients and their mixing matrices.

Topologies are plugins of kind ``topology`` (see :mod:`p4bench.topology.graphs`);
:func:`get_topology` builds one by name from the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.topology.graphs": (
            "BUILTIN_TOPOLOGIES",
            "CompleteGraph",
            "EdgeListGraph",
            "ErdosRenyiGraph",
            "ExponentialGraph",
            "RandomRegularGraph",
            "RingGraph",
            "Topology",
            "TorusGraph",
            "degree_stats",
            "exponential_shift",
            "is_connected",
            "is_symmetric",
            "read_edge_list",
            "torus_shape",
        ),
        "p4bench.topology.mixing": (
            "is_doubly_stochastic",
            "is_row_stochastic",
            "metropolis_hastings",
            "spectral_gap",
            "uniform_averaging",
        ),
    },
)


_default_registry: Callable[[], Any] | None = (
    None  # set by p4bench.host.manager (it sits above this package)
)


def get_topology(
    name: str, options: Mapping[str, Any] | None = None, *, registry: Any = None
) -> Topology:
    """The topology `name` registered in `registry` (a `p4bench.host.manager.Registry`,
    e.g. `p4bench.api.default_registry()`), built with `options`.

    Without `registry` (the call of p4bench 0.1) the process-wide registry is used, with a
    `PluginDeprecationWarning`: `registry` becomes required in 0.3.

    Raises :class:`p4bench.errors.UnknownNameError` (listing the registered names) for
    an unknown name.
    """
    if registry is None:
        from p4bench.errors import deprecated

        deprecated(
            "get_topology(name, options) without registry=",
            "pass registry=p4bench.api.default_registry()",
            removed_in="0.3",
        )
        if (
            _default_registry is None
        ):  # no plugin host imported: no run, no registry to fall back on
            raise TypeError("get_topology() needs registry= where no p4bench plugin manager exists")
        registry = _default_registry()
    topology: Topology = registry.get("topology", name)(options)
    return topology
