"""What PDSL's cross-gradient at a crafted model (attack `model-probe`) reveals, with and without DP.

At the zero model of `LinearSoftmax` the gradient of the batch-mean cross-entropy over a
victim's batch of b records is (attack docstring), for each class c,

    g_bias[c] = 1/L - n_c / b,        g_w[c] = xbar / L - S_c / b,

n_c the batch's count of class c, S_c the sum of its inputs and xbar the batch mean.
Recoverable: the label fractions n_c / b = 1/L - g_bias[c] exactly, and the *centered*
class sums S_c / b - xbar / L = -g_w[c]. xbar itself is not: sum_c g_w[c] = xbar - xbar = 0
whatever it is. `reconstruct_class_means` estimates it from a prior, by default the
non-negativity of the inputs (digits pixels lie in [0, 1]): S_c >= 0 gives xbar / L >=
g_w[c] for every c, tight at every pixel that some class's records leave at zero (and
exact wherever a class is absent), so xbar_hat = L max_c g_w[c]; then the class means are
mu_c = (xbar_hat / L - g_w[c]) / (n_c / b).

Under DP, `cross_gradients` (batch mode, the paper's) first scales the gradient by
s = min(1, C / ||g||), then adds N(0, (2 C sigma sqrt(k))^2) per coordinate (k = |M_i|).
s is undone from the integrality of the counts when the batch size is known (the n_c
are integers); the noise is what protects the batch. `inversion_experiment` measures it
on real digits: the cosine of the reconstructed to the true centered class sums (scale
free), of the reconstructed to the true class means, and the label-count error, per sigma.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

__all__ = [
    "DEFAULT_DELTA",
    "InversionResult",
    "InversionRow",
    "inversion_experiment",
    "pdsl_noise_multiplier",
    "probe_gradient",
    "reconstruct_class_means",
    "unclip_factor",
]

DEFAULT_DELTA = 1.0 / 1126
"""The delta `p4bench run --method pdsl --epsilon E` reports on digits (1 / the 1,126 records its agents train on)."""


def unclip_factor(bias_gradient: torch.Tensor, batch_size: int, tolerance: float = 0.05) -> float:
    """t >= 1 undoing batch clipping (g_seen = g / t): the t that makes every count
    n_c = b/L - b t g_bias[c] an integer, searched over the b + 1 values the largest
    |g_bias[c]| allows; 1.0 when no t fits within `tolerance` per class (noise)."""
    g = bias_gradient.double()
    b, classes = float(batch_size), len(g)
    top = int(g.abs().argmax())
    if float(g[top].abs()) < 1e-12:
        return 1.0
    best, best_error = 1.0, float("inf")
    for m in range(batch_size + 1):  # n_top = m
        t = (b / classes - m) / (b * float(g[top]))
        if t < 1.0 - 1e-6:
            continue
        counts = b / classes - b * t * g
        error = float((counts - counts.round()).abs().max() + (-counts).clamp_min(0).max())
        if error < best_error - 1e-9:
            best, best_error = t, error
    return best if best_error <= tolerance else 1.0


def reconstruct_class_means(
    gradient: torch.Tensor,
    num_classes: int,
    feature_dim: int,
    *,
    batch_size: int | None = None,
    prior_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(means (L, d), counts (L,)) from the probe's gradient (P,) = [bias (L), weight (L*d)].

    Counts are n_c / b, or records n_c when `batch_size` is given (then batch clipping
    is undone first, `unclip_factor`). `prior_mean` (d,) is the batch-mean estimate
    (e.g. the public data's mean); default the non-negativity bound L max_c g_w[c]
    (module docstring). Classes estimated absent (n_c / b <= 1/(2b), or <= 0) get zero
    means."""
    g = gradient.double().flatten()
    bias, weight = g[:num_classes], g[num_classes:].view(num_classes, feature_dim)
    scale = unclip_factor(bias, batch_size) if batch_size else 1.0
    fractions = 1.0 / num_classes - scale * bias
    centered = -scale * weight  # S_c / b - xbar / L
    xbar = (
        num_classes * (-centered).max(0).values.clamp_min(0)
        if prior_mean is None
        else prior_mean.double().flatten()
    )
    floor = 0.5 / batch_size if batch_size else 0.0
    present = (fractions > floor).unsqueeze(1)
    means = torch.where(
        present, (xbar / num_classes + centered) / fractions.clamp_min(1e-12).unsqueeze(1), 0.0
    )
    return means, fractions * batch_size if batch_size else fractions


