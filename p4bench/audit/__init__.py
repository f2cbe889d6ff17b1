"""Empirical privacy audit: canaries through the DP mechanism, a lower bound on epsilon.

`run_audit(config)` trains the configured method with gradient canaries inserted into
(and observed through) every noisy release, scores each canary by its log-likelihood
ratio, and turns the scores into a hypothesis-test lower bound on epsilon at a stated
confidence, to set next to the run's claimed epsilon: by default the one-run bound
(`one_run_bound`: Steinke et al.'s game, Mahloujifar et al.'s f-DP analysis), else
the multi-run hypothesis test (`empirical_epsilon`). `p4bench audit` is the command.
"""

from p4bench.audit.canaries import AuditedMechanism, CanaryBank
from p4bench.audit.core import AuditResult, audit_config, run_audit
from p4bench.audit.one_run import (
    audit_bound,
    one_run_bound,
    one_run_ceiling,
    one_run_epsilon,
    steinke_p_value,
)
from p4bench.audit.stats import (
    AuditBound,
    clopper_pearson,
    empirical_epsilon,
    epsilon_from_rates,
    release_scores,
)

__all__ = [
    "AuditBound",
    "AuditResult",
    "AuditedMechanism",
    "CanaryBank",
    "audit_bound",
    "audit_config",
    "clopper_pearson",
    "empirical_epsilon",
    "epsilon_from_rates",
    "one_run_bound",
    "one_run_ceiling",
    "one_run_epsilon",
    "release_scores",
    "run_audit",
    "steinke_p_value",
]
