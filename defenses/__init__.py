"""Defense plugins, registered through the same hook as third-party defenses.

The P4 paper's: m-krum, krum, anomaly-detection (and p4-secure, registered by the P4
plugin), plus the `ideal` oracle. From the robustness literature: median,
trimmed-mean, geometric-median, norm-clipping, centered-clipping, foolsgold, bulyan. From
P4L: accept-if-better, a client-side gate usable with every method.
"""

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
from p4bench.hookspecs import hookimpl


@hookimpl
def register_defenses():
    return [
        MultiKrum, Krum, AnomalyDetection, Median, TrimmedMean, GeometricMedian,
        NormClipping, CenteredClipping, FoolsGold, Bulyan, IdealDefense, AcceptIfBetter,
    ]
