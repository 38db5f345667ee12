"""Each deliberately broken component (tests/auditing/audit_fixtures.py) must be flagged as a
violation by the mechanism audit; the real pipeline, given the same change, must not."""

from __future__ import annotations

import pytest
from audit_fixtures import LargerSampleRate, halve_clipping_bound

from dptorch.auditing import VERDICT_CONSISTENT, VERDICT_VIOLATION, audit_mechanism
from dptorch.clipping import ClippingContract


def _violation(**kwargs):
    r = audit_mechanism(**kwargs)
    assert r.verdict == VERDICT_VIOLATION, r.report()
    assert r.violation
    return r


@pytest.mark.parametrize(
    "mode", ["audit-bug-clip-2c", "audit-bug-half-noise", "audit-bug-unclipped"]
)
def test_broken_optimizer_is_a_violation(mode):
    """Clip at 2C, noise for σ/2, unclipped release: each doubles (or more) the shift of the
    canary relative to the noise, μ = 2/σ or more instead of 1/σ."""
    r = _violation(grad_sample_mode=mode, noise_multiplier=1.0, seed=11)
    assert r.mu_lower > 1.5  # proven with 95% confidence, against the claimed μ = 1


def test_broken_optimizer_is_a_violation_at_small_q_long_run():
    """Clipping at 2C is caught at q = 0.1, T = 10, σ = 2 too (ε = 0.8 claimed); 30,000 trials
    (8 seeds out of 8 tried were caught; 6 of 8 with 10,000 trials)."""
    _violation(
        grad_sample_mode="audit-bug-clip-2c", noise_multiplier=2.0, sample_rate=0.1, steps=10,
        trials=30_000, seed=12,
    )


def test_stale_clipping_bound_is_a_violation():
    """The old bug: C halved after make_private (a scheduler), the clipping keeps the old C
    while the noise follows the new one."""
    _violation(grad_sample_mode="audit-bug-stale-c", after_make_private=halve_clipping_bound, seed=13)


def test_real_optimizer_with_the_same_change_is_consistent():
    r = audit_mechanism(grad_sample_mode="hooks", after_make_private=halve_clipping_bound, seed=13)
    assert r.verdict == VERDICT_CONSISTENT, r.report()


def test_bk_refuses_a_module_clipping_with_a_stale_bound():
    """Rebuilding the old bug in bk (the module bound to a copy of the contract, then C changed
    through the optimizer) is refused by the real optimizer before anything is released."""

    def stale_module(module, optimizer, loader, criterion):
        module.bind_clipping(ClippingContract(optimizer.max_grad_norm))
        optimizer.max_grad_norm = optimizer.max_grad_norm / 2

    with pytest.raises(ValueError, match="max_grad_norm changed"):
        audit_mechanism(grad_sample_mode="bk", after_make_private=stale_module, trials=1000)


@pytest.mark.parametrize("real_q,steps,trials", [(0.3, 1, 60_000), (0.2, 10, 10_000)])
def test_sampler_with_larger_q_is_a_violation(real_q, steps, trials):
    """Batches drawn with q = 0.3 (one step) or 0.2 (ten steps) while the accountant records
    q = 0.1. At q = 0.1 most trials with the canary do not sample it, so one step needs more
    trials (8 of 8 seeds tried were caught with these numbers)."""
    r = _violation(
        grad_sample_mode="hooks", sample_rate=0.1, steps=steps, trials=trials,
        after_make_private=LargerSampleRate(real_q), seed=14,
    )
    assert r.sample_rate == 0.1  # what was accounted
