"""Empirical privacy audit: canaries through the DP mechanism, a lower bound on epsilon.

`run_audit(config)` trains the configured method with gradient canaries inserted into
(and observed through) every noisy release, scores each canary by its log-likelihood
ratio, and turns the scores into a hypothesis-test lower bound on epsilon at a stated
confidence, to set next to the run's claimed epsilon. `p4bench audit` is the command.
"""

from p4bench.audit.canaries import AuditedMechanism, CanaryBank
from p4bench.audit.core import AuditResult, audit_config, run_audit
from p4bench.audit.stats import AuditBound, clopper_pearson, empirical_epsilon, epsilon_from_rates, release_scores

__all__ = [
    "AuditBound",
    "AuditResult",
    "AuditedMechanism",
    "CanaryBank",
    "audit_config",
    "clopper_pearson",
    "empirical_epsilon",
    "epsilon_from_rates",
    "release_scores",
    "run_audit",
]
