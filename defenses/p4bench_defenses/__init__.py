"""Defense plugins, registered through the same hook as third-party defenses.

The P4 paper's: m-krum, krum, anomaly-detection (and p4-secure, registered by the P4
plugin), plus the `ideal` oracle. From the robustness literature: median,
trimmed-mean, geometric-median, norm-clipping, centered-clipping, foolsgold, bulyan. From
P4L: accept-if-better, a client-side gate usable with every method. Designed for gossip
(centred on the receiver's own model): clipped-gossip, cs-plus-rg, nna.

The classes are imported when the hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.engine.threats import Defense
    from p4bench_defenses.accept_if_better import AcceptIfBetter
    from p4bench_defenses.anomaly import AnomalyDetection
    from p4bench_defenses.bulyan import Bulyan
    from p4bench_defenses.clipped_gossip import ClippedGossip
    from p4bench_defenses.clipping import CenteredClipping, NormClipping
    from p4bench_defenses.cs_plus_rg import CSPlusRG
    from p4bench_defenses.foolsgold import FoolsGold
    from p4bench_defenses.geometric_median import GeometricMedian
    from p4bench_defenses.ideal import IdealDefense
    from p4bench_defenses.krum import Krum, MultiKrum
    from p4bench_defenses.median import Median
    from p4bench_defenses.nna import NearestNeighbourAveraging
    from p4bench_defenses.trimmed_mean import TrimmedMean

PACKAGE = LazyPackage(
    globals(),
    {
        "p4bench_defenses.accept_if_better": ("AcceptIfBetter",),
        "p4bench_defenses.anomaly": ("AnomalyDetection",),
        "p4bench_defenses.bulyan": ("Bulyan",),
        "p4bench_defenses.clipped_gossip": ("ClippedGossip",),
        "p4bench_defenses.clipping": ("CenteredClipping", "NormClipping"),
        "p4bench_defenses.cs_plus_rg": ("CSPlusRG",),
        "p4bench_defenses.foolsgold": ("FoolsGold",),
        "p4bench_defenses.geometric_median": ("GeometricMedian",),
        "p4bench_defenses.ideal": ("IdealDefense",),
        "p4bench_defenses.krum": ("Krum", "MultiKrum"),
        "p4bench_defenses.median": ("Median",),
        "p4bench_defenses.nna": ("NearestNeighbourAveraging",),
        "p4bench_defenses.trimmed_mean": ("TrimmedMean",),
    },
)  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_defenses() -> list[type[Defense]]:
    return PACKAGE.load()
