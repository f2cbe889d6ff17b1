"""Defense plugins, registered through the same hook as third-party defenses.

The P4 paper's: m-krum, krum, anomaly-detection (and p4-secure, registered by the P4
plugin), plus the `ideal` oracle. From the robustness literature: median,
trimmed-mean, geometric-median, norm-clipping, centered-clipping, foolsgold, bulyan. From
P4L: accept-if-better, a client-side gate usable with every method.

The classes are imported when the hook is called, or on first use of a name below
(`p4bench.lazy`): building the plugin manager must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p4bench.hookspecs import hookimpl
from p4bench.lazy import LazyPackage

if TYPE_CHECKING:
    from p4bench.defenses.accept_if_better import AcceptIfBetter
    from p4bench.defenses.anomaly import AnomalyDetection
    from p4bench.defenses.bulyan import Bulyan
    from p4bench.defenses.clipping import CenteredClipping, NormClipping
    from p4bench.defenses.foolsgold import FoolsGold
    from p4bench.defenses.geometric_median import GeometricMedian
    from p4bench.defenses.ideal import IdealDefense
    from p4bench.defenses.krum import Krum, MultiKrum
    from p4bench.defenses.median import Median
    from p4bench.defenses.trimmed_mean import TrimmedMean
    from p4bench.engine.threats import Defense

PACKAGE = LazyPackage(globals(), {
    "p4bench.defenses.accept_if_better": ("AcceptIfBetter",),
    "p4bench.defenses.anomaly": ("AnomalyDetection",),
    "p4bench.defenses.bulyan": ("Bulyan",),
    "p4bench.defenses.clipping": ("CenteredClipping", "NormClipping"),
    "p4bench.defenses.foolsgold": ("FoolsGold",),
    "p4bench.defenses.geometric_median": ("GeometricMedian",),
    "p4bench.defenses.ideal": ("IdealDefense",),
    "p4bench.defenses.krum": ("Krum", "MultiKrum"),
    "p4bench.defenses.median": ("Median",),
    "p4bench.defenses.trimmed_mean": ("TrimmedMean",),
})  # the one list of this package's classes
__all__ = PACKAGE.names
__getattr__ = PACKAGE.getattr


@hookimpl
def register_defenses() -> list[type[Defense]]:
    return PACKAGE.load()
