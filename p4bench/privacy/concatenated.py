"""The noise of one release that concatenates k gradients computed on the same batch
(PDSL's and DP-CGA's cross-gradients, `p4bench_baselines.cross_gradients`): one Gaussian
release with the run's multiplier sigma, never k independent ones.

- `per-example` clipping: each record's gradient is clipped to C for each of the k
  models, so the concatenation has L2 sensitivity sqrt(k) C per record: noise std
  sqrt(k) sigma C (2 sigma C under replace-one: the mechanism's `noise_std`) on every
  coordinate; the release is subsampled at the run's rate q.
- `batch` clipping (PDSL's paper): each batch-mean gradient is clipped to C, so each has
  sensitivity 2C under both relations and the concatenation 2C sqrt(k): noise std
  2 C sigma sqrt(k) per coordinate; accounted at rate 1 (a record in the batch moves
  every clipped mean: no amplification is claimed).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CLIP_MODES", "noise_scale", "noise_std_per_coordinate", "release_rate"]

CLIP_MODES = ("batch", "per-example")


def release_rate(clip_mode: str, data_rate: float) -> float:
    """The sampling rate a round's release is accounted at (planned and recorded)."""
    return data_rate if clip_mode == "per-example" else 1.0


def noise_scale(settings: Any, clip_mode: str, degree: torch.Tensor) -> torch.Tensor:
    """(C,) the multiple of the mechanism's noise std (`settings.noise_std`) each row's
    coordinates get, for rows concatenating `degree` gradients."""
    if clip_mode == "per-example":
        return degree.sqrt()  # std sqrt(k) * noise_std on the clipped sums
    factor = (
        2.0
        * float(settings.clip)
        * float(settings.noise_multiplier)
        / max(float(settings.noise_std), 1e-300)
    )
    return degree.sqrt() * factor  # std 2 C sigma sqrt(k) on the clipped means


def noise_std_per_coordinate(settings: Any, clip_mode: str, degree: int) -> float:
    """The std of the noise on one coordinate (reported as PDSL's sigma): per-example mode
    on the clipped sum, batch mode on the clipped mean."""
    if clip_mode == "per-example":
        return math.sqrt(degree) * float(settings.noise_std)
    return math.sqrt(degree) * 2.0 * float(settings.clip) * float(settings.noise_multiplier)
