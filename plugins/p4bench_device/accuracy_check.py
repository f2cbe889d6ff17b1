"""What the launcher can say about the peers' self-reported accuracies (`accuracy_check`).

On the device runtime each peer reports the test accuracy of its own client; the launcher
cannot recompute it (it holds neither the peer's model during the run nor a reason to
trust the state it sends for it), so a compromised peer can report 1.0 and lift the
published mean (0.8946 -> 0.9280 with one peer of a digits run). The headline mean stays
the runner's (the mean over the reported clients, as in the simulator); beside it the
launcher publishes figures one peer cannot move far, and names the peers whose figure
stands out:

- ``median``: the median of the peers' accuracies;
- ``outliers``: a peer whose accuracy lies further than ``max(OUTLIER_FLOOR, OUTLIER_MADS
  * 1.4826 * MAD)`` from the median of the *other* peers' accuracies (MAD: their median
  absolute deviation; leave-one-out, so the outlier does not widen its own band). Only
  with at least `MIN_OTHERS` other peers: fewer give no band to compare with. A flag is
  not a verdict: an honest peer with a very different test split can stand out too;
- ``mean_without_outliers``: the mean over the other peers.

The clients the harness made malicious are left out, as they are from the headline mean.
Published in the device summary (``device.accuracy_check``) and each round's metrics
(``device.accuracy_median``, ``device.accuracy_mean_without_outliers``,
``device.accuracy_outliers``, ``device.<peer>.accuracy_outlier``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median
from typing import Any

import numpy as np

__all__ = ["MIN_OTHERS", "OUTLIER_FLOOR", "OUTLIER_MADS", "accuracy_check", "accuracy_metrics"]

OUTLIER_FLOOR = 0.05  # accuracy points: honest clients of one run differ by a few
OUTLIER_MADS = 3.0  # ... or this many (normal-consistent) median absolute deviations of the others
MIN_OTHERS = 3
_MAD_TO_SIGMA = 1.4826


def _band(others: Sequence[float]) -> tuple[float, float]:
    """(centre, half width) of the band the others' accuracies give."""
    centre = median(others)
    mad = median(abs(x - centre) for x in others)
    return centre, max(OUTLIER_FLOOR, OUTLIER_MADS * _MAD_TO_SIGMA * mad)


def accuracy_check(
    accuracy: np.ndarray, nodes: dict[str, int], malicious: Sequence[bool] | None = None
) -> dict[str, Any]:
    """The robust figures of the module docstring over `accuracy` (per client node) of the
    peers `nodes` (peer -> node; the server's, node < 0, has none), leaving out the nodes
    flagged in `malicious`."""
    values = {
        peer: float(accuracy[node])
        for peer, node in sorted(nodes.items())
        if 0 <= node < len(accuracy)
        and math.isfinite(float(accuracy[node]))
        and not (malicious is not None and node < len(malicious) and malicious[node])
    }
    if not values:
        return {"peers": 0}
    outliers = []
    for peer, value in values.items():
        others = [v for p, v in values.items() if p != peer]
        if len(others) < MIN_OTHERS:
            continue
        centre, width = _band(others)
        if abs(value - centre) > width:
            outliers.append(
                {
                    "peer": peer,
                    "node": nodes[peer],
                    "accuracy": value,
                    "others_median": centre,
                    "band": width,
                    "message": f"peer {peer} reports accuracy {value:.4f}, the others' median is {centre:.4f} "
                    f"(band +/- {width:.4f}): self-reported, not verified",
                }
            )
    named = {o["peer"] for o in outliers}
    kept = [v for p, v in values.items() if p not in named]
    return {
        "peers": len(values),
        "mean": float(np.mean(list(values.values()))),
        "median": float(median(values.values())),
        "mean_without_outliers": float(np.mean(kept)) if kept else float("nan"),
        "outliers": outliers,
        "rule": f"further than max({OUTLIER_FLOOR}, {OUTLIER_MADS} x 1.4826 x MAD) from the other peers' median, "
        f"with at least {MIN_OTHERS} other peers",
    }


def accuracy_metrics(check: dict[str, Any]) -> dict[str, float]:
    """A round's metrics from `accuracy_check`'s figures."""
    if not check.get("peers"):
        return {}
    return {
        "device.accuracy_median": check["median"],
        "device.accuracy_mean_without_outliers": check["mean_without_outliers"],
        "device.accuracy_outliers": float(len(check["outliers"])),
        **{f"device.{o['peer']}.accuracy_outlier": o["accuracy"] for o in check["outliers"]},
    }
