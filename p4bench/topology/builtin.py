"""Registers the built-in topologies (`p4bench topology` is registered by `p4bench.cli.builtin`)."""

from p4bench.hookspecs import hookimpl
from p4bench.topology.graphs import BUILTIN_TOPOLOGIES
from p4bench.topology.groups import GroupsGraph


@hookimpl
def register_topologies():
    return [*BUILTIN_TOPOLOGIES, GroupsGraph]
