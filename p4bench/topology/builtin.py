"""Registers the built-in topologies (`p4bench topology` is registered by `p4bench.cli.builtin`).
They are imported when the hook is called: building the plugin manager must not import scipy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl

if TYPE_CHECKING:
    from p4bench.topology.graphs import Topology


@hookimpl
def register_topologies() -> list[type[Topology]]:
    from p4bench.topology.graphs import BUILTIN_TOPOLOGIES
    from p4bench.topology.groups import GroupsGraph

    return [*BUILTIN_TOPOLOGIES, GroupsGraph]
