"""A plugin package as an outside author wrote it against p4bench 0.1, kept unchanged.

It imports from internal modules (there was no `p4bench.api` then), declares the
topology options by hand, and calls `get_topology(name, options)` without `registry=`,
which p4bench 0.2 deprecates. p4bench must run it (with one deprecation line) and
`p4bench check-plugin p4bench-oldstyle` must name the deprecated call.

The method is FedAvg that also draws its graph from the run's topology and reports the
graph's mean out-degree.
"""

import numpy as np

from p4bench import hookimpl
from p4bench.options import Option, resolve_options
from p4bench.topology import get_topology
from p4bench_baselines.fedavg import FedAvg


class NeighbourhoodFedAvg(FedAvg):
    name = "oldstyle-fedavg"
    description = "FedAvg that reports its topology's mean degree (a p4bench 0.1 plugin)"
    options = FedAvg.options + (
        Option("topology", str, "ring", "communication graph (a topology plugin)"),
        Option("topology_options", dict, None, "the topology's own options"),
    )

    def validate_options(self):
        super().validate_options()
        values = resolve_options(self.options, self.config.options)
        graph = get_topology(
            values["topology"], values["topology_options"]
        )  # the 0.1 call: no registry=
        edges = np.asarray(
            graph.edges(self.num_clients, 0, np.random.default_rng(self.config.seed))
        )
        self.mean_degree = float(edges.sum(axis=1).mean())

    def derived_metrics(self, metrics):
        return {**super().derived_metrics(metrics), "graph_out_degree_mean": self.mean_degree}


@hookimpl
def register_methods():
    return [NeighbourhoodFedAvg]
