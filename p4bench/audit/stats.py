"""The statistics of the audit: per-canary likelihood-ratio scores, the bound's record
(`AuditBound`) and the multi-run lower bound on epsilon (Jagielski et al. 2020, with
Clopper-Pearson intervals); the one-run bound is in `p4bench.audit.one_run`.

If a mechanism is (eps, delta)-DP, every test that guesses a canary's inclusion bit
from the mechanism's output has TPR <= e^eps FPR + delta (and, the relation being
symmetric, TNR <= e^eps FNR + delta). From independent trials, a (1 - alpha) upper
bound FPR_hi and lower bound TPR_lo give eps >= log((TPR_lo - delta) / FPR_hi) with
confidence 1 - alpha. The test (its direction and threshold) is chosen on one half of
the trials and evaluated once on the other half, so the choice cannot inflate the bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from scipy.stats import beta

__all__ = [
    "AuditBound",
    "clopper_pearson",
    "empirical_epsilon",
    "epsilon_from_rates",
    "release_scores",
]


def release_scores(
    x: torch.Tensor, sample_rate: float, mu: float | torch.Tensor, neighbouring: str
) -> torch.Tensor:
    """Log-likelihood ratio (in vs out) of one release's projections `x` (any shape, in
    units of the claimed noise std) under the subsampled Gaussian mechanism.

    A sampled canary shifts its projection by mu = C / std: add-remove compares
    (1-q) N(0,1) + q N(mu,1) (in) with N(0,1) (out); replace-one compares
    (1-q) N(0,1) + q N(mu,1) (in) with (1-q) N(0,1) + q N(-mu,1) (the opposite record).
    `mu` may be a tensor that broadcasts against `x` (a shift per release row).
    """
    q = float(sample_rate)
    x = x.to(torch.float64)
    if isinstance(mu, torch.Tensor):
        mu = mu.to(torch.float64)
    keep = torch.tensor(math.log1p(-q) if q < 1.0 else -math.inf, dtype=torch.float64)
    shift = math.log(q) - mu * mu / 2.0
    score = torch.logaddexp(keep, shift + mu * x)
    if neighbouring == "replace-one":
        score = score - torch.logaddexp(keep, shift - mu * x)
    return score


def clopper_pearson(
    successes: npt.ArrayLike, trials: npt.ArrayLike, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds on a binomial proportion: each of (lower, upper)
    holds with probability >= 1 - alpha on its own. Vectorised; n = 0 gives (0, 1)."""
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        lower = np.where(k <= 0, 0.0, beta.ppf(alpha, np.maximum(k, 1e-300), n - k + 1))
        upper = np.where(k >= n, 1.0, beta.ppf(1.0 - alpha, k + 1, np.maximum(n - k, 1e-300)))
    return np.nan_to_num(lower, nan=0.0), np.nan_to_num(upper, nan=1.0)


