"""Dynamic groups produced by a method (P4's phase 1) as a topology.

P4 writes its groups to `groups.json` among a run's results; this topology reads that
file so that any other method can communicate over the same groups (a complete graph
inside each group, no edges across groups).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from p4bench.errors import ConfigError
from p4bench.options import Option
from p4bench.topology.graphs import Topology


class GroupsGraph(Topology):
    """Clients connected to every member of their group, from a groups.json file."""

    name = "groups"
    description = (
        "dynamic groups produced by a method (P4's groups.json): complete graph inside each group; "
        "option path"
    )
    options = (Option("path", str, None, "groups.json written by a P4 run (required)"),)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        path = self.option_values["path"]
        if not path:
            raise ConfigError(
                "options.path", "the groups topology needs the option 'path' (a P4 groups.json)"
            )
        try:
            self.groups = [list(map(int, g)) for g in json.loads(open(path).read())["groups"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError("options.path", f"cannot read groups from {path}: {exc}") from None

    def edges(self, num_clients: int, round_index: int, rng: np.random.Generator) -> np.ndarray:
        members = sorted(c for g in self.groups for c in g)
        if members != list(range(num_clients)):
            raise ConfigError(
                "options.path",
                f"the groups cover clients {members[:5]}..., not exactly 0..{num_clients - 1}",
            )
        adjacency = np.zeros((num_clients, num_clients), dtype=bool)
        for group in self.groups:
            adjacency[np.ix_(group, group)] = True
        np.fill_diagonal(adjacency, False)
        return adjacency
