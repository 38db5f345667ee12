"""Experimental and approximate privacy engines (immediate sensitivity, trimmed mean, sign vote).

Each engine states its guarantee in ``engine.guarantee`` / ``engine.describe_guarantee()``;
``engine.is_approximate`` is ``True`` for the immediate-sensitivity engines, whose ε is only a
heuristic figure (an :class:`ApproximateEpsilon`). See docs/experimental_engines.md.
"""

from ._base import ApproximateDPWarning, ApproximateEpsilon, ExperimentalPrivacyEngine
from .immediate_sensitivity import (
    GlobalImmediateSensitivityPrivacyEngine,
    ImmediateSensitivityPrivacyEngine,
    NonConstantSensitivityWarning,
    immediate_sensitivity,
    per_example_input_grad_norms,
)
from .sign_vote import SignVotePrivacyEngine, sign_vote_counts
from .trimmed_mean import (
    TrimmedMeanPrivacyEngine,
    clamp_with_nonfinite,
    lln_calibration,
    sample_laplace_log_normal,
    trimmed_mean,
    trimmed_mean_smooth_sensitivity,
    zcdp_to_epsilon,
)

__all__ = [
    "ApproximateDPWarning",
    "ApproximateEpsilon",
    "ExperimentalPrivacyEngine",
    "GlobalImmediateSensitivityPrivacyEngine",
    "ImmediateSensitivityPrivacyEngine",
    "NonConstantSensitivityWarning",
    "SignVotePrivacyEngine",
    "TrimmedMeanPrivacyEngine",
    "clamp_with_nonfinite",
    "immediate_sensitivity",
    "lln_calibration",
    "per_example_input_grad_norms",
    "sample_laplace_log_normal",
    "sign_vote_counts",
    "trimmed_mean",
    "trimmed_mean_smooth_sensitivity",
    "zcdp_to_epsilon",
]
