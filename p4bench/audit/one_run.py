"""The one-run audit bound: m canaries of one training, each in or out by a fair coin,
guessed from their scores (Steinke, Nasr and Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023).

The game. Each canary's inclusion bit is an independent fair coin. The auditor guesses
"in" for the k+ highest scores and "out" for the k- lowest, and abstains on the rest;
it counts the c correct guesses among k = k+ + k-. Independence of the trials is not
needed: only that the run is (eps, delta)-DP with respect to each canary, the others
held fixed. Canaries of several runs pool into one game (a canary is in one run only).

Two analyses of the same game, each a valid test of "the run is (eps, delta)-DP":

- ``fdp`` (default, `fdp_rejects`): Mahloujifar, Melis and Chaudhuri, "Auditing
  f-Differential Privacy in One Run" (ICML 2025), applied to the tradeoff curve of
  (eps, delta)-DP itself, f(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x)):
  the curve every (eps, delta)-DP mechanism satisfies, so no Gaussian (or other) shape
  is assumed. Their recursion bounds the probability of c or more correct guesses by a
  chain of inequalities between the tails; (eps, delta) is rejected at level alpha when
  that chain cannot close (r_0 + h_0 > k / m). At delta = 0 it matches the binomial
  bound of Steinke et al.; for delta > 0 it loses little (8.11 against 8.11 at delta 0
  for 10,000 correct guesses), where Steinke et al.'s delta term does.
- ``steinke`` (`steinke_p_value`): their Theorem 3.1 / Algorithm 2 p-value,
  P[Binomial(k, e^eps / (1 + e^eps)) >= c] + 2 m delta max_i P[c - i <= Binomial < c] / i.
  The 2 m delta term caps it: at delta = 7e-5 (digits' 1 / (10 N)) no number of canaries
  lifts its ceiling above about 6.3, so it cannot refute a claim of 8.

Choosing the guesses. The guess counts come from a small grid fixed in advance
(`guess_grid`, a function of m alone), and a weighted union bound (Bonferroni) over
the grid keeps the choice from inflating the bound: the rule with weight w is tested at
level w alpha, and the weights sum to 1. Half of alpha goes to the rule that guesses
(almost) every canary, the one a claim as high as 8 needs; the rest to rules that guess
fewer canaries, which catch smaller leaks.

The ceiling is the bound of that rule when every guess is right: what a perfect
separation of the canaries (every "in" canary scored above every "out" one) gives. A
claim above it cannot be refuted by this many canaries, whatever the run does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.special import expit, logit
from scipy.stats import beta, binom

from p4bench.audit.stats import AuditBound

__all__ = [
    "ANALYSES",
    "BOUNDS",
    "audit_bound",
    "GuessRule",
    "fdp_rejects",
    "guess_grid",
    "one_run_bound",
    "one_run_ceiling",
    "one_run_epsilon",
    "one_run_runs_to_reach",
    "pure_epsilon",
    "steinke_p_value",
]

ANALYSES = ("fdp", "steinke")
# `--bound`: the one-run game with either analysis, or the multi-run hypothesis test
BOUNDS = {"one-run": "fdp", "steinke": "steinke", "multi-run": None}
_EPS_MAX = 60.0  # no bound is searched above it (e^60 ~ 1e26: every finite count stays far below)
_TOLERANCE = 1e-4  # of the epsilon search
MAX_CANARIES = 2_000_000  # `one_run_runs_to_reach` looks no further (the ceiling grows like log m)


@dataclass(frozen=True)
class GuessRule:
    """Guess "in" for the `k_in` highest scores and "out" for the `k_out` lowest; test at
    `weight` x alpha."""

    k_in: int
    k_out: int
    weight: float

    @property
    def guesses(self) -> int:
        return self.k_in + self.k_out


def guess_grid(m: int) -> list[GuessRule]:
    """The predeclared rules for m canaries, their weights summing to 1.

    The first guesses both sides up to m/2 - 1.5 sqrt(m) canaries each: the number of
    "in" canaries is Binomial(m, 1/2), 3 standard deviations above that count with
    probability 0.9987, so a perfect separation makes every one of its guesses right
    (a fixed m/2 would be wrong on the imbalance). It carries half of alpha: a claim of
    8 needs about 15,000 correct guesses at alpha / 2. The others carry a tenth each.
    """
    top = max(
        0, math.floor(m / 2 - 1.5 * math.sqrt(m)), math.floor(0.25 * m)
    )  # the largest, also at small m
    rules = [GuessRule(top, top, 0.5)]
    for k_in, k_out in ((0.25, 0.25), (0.1, 0.1), (0.03, 0.03), (0.1, 0.0), (0.01, 0.0)):
        rules.append(GuessRule(math.floor(k_in * m), math.floor(k_out * m), 0.1))
    return rules


def steinke_p_value(m: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """Steinke et al.'s bound on P[>= `correct` right among `guesses`] for m canaries
    under (eps, delta)-DP (their Theorem 3.1, as computed in their Algorithm 2)."""
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= m, got {correct}, {guesses}, {m}")
    q = float(expit(eps))  # the accuracy of eps-DP randomized response
    tail = float(binom.sf(correct - 1, guesses, q))
    if delta <= 0.0 or correct == 0:
        return min(tail, 1.0)
    # P[c - i <= Binomial < c] / i for i = 1..c: cumulated pmf below c
    below = np.cumsum(binom.pmf(np.arange(correct - 1, -1, -1), guesses, q))
    worst = float(np.max(below / np.arange(1, correct + 1)))
    return min(tail + 2.0 * m * delta * worst, 1.0)


def fdp_rejects(
    m: int, guesses: int, correct: int, eps: float, delta: float, significance: float
) -> bool:
    """Whether `correct` right of `guesses` (m canaries) refutes (eps, delta)-DP at level
    `significance` (Mahloujifar et al.'s recursion on the (eps, delta) tradeoff curve).

    Suppose P[>= c right] >= tau under some f-DP mechanism. With r and h the (scaled)
    expected numbers of right and wrong guesses on the event, the tradeoff curve forces
    them up, one correct guess at a time (i = c-1 .. 0): h >= B^-1(r), B(x) = 1 - f(x)
    the blow-up of f, and r grows by i / (k - i) of h's growth. If they outgrow the k / m
    guesses there are, no such mechanism exists: the tail is below tau.
    """
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= m, got {correct}, {guesses}, {m}")
    if correct == 0:
        return False
    total = guesses / m
    r, h = significance * correct / m, significance * (guesses - correct) / m
    grow, shrink = math.exp(eps), math.exp(-eps)
    for i in range(correct - 1, -1, -1):
        # B^-1(r) of f(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x))
        blown = max((r - delta) * shrink, 1.0 - delta - (1.0 - r) * grow)
        if blown <= h:
            break  # h, and with it r, stays where it is from here on
        r = min(r + i / (guesses - i) * (blown - h), 1.0)
        h = blown
        if r + h > total:
            return True  # both only grow: the chain cannot close any more
    return r + h > total


def pure_epsilon(guesses: int, correct: int, significance: float) -> float:
    """The bound at delta = 0: the largest eps with P[Binomial(k, e^eps/(1+e^eps)) >= c]
    <= significance, i.e. the logit of the one-sided Clopper-Pearson lower bound on the
    accuracy. No analysis at delta >= 0 exceeds it (randomized response is (eps, 0)-DP)."""
    if correct <= 0 or guesses <= 0:
        return 0.0
    accuracy = float(beta.ppf(significance, correct, guesses - correct + 1))
    return max(0.0, float(logit(accuracy))) if accuracy > 0.5 else 0.0


def _rejects(
    m: int, guesses: int, correct: int, eps: float, delta: float, significance: float, analysis: str
) -> bool:
    if analysis == "fdp":
        return fdp_rejects(m, guesses, correct, eps, delta, significance)
    if analysis == "steinke":
        return steinke_p_value(m, guesses, correct, eps, delta) <= significance
    raise ValueError(f"analysis must be one of {', '.join(ANALYSES)}, got '{analysis}'")


def one_run_epsilon(
    m: int, guesses: int, correct: int, delta: float, significance: float, analysis: str = "fdp"
) -> float:
    """The largest eps whose (eps, delta) claim this count refutes at `significance`
    (0 if none): a bisection, the test being monotone in eps."""
    high = min(pure_epsilon(guesses, correct, significance), _EPS_MAX)
    if high <= 0.0 or not _rejects(m, guesses, correct, 0.0, delta, significance, analysis):
        return 0.0
    if _rejects(m, guesses, correct, high, delta, significance, analysis):
        return high  # at delta ~ 0 the analyses reach the pure bound
    low = 0.0
    while high - low > _TOLERANCE * max(1.0, low):
        middle = (low + high) / 2
        if _rejects(m, guesses, correct, middle, delta, significance, analysis):
            low = middle
        else:
            high = middle
    return low


def one_run_ceiling(m: int, delta: float, confidence: float, analysis: str = "fdp") -> float:
    """The bound of a perfect separation of m canaries: every guess right, at the best
    rule of the grid (the largest: the others guess fewer at a smaller level)."""
    alpha = 1.0 - confidence
    return max(
        (
            one_run_epsilon(m, rule.guesses, rule.guesses, delta, alpha * rule.weight, analysis)
            for rule in guess_grid(m)
            if rule.guesses > 0
        ),
        default=0.0,
    )


def one_run_runs_to_reach(
    claim: float,
    canaries: int,
    runs: int,
    delta: float,
    confidence: float,
    analysis: str = "fdp",
    limit: int = 100_000,
) -> int | None:
    """How many runs of this size (canaries pooled: `canaries` in `runs` runs) lift the
    ceiling above `claim`, or None beyond `limit` runs or `MAX_CANARIES` canaries
    (Steinke et al.'s ceiling falls with m at digits' delta: there, none does)."""
    if canaries <= 0 or runs <= 0:
        return None
    per_run = canaries / runs

    def lifts(n: int) -> bool:
        m = int(per_run * n)
        top = guess_grid(m)[0]
        significance = (1.0 - confidence) * top.weight
        return top.guesses > 0 and _rejects(
            m, top.guesses, top.guesses, claim, delta, significance, analysis
        )

    # the pure (delta = 0) bound needs k >= log(1 / alpha) (1 + e^claim) right guesses: a start from below
    alpha = (1.0 - confidence) * guess_grid(10_000)[0].weight
    low = max(
        runs, math.floor(math.log(1.0 / alpha) * (1.0 + math.exp(min(claim, 50.0))) / per_run) - 1
    )
    high = max(low, runs)
    while not lifts(high):
        low, high = high, high * 2
        if high > limit or high * per_run > MAX_CANARIES:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        if lifts(middle):
            high = middle
        else:
            low = middle
    return high if lifts(high) and high <= limit else None


def one_run_bound(
    scores: npt.ArrayLike,
    included: npt.ArrayLike,
    *,
    delta: float,
    confidence: float = 0.95,
    analysis: str = "fdp",
) -> AuditBound:
    """The one-run lower bound on epsilon from canary `scores` (larger: "more likely
    in") and their true bits: the best rule of `guess_grid`, each at its share of
    alpha = 1 - confidence. Ties are ordered by position (independent of the bits)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if analysis not in ANALYSES:
        raise ValueError(f"analysis must be one of {', '.join(ANALYSES)}, got '{analysis}'")
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(included, dtype=bool).reshape(-1)
    if values.shape != labels.shape:
        raise ValueError("scores and inclusion bits must have the same length")
    m = len(values)
    alpha = 1.0 - confidence
    order = np.argsort(-values, kind="stable")
    ranked, bits = values[order], labels[order]
    right_in, right_out = (
        np.r_[0, np.cumsum(bits)],
        np.r_[0, np.cumsum(~bits[::-1])],
    )  # from the top / bottom

    best, chosen = 0.0, GuessRule(0, 0, 0.0)
    for rule in guess_grid(m):
        if rule.guesses <= 0:
            continue
        correct = int(right_in[rule.k_in] + right_out[rule.k_out])
        significance = alpha * rule.weight
        # cheap skip: the pure bound caps every analysis, so a rule below the best so far cannot win
        if pure_epsilon(rule.guesses, correct, significance) <= best:
            continue
        eps = one_run_epsilon(m, rule.guesses, correct, delta, significance, analysis)
        if eps > best:
            best, chosen = eps, rule
    if chosen.guesses == 0:  # nothing refuted: report the rule of the ceiling
        chosen = guess_grid(m)[0]
    positives = int(labels.sum())
    true_in = int(right_in[chosen.k_in])
    true_out = int(right_out[chosen.k_out])
    separated = bool(positives in (0, m) or ranked[positives - 1] > ranked[positives]) and bool(
        bits[:positives].all()
    )
    return AuditBound(
        epsilon_lower=best,
        confidence=confidence,
        delta=float(delta),
        direction="one-run",
        threshold=float(ranked[chosen.k_in - 1]) if chosen.k_in else math.inf,
        tpr_lower=math.nan,
        fpr_upper=math.nan,
        true_positives=true_in,
        positives=positives,
        false_positives=chosen.k_in - true_in,
        negatives=m - positives,
        trials=m,
        selection_trials=0,
        ceiling=one_run_ceiling(m, delta, confidence, analysis),
        bound="one-run",
        analysis=analysis,
        guesses_in=chosen.k_in,
        guesses_out=chosen.k_out,
        correct=true_in + true_out,
        threshold_out=float(ranked[m - chosen.k_out]) if chosen.k_out else -math.inf,
        separated=separated,
        significance=alpha * chosen.weight,
    )


def audit_bound(
    scores: npt.ArrayLike,
    included: npt.ArrayLike,
    *,
    delta: float,
    confidence: float,
    bound: str,
    seed: int = 0,
) -> AuditBound:
    """The lower bound named by `bound` (a key of `BOUNDS`): "one-run" (`one_run_bound`,
    analysis fdp), "steinke" (the same game, Steinke et al.'s p-value) or "multi-run"
    (`p4bench.audit.stats.empirical_epsilon`: Jagielski et al., test chosen on half the
    trials, seeded by `seed`)."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got '{bound}'")
    analysis = BOUNDS[bound]
    if analysis is None:
        from p4bench.audit.stats import empirical_epsilon

        return empirical_epsilon(scores, included, delta=delta, confidence=confidence, seed=seed)
    return one_run_bound(scores, included, delta=delta, confidence=confidence, analysis=analysis)