def probe_gradient(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    *,
    noise_multiplier: float | None,
    clip: float = 1.0,
    degree: int = 20,
    seed: int = 0,
) -> torch.Tensor:
    """(P,) the cross-gradient a victim with batch (x (b, ...), y (b,)) returns for the
    zero model, computed by `cross_gradients` itself (batch mode) with a real
    `DPMechanism` (sigma, clip, add-remove; ledger discarded) and k = `degree` models in
    its release, the probe in each slot; `noise_multiplier` None: without DP (plain mean)."""
    from p4bench.data.federated import ClientTensors
    from p4bench.engine.training import batched_loss_and_grad
    from p4bench.models import LinearSoftmax
    from p4bench.privacy.mechanism import DPMechanism, DPSettings, NoiseStreams
    from p4bench.rng import client_rng
    from p4bench_baselines.cross_gradients import cross_gradients

    model = LinearSoftmax(tuple(x.shape[1:]), num_classes)
    like = {
        k: torch.zeros(1, *v.shape) for k, v in model.init(torch.Generator().manual_seed(0)).items()
    }
    size = sum(v[0].numel() for v in like.values())
    dp = (
        None
        if noise_multiplier is None
        else DPMechanism(
            DPSettings(clip, float(noise_multiplier)),
            NoiseStreams(seed, [0]),
            lambda release: None,
            lambda rows, rate, phase: torch.ones(len(rows), dtype=torch.bool),
        )
    )
    ctx = SimpleNamespace(
        dp=dp,
        rng=client_rng(seed, [0], 0, False),
        config=SimpleNamespace(data_rate=1.0),
        loss_and_grad=partial(batched_loss_and_grad, model),
        model=model,
        rows=torch.arange(1),
        phase="train",
    )
    train = ClientTensors(x.float().unsqueeze(0), y.long().unsqueeze(0), torch.tensor([len(y)]))
    present = torch.ones(1, degree, dtype=torch.bool)
    grads, _, _ = cross_gradients(ctx, torch.zeros(1, degree, size), like, present, train, "batch")
    return grads[0, 0]


def pdsl_noise_multiplier(epsilon: float, rounds: int = 30, delta: float = DEFAULT_DELTA) -> float:
    """PDSL's sigma for a target epsilon, as its runs calibrate it (batch clipping: one
    release per round at rate 1, T rounds, PLD accountant, add-remove)."""
    from p4bench.privacy import PLDAccountant
    from p4bench.privacy.accountants import ReleaseSegment, accounted_epsilon
    from p4bench.privacy.calibration import calibrate_noise

    accountant = PLDAccountant()

    def epsilon_at(sigma: float) -> float:
        return accounted_epsilon(
            accountant, [ReleaseSegment(sigma, 1.0, rounds)], delta, "add-remove"
        )

    return calibrate_noise(epsilon_at, epsilon, tolerance=min(0.01, 0.01 * epsilon))


@dataclass
class InversionRow:
    """One noise level, averaged over the trials (victim batches)."""

    noise_multiplier: float  # 0: no DP (no clipping, no noise)
    epsilon: float | None  # the target it was calibrated for, if any
    noise_std: float  # per coordinate, 2 C sigma sqrt(k)
    cosine_centered: float  # reconstructed vs true S_c/b - xbar/L, mean over present classes
    cosine_means: (
        float  # reconstructed vs true class means (compare with InversionResult.prior_cosine_means)
    )
    count_error: float  # max_c |n_hat_c - n_c| in records, mean over trials
    counts_exact: float  # fraction of trials whose rounded counts are all exact


@dataclass
class InversionResult:
    """The experiment's settings and one row per noise level; `as_dict` is JSON-ready."""

    batch_size: int
    clip: float
    degree: int
    rounds: int
    delta: float
    trials: int
    seed: int
    # the true class means vs the data set's mean image: what cosine_means scores with no gradient at all
    # (reconstructed means are non-negative by construction, so even pure noise scores above 0 there)
    prior_cosine_means: float = 0.0
    rows: list[InversionRow] = field(default_factory=list)
    plot: Path | None = None

    def lines(self) -> list[str]:
        """One line per noise level, then the prior's cosine."""
        return [
            *(
                f"sigma {r.noise_multiplier:.4g}"
                + (f" (eps {r.epsilon:g})" if r.epsilon is not None else "")
                + f": cosine centered {r.cosine_centered:.3f}, means {r.cosine_means:.3f}, "
                f"count error {r.count_error:.2f}, counts exact {r.counts_exact:.0%}"
                for r in self.rows
            ),
            f"(no gradient, the data set's mean image as every class mean: cosine means {self.prior_cosine_means:.3f})",
        ]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["plot"] = str(self.plot) if self.plot else None
        return out


def _cosines(estimate: torch.Tensor, truth: torch.Tensor, present: torch.Tensor) -> float:
    cos = torch.nn.functional.cosine_similarity(estimate[present], truth[present], dim=1, eps=1e-12)
    return float(cos.mean())


