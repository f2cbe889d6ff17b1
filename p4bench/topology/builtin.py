"""Registers the built-in topologies (`p4bench topology` is registered by `p4bench.cli.builtin`).
They are imported when the hook is called: building the plugin manager must not import scipy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports

if TYPE_CHECKING:
    from p4bench.topology.graphs import BUILTIN_TOPOLOGIES, Topology
    from p4bench.topology.groups import GroupsGraph

__all__ = ["BUILTIN_TOPOLOGIES", "GroupsGraph", "register_topologies"]

# the names this module used to import, for code that imports them from here
__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.topology.graphs": ("BUILTIN_TOPOLOGIES",),
        "p4bench.topology.groups": ("GroupsGraph",),
    },
)


@hookimpl
def register_topologies() -> list[type[Topology]]:
    from p4bench.topology.graphs import BUILTIN_TOPOLOGIES
    from p4bench.topology.groups import GroupsGraph

    return [*BUILTIN_TOPOLOGIES, GroupsGraph]
