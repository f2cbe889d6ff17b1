"""The plugin API: the one module a plugin package imports from.

    from p4bench.api import Method, Capabilities, LocalUpdate, Exchange, Option, hookimpl

**Stability.** Every name in `__all__` is public and follows `API_VERSION`: within one
major API version a name keeps its meaning and its call signature accepts what it
accepted before. A name that is to change first keeps working for at least one minor
release of p4bench, with a `PluginDeprecationWarning` naming the replacement (the command
line shows it as one line); the CHANGELOG lists every change. Anything imported from
elsewhere in `p4bench` (`p4bench.engine.*`, `p4bench.host.manager`, names starting
with `_`) is internal and may change in any release.

The distribution follows semantic versioning: `p4bench 0.x` may deprecate, never break
without the cycle above; `API_VERSION` "1.2" is the API of p4bench 0.2 (1.1 and 1.2 added names, none changed).

Names are imported on first use (as the rest of p4bench does), so importing this module
costs nothing until a plugin uses what it imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import lazy_exports
from p4bench.version import __version__

if TYPE_CHECKING:  # imported on first use (`p4bench.lazy`)
    from p4bench.config import RunConfig
    from p4bench.data.base import ArrayDataset, Dataset, Partitioner
    from p4bench.data.federated import ClientTensors
    from p4bench.engine.messages import BROADCAST, UPDATE_PREFIX, MessageFormatError, Messages
    from p4bench.engine.method import (
        DEFAULT_EPSILON,
        Capabilities,
        Exchange,
        LocalUpdate,
        Method,
        Phase,
        PlannedRelease,
        StepContext,
    )
    from p4bench.engine.method_kit import draw_batch, replicate
    from p4bench.engine.state import flatten, unflatten, unvectorize, vectorize
    from p4bench.engine.threats import (
        Aggregator,
        Attack,
        Defense,
        update_vectors,
        with_update_vectors,
    )
    from p4bench.engine.training import (
        TrainingContext,
        batch_gradient,
        fixed_size_batches,
        gather_batch,
        local_sgd,
        poisson_batches,
        sample_batches,
    )
    from p4bench.errors import ConfigError, DataError, PluginDeprecationWarning, UsageError
    from p4bench.host.manager import default_registry
    from p4bench.models import Model
    from p4bench.options import Option, resolve_options, topology_options
    from p4bench.privacy.accountants import Accountant, ReleaseSegment
    from p4bench.privacy.mechanism import DPMechanism
    from p4bench.privacy.network_events import Gossip, NetworkEvent, Release
    from p4bench.rng import ClientRng
    from p4bench.studies.claims import (
        Cell,
        ClaimCheck,
        ClaimContext,
        cell,
        from_cells,
        joined,
        means,
        not_checked,
        not_tested_on,
        pct,
        per_seed,
        verdict,
    )
    from p4bench.studies.presets import NON_PRIVATE, Preset, alpha_variant, shard_variant
    from p4bench.testing import ConformanceReport, check_attack, check_defense, check_method
    from p4bench.topology import get_topology
    from p4bench.topology.graphs import Topology
    from p4bench_baselines.fedavg import FedAvg

API_VERSION = "1.2"

__all__ = [
    "API_VERSION",
    "__version__",
    "hookimpl",
    # methods: the round's steps, what they send, their privacy plan
    "Method",
    "Capabilities",
    "Phase",
    "LocalUpdate",
    "Exchange",
    "StepContext",
    "TrainingContext",
    "PlannedRelease",
    "DEFAULT_EPSILON",
    "Messages",
    "MessageFormatError",
    "UPDATE_PREFIX",
    "BROADCAST",
    "local_sgd",
    # batches and gradients of a local step (DP through ctx.dp where the run is private)
    "ClientTensors",
    "ClientRng",
    "sample_batches",
    "fixed_size_batches",
    "poisson_batches",
    "gather_batch",
    "draw_batch",
    "batch_gradient",
    "replicate",
    # a base to extend: FedAvg's round, with your own local update (examples/p4bench-fedprox)
    "FedAvg",
    "flatten",
    "unflatten",
    "vectorize",
    "unvectorize",
    # options, shared by every plugin of a run (one namespace: `-o key=value`)
    "Option",
    "resolve_options",
    "topology_options",
    "RunConfig",
    # threats: attacks replace `update.*` payloads, defenses filter them in the aggregator
    "Attack",
    "Defense",
    "Aggregator",
    "update_vectors",
    "with_update_vectors",
    # data, models, graphs, privacy
    "Dataset",
    "ArrayDataset",
    "Partitioner",
    "Model",
    "Topology",
    "get_topology",
    "default_registry",
    "Accountant",
    "ReleaseSegment",
    "DPMechanism",
    # ... and what a gossip method declares for network DP (API 1.2, `Method.network_events`)
    "Release",
    "Gossip",
    "NetworkEvent",
    # paper reproductions (`register_presets`): the record, claim checks and their helpers
    "Preset",
    "NON_PRIVATE",
    "alpha_variant",
    "shard_variant",
    "ClaimCheck",
    "ClaimContext",
    "means",
    "not_checked",
    "pct",
    "verdict",
    # ... and verdicts with intervals (API 1.1): paired differences over seeds, yes / no / inconclusive
    "Cell",
    "cell",
    "from_cells",
    "joined",
    "not_tested_on",
    "per_seed",
    # errors and warnings
    "ConfigError",
    "DataError",
    "UsageError",
    "PluginDeprecationWarning",
    # the conformance kit
    "check_method",
    "check_attack",
    "check_defense",
    "ConformanceReport",
]

__getattr__ = lazy_exports(
    globals(),
    {
        "p4bench.studies.claims": (
            "Cell",
            "ClaimCheck",
            "ClaimContext",
            "cell",
            "from_cells",
            "joined",
            "means",
            "not_checked",
            "not_tested_on",
            "pct",
            "per_seed",
            "verdict",
        ),
        "p4bench.config": ("RunConfig",),
        "p4bench.data.base": ("ArrayDataset", "Dataset", "Partitioner"),
        "p4bench.data.federated": ("ClientTensors",),
        "p4bench.engine.messages": ("BROADCAST", "UPDATE_PREFIX", "MessageFormatError", "Messages"),
        "p4bench.engine.method": (
            "DEFAULT_EPSILON",
            "Capabilities",
            "Exchange",
            "LocalUpdate",
            "Method",
            "Phase",
            "PlannedRelease",
            "StepContext",
        ),
        "p4bench.engine.method_kit": ("draw_batch", "replicate"),
        "p4bench.engine.state": ("flatten", "unflatten", "unvectorize", "vectorize"),
        "p4bench.engine.threats": (
            "Aggregator",
            "Attack",
            "Defense",
            "update_vectors",
            "with_update_vectors",
        ),
        "p4bench.engine.training": (
            "TrainingContext",
            "batch_gradient",
            "fixed_size_batches",
            "gather_batch",
            "local_sgd",
            "poisson_batches",
            "sample_batches",
        ),
        "p4bench.errors": ("ConfigError", "DataError", "PluginDeprecationWarning", "UsageError"),
        "p4bench.models": ("Model",),
        "p4bench.options": ("Option", "resolve_options", "topology_options"),
        "p4bench.host.manager": ("default_registry",),
        "p4bench.studies.presets": ("NON_PRIVATE", "Preset", "alpha_variant", "shard_variant"),
        "p4bench.privacy.accountants": ("Accountant", "ReleaseSegment"),
        "p4bench.privacy.mechanism": ("DPMechanism",),
        "p4bench.privacy.network_events": ("Gossip", "NetworkEvent", "Release"),
        "p4bench.rng": ("ClientRng",),
        "p4bench.testing": ("ConformanceReport", "check_attack", "check_defense", "check_method"),
        "p4bench.topology": ("get_topology",),
        "p4bench.topology.graphs": ("Topology",),
        "p4bench_baselines.fedavg": ("FedAvg",),
    },
)