def inversion_experiment(
    noise_multipliers: Sequence[float] = (0.0, 1e-3, 1e-2),
    *,
    epsilons: Sequence[float] = (8.0, 1.0),
    rounds: int = 30,
    delta: float = DEFAULT_DELTA,
    clip: float = 1.0,
    batch_size: int = 11,
    degree: int = 20,
    trials: int = 5,
    seed: int = 0,
    plot: str | Path | None = None,
) -> InversionResult:
    """Probe victims' digits batches at each noise level (`noise_multipliers`, 0 = no DP,
    then PDSL's calibrated sigma for each of `epsilons` at `rounds`, `delta`) and score
    the reconstruction. Defaults: PDSL's digits run (20 agents on the complete graph, so
    k = 20; batch round(0.2 * 56) = 11). `plot`: a PNG of true vs reconstructed means."""
    from p4bench.data.digits import DigitsDataset

    if trials < 1 or batch_size < 1:
        raise ValueError(f"need trials >= 1 and batch_size >= 1, got {trials} and {batch_size}")
    data = DigitsDataset().load(Path("."))  # the suite's scaling: pixels / 16, (N, 1, 8, 8)
    x_all, y_all = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    classes = len(data.class_names)
    batches, prior = [], []
    population = x_all.flatten(1).double().mean(0)
    for trial in range(trials):  # one victim batch per trial, the same at every noise level
        pick = torch.from_numpy(
            np.random.default_rng([seed, trial]).choice(len(y_all), batch_size, replace=False)
        )
        x, y = x_all[pick], y_all[pick]
        flat = x.flatten(1).double()
        counts = torch.bincount(y, minlength=classes).double()
        sums = torch.zeros(classes, flat.shape[1], dtype=torch.float64).index_add_(0, y, flat)
        true_means = sums / counts.clamp_min(1).unsqueeze(1)
        batches.append((x, y, counts, sums / batch_size - flat.mean(0) / classes, true_means))
        prior.append(_cosines(population.expand_as(true_means), true_means, counts > 0))
    levels: list[tuple[float, float | None]] = [(float(s), None) for s in noise_multipliers]
    levels += [(pdsl_noise_multiplier(e, rounds, delta), float(e)) for e in epsilons]
    result = InversionResult(
        batch_size, clip, degree, rounds, delta, trials, seed, float(np.mean(prior))
    )
    pictures: list[tuple[str, torch.Tensor]] = []
    for sigma, epsilon in levels:
        scores = []
        for trial, (x, y, counts, true_centered, true_means) in enumerate(batches):
            g = probe_gradient(
                x,
                y,
                classes,
                noise_multiplier=sigma or None,
                clip=clip,
                degree=degree,
                seed=seed * 1000 + trial,
            )
            means, estimate = reconstruct_class_means(
                g, classes, true_means.shape[1], batch_size=batch_size
            )
            centered = (
                -g[classes:].double().view(classes, -1)
            )  # S_c/b - xbar/L up to the clipping scale
            present = counts > 0
            scores.append(
                (
                    _cosines(centered, true_centered, present),
                    _cosines(means, true_means, present),
                    float((estimate - counts).abs().max()),
                    float(torch.equal(estimate.round(), counts)),
                )
            )
            if trial == 0:
                pictures.append((f"sigma {sigma:.3g}" if sigma else "no DP", means))
        mean = np.mean(scores, axis=0)
        result.rows.append(
            InversionRow(
                sigma, epsilon, 2.0 * clip * sigma * degree**0.5, *(float(v) for v in mean)
            )
        )
    if plot is not None:
        result.plot = _plot(Path(plot), batches[0][4], pictures)
    return result


def _plot(path: Path, truth: torch.Tensor, pictures: list[tuple[str, torch.Tensor]]) -> Path:
    """Rows: the true class means of the first victim's batch, then each reconstruction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [("true", truth), *pictures]
    classes = truth.shape[0]
    fig, axes = plt.subplots(
        len(rows), classes, figsize=(classes * 0.9, len(rows) * 1.0), dpi=100, squeeze=False
    )
    for r, (label, images) in enumerate(rows):
        for c in range(classes):
            axis = axes[r][c]
            side = int(round(images.shape[1] ** 0.5))  # square images (digits: 8 x 8)
            axis.imshow(images[c].reshape(side, -1).numpy(), cmap="gray_r")
            axis.set_xticks([])
            axis.set_yticks([])
            if c == 0:
                axis.set_ylabel(label, fontsize=7)
            if r == 0:
                axis.set_title(str(c), fontsize=8)
    fig.suptitle("model-probe on PDSL: a victim's class means, true vs reconstructed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
