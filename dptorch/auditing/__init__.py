"""Privacy auditing: measure the privacy that dptorch's implementation really gives.

* :func:`audit_mechanism` — white-box audit of DP-SGD steps through the real ``make_private``
  pipeline with a Dirac canary: a rigorous lower bound on ε at δ, the fitted Gaussian-DP μ with
  its interval, and a comparison with the accountant (:mod:`dptorch.auditing.mechanism`).
* :class:`OneRunAuditor` — the one-run audit of a whole training run (Steinke, Nasr, Jagielski
  2023): canaries included with probability ½, membership scores, ε lower bound
  (:mod:`dptorch.auditing.one_run`).
* :mod:`dptorch.auditing.stats` — the statistics both use.

An audit gives a *lower* bound for the audited model, canary and setting; it cannot prove that
a run is private. See docs/auditing.md.
"""

from .mechanism import (
    VERDICT_CONSISTENT,
    VERDICT_INCONCLUSIVE,
    VERDICT_VIOLATION,
    MechanismAuditConfig,
    MechanismAuditResult,
    ThresholdTest,
    audit_mechanism,
)
from .one_run import OneRunAuditor, OneRunResult
from .stats import one_run_epsilon_lower_bound, one_run_p_value

__all__ = [
    "VERDICT_CONSISTENT",
    "VERDICT_INCONCLUSIVE",
    "VERDICT_VIOLATION",
    "MechanismAuditConfig",
    "MechanismAuditResult",
    "OneRunAuditor",
    "OneRunResult",
    "ThresholdTest",
    "audit_mechanism",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
]
