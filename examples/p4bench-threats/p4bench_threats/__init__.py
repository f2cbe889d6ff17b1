"""Example plugins of the three other kinds an outside author writes most: an attack, a
defense and a dataset, each registered by its own hook and importing only `p4bench.api`.

- `boosted-update` (attack): malicious clients send their honest update scaled by
  `boost` (Bhagoji et al., 2019, "explicit boosting").
- `median-norm-clip` (defense): every received update is scaled down to the median norm
  of the updates its receiver got, then averaged with the senders' weights.
- `blobs` (dataset): ten Gaussian classes in 16 dimensions, drawn from a fixed seed, so
  it needs no files and no network.
"""

from p4bench.api import hookimpl
from p4bench_threats.attack import BoostedUpdate
from p4bench_threats.dataset import Blobs
from p4bench_threats.defense import MedianNormClip

__version__ = "0.1.0"


@hookimpl
def register_attacks():
    return [BoostedUpdate]


@hookimpl
def register_defenses():
    return [MedianNormClip]


@hookimpl
def register_datasets():
    return [Blobs]


__all__ = ["Blobs", "BoostedUpdate", "MedianNormClip"]
