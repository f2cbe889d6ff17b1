"""The audit's plot (score distributions of canaries in and out) and its MLflow record.

The figures go onto the MLflow runs the audit trained (same tracking store as every
run): metric `audit_epsilon_lower` and friends, params `audit.*`, tag `audit=true`
and the plot as an artifact. A tracking failure is reported, never raised: the
audit's result stands without it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from p4bench.audit.result import AuditResult

__all__ = ["log_audit", "plot_scores"]

log = logging.getLogger(__name__)


def plot_scores(audit: AuditResult, path: Path) -> Path:
    """Histograms of the canaries' scores, in vs out, with the test's threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scores, included, bound = audit.scores, audit.included, audit.bound
    finite = scores[np.isfinite(scores)]
    low, high = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    lines = []  # (threshold, label) of the test's guesses
    if bound.bound == "one-run":
        if bound.guesses_in and np.isfinite(bound.threshold):
            lines.append((bound.threshold, f"guess in at or above ({bound.guesses_in})"))
        if bound.guesses_out and np.isfinite(bound.threshold_out):
            lines.append((bound.threshold_out, f"guess out at or below ({bound.guesses_out})"))
    elif np.isfinite(bound.threshold):
        side, guess = bound.direction.split("-")
        lines.append(
            (bound.threshold, f"threshold ({guess} if score {'>=' if side == 'high' else '<='})")
        )
    for value, _ in lines:
        low, high = min(low, value), max(high, value)
    bins = np.linspace(low, high if high > low else low + 1.0, 61).tolist()
    fig, axis = plt.subplots(figsize=(6.5, 3.8), dpi=100)
    axis.hist(
        scores[~included],
        bins=bins,
        alpha=0.55,
        label=f"out ({int((~included).sum())})",
        color="tab:blue",
    )
    axis.hist(
        scores[included],
        bins=bins,
        alpha=0.55,
        label=f"in ({int(included.sum())})",
        color="tab:red",
    )
    for (value, label), style in zip(lines, ("--", ":")):
        axis.axvline(value, color="black", linestyle=style, linewidth=1, label=label)
    axis.set_yscale("log")
    axis.set_xlabel(
        "canary score (log-likelihood ratio, summed over releases)"
        if audit.level == "mechanism"
        else "canary score (W[c, j] - reference, summed over what the observer saw)"
    )
    axis.set_ylabel("canaries")
    axis.set_title(
        f"{audit.config.method} on {audit.config.dataset}: eps >= {bound.epsilon_lower:.2f} ({bound.bound}, ceiling "
        f"{bound.ceiling:.2f}) vs {audit.claim_label} {audit.claimed_epsilon:.2f}",
        fontsize=10,
    )
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def log_audit(audit: AuditResult) -> str | None:
    """Add the audit to every tracked run it trained; the error text, or None."""
    tracked = [
        s for s in audit.summaries if s.get("tracked") and s.get("run_id") and s.get("tracking_uri")
    ]
    if not tracked:
        return (
            None
            if all(not s.get("tracked") for s in audit.summaries)
            else "runs were not tracked in MLflow"
        )
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        bound = audit.bound
        stamp = int(time.time() * 1000)
        metrics = {
            "audit_epsilon_lower": bound.epsilon_lower,
            "audit_claimed_epsilon": audit.claimed_epsilon,
            "audit_tpr_lower": bound.tpr_lower,
            "audit_fpr_upper": bound.fpr_upper,
            "audit_trials": float(bound.trials),
            "audit_ceiling": bound.ceiling,
            "audit_guesses": float(bound.guesses),
            "audit_correct": float(bound.correct),
            **({"audit_seconds": audit.seconds} if audit.seconds is not None else {}),
            **({"audit_cpu_seconds": audit.cpu_seconds} if audit.cpu_seconds is not None else {}),
        }
        params = {
            "audit.runs": str(audit.runs),
            "audit.seeds": ",".join(str(s["seed"]) for s in audit.summaries),
            "audit.canaries_per_client": str(audit.canaries_per_client),
            "audit.confidence": f"{bound.confidence:g}",
            "audit.delta": f"{bound.delta:g}",
            "audit.direction": bound.direction,
            "audit.threshold": f"{bound.threshold:.6g}",
            "audit.level": audit.level,
            "audit.bound": bound.bound,
            "audit.analysis": str(bound.analysis),
            "audit.observer": str(audit.observer),
        }
        tags = {"audit": "true", "audit.verdict": audit.verdict, "audit.claim": audit.claim_label}
        for summary in tracked:
            client = MlflowClient(tracking_uri=summary["tracking_uri"])
            run_id = summary["run_id"]
            client.log_batch(
                run_id,
                metrics=[
                    Metric(k, float(v), stamp, 0) for k, v in metrics.items() if np.isfinite(v)
                ],
                params=[Param(k, v) for k, v in params.items()],
                tags=[RunTag(k, v) for k, v in tags.items()],
            )
            if audit.plot is not None and Path(audit.plot).exists():
                client.log_artifact(run_id, str(audit.plot))
    except Exception as exc:  # tracking never loses the audit's result
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        message = f"MLflow audit logging failed ({type(exc).__name__}: {first})"
        log.warning(message)
        return message
    return None