def epsilon_from_rates(
    tpr_lower: npt.ArrayLike, fpr_upper: npt.ArrayLike, delta: float
) -> np.ndarray:
    """max(0, log((TPR_lo - delta) / FPR_hi)); 0 where TPR_lo <= delta."""
    tpr = np.asarray(tpr_lower, dtype=np.float64) - delta
    fpr = np.asarray(fpr_upper, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.where(tpr > 0, np.log(np.maximum(tpr, 1e-300) / np.maximum(fpr, 1e-300)), 0.0)
    return np.maximum(eps, 0.0)


@dataclass(frozen=True)
class AuditBound:
    """The lower bound and the test it comes from.

    `bound` "multi-run" (`empirical_epsilon`; counts are on the evaluation half):
    `direction` names the test: "high-in" guesses "in" for score >= threshold (TPR/FPR),
    "low-out" guesses "out" for score <= threshold (TNR/FNR: the positives are then the
    out-canaries), and "low-in" / "high-out" the same for scores that run the other way.

    `bound` "one-run" (`p4bench.audit.one_run.one_run_bound`, `direction` "one-run"):
    `guesses_in` "in" guesses (scores >= `threshold`) and `guesses_out` "out" guesses
    (scores <= `threshold_out`), `correct` of them right, tested at `significance` with
    `analysis` ("fdp" or "steinke"); positives / negatives count the in / out canaries,
    true / false positives the right / wrong "in" guesses; `tpr_lower` and `fpr_upper`
    are not defined (NaN). `separated`: every in-canary scored above every out-canary.
    """

    epsilon_lower: float
    confidence: float
    delta: float
    direction: str
    threshold: float
    tpr_lower: float
    fpr_upper: float
    true_positives: int
    positives: int
    false_positives: int
    negatives: int
    trials: int
    selection_trials: int
    ceiling: float = (
        math.inf
    )  # the largest bound these trials could show (a perfect test: `epsilon_ceiling`)
    bound: str = "multi-run"  # or "one-run"
    analysis: str | None = None  # the one-run analysis: fdp | steinke
    guesses_in: int = 0
    guesses_out: int = 0
    correct: int = 0
    threshold_out: float = math.nan
    separated: bool | None = None
    significance: float = math.nan  # the level the chosen one-run rule was tested at

    @property
    def guesses(self) -> int:
        return self.guesses_in + self.guesses_out

    @property
    def at_ceiling(self) -> bool:
        """The bound is as high as these trials allow (a perfect test or separation)."""
        return self.epsilon_lower >= self.ceiling - 1e-6

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def epsilon_ceiling(positives: int, negatives: int, delta: float, confidence: float) -> float:
    """The largest lower bound `empirical_epsilon` can print from `positives` and
    `negatives` evaluated trials: every positive guessed, no negative. A claim above it
    cannot be refuted by these trials, whatever the method does."""
    alpha = (1.0 - confidence) / 2.0
    tpr_lower, _ = clopper_pearson(positives, positives, alpha)
    _, fpr_upper = clopper_pearson(0, negatives, alpha)
    return float(epsilon_from_rates(tpr_lower, fpr_upper, delta))


def runs_to_reach(
    claim: float,
    positives: int,
    negatives: int,
    delta: float,
    confidence: float,
    runs: int,
    limit: int = 100_000,
) -> int | None:
    """How many runs (trials grow with them) lift the ceiling above `claim`, or None
    beyond `limit` runs."""
    if positives <= 0 or negatives <= 0 or runs <= 0:
        return None
    factor = 1
    while runs * factor <= limit:
        if epsilon_ceiling(positives * factor, negatives * factor, delta, confidence) > claim:
            return runs * factor
        factor *= 2
    return None


def _sweep(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every distinct threshold t (test: score >= t), the counts of positives and of
    negatives at or above t. Returns (thresholds, tp, fp), thresholds descending."""
    order = np.argsort(-scores, kind="stable")
    ordered, flags = scores[order], labels[order]
    tp, fp = np.cumsum(flags), np.cumsum(~flags)
    last = np.r_[ordered[1:] != ordered[:-1], True]  # the end of each run of tied scores
    return ordered[last], tp[last], fp[last]


# test -> (score sign, whether the guess is "out"): the test is sign * score >= sign * threshold
DIRECTIONS = {
    "high-in": (1.0, False),
    "low-out": (-1.0, True),
    "low-in": (-1.0, False),
    "high-out": (1.0, True),
}


def _oriented(
    scores: np.ndarray, labels: np.ndarray, direction: str
) -> tuple[np.ndarray, np.ndarray]:
    """(sign * scores, positives) so that every test reads "oriented score >= t guesses positive"."""
    sign, out = DIRECTIONS[direction]
    return sign * scores, (~labels if out else labels)


def empirical_epsilon(
    scores: npt.ArrayLike,
    included: npt.ArrayLike,
    *,
    delta: float,
    confidence: float = 0.95,
    seed: int = 0,
) -> AuditBound:
    """A (confidence)-level lower bound on epsilon from independent trials.

    `scores` (N,) are larger for "more likely in", `included` (N,) the true bits. The
    trials are split at random in two halves; the test (side of the threshold, guess "in"
    or "out": both inequalities of (eps, delta)-DP hold) and threshold that maximise the
    bound on the first half are evaluated on the second, with one-sided
    Clopper-Pearson bounds on TPR and FPR at (1 - confidence) / 2 each (Bonferroni).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(included, dtype=bool).reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError("scores and inclusion bits must have the same length")
    alpha = (1.0 - confidence) / 2.0
    order = np.random.default_rng(seed).permutation(len(scores))
    half = len(scores) // 2
    select, evaluate = order[:half], order[half:]

    best = (-1.0, "high-in", math.inf)
    for direction in DIRECTIONS:
        s, y = _oriented(scores[select], labels[select], direction)
        if not len(s):
            continue
        thresholds, tps, fps = _sweep(s, y)
        lower, _ = clopper_pearson(tps, int(y.sum()), alpha)
        _, upper = clopper_pearson(fps, int((~y).sum()), alpha)
        epsilons = epsilon_from_rates(lower, upper, delta)
        i = int(np.argmax(epsilons))
        if epsilons[i] > best[0]:
            best = (float(epsilons[i]), direction, float(thresholds[i]))
    _, direction, threshold = best

    s, y = _oriented(scores[evaluate], labels[evaluate], direction)
    guess = s >= threshold
    tp, positives = int((guess & y).sum()), int(y.sum())
    fp, negatives = int((guess & ~y).sum()), int((~y).sum())
    tpr_lower, _ = clopper_pearson(tp, positives, alpha)
    _, fpr_upper = clopper_pearson(fp, negatives, alpha)
    eps = float(epsilon_from_rates(tpr_lower, fpr_upper, delta))
    return AuditBound(
        epsilon_lower=eps,
        confidence=confidence,
        delta=float(delta),
        direction=direction,
        threshold=DIRECTIONS[direction][0] * threshold,
        tpr_lower=float(tpr_lower),
        fpr_upper=float(fpr_upper),
        true_positives=tp,
        positives=positives,
        false_positives=fp,
        negatives=negatives,
        trials=len(scores),
        selection_trials=half,
        ceiling=epsilon_ceiling(positives, negatives, delta, confidence),
    )
