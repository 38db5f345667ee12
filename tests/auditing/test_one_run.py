"""One-run audit (Steinke, Nasr, Jagielski 2023): the auditor's bookkeeping on synthetic scores
and a complete run on digits at ε = 8."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.auditing import VERDICT_VIOLATION, OneRunAuditor
from dptorch.auditing.digits import audit_digits_one_run


def _auditor(m: int = 1000) -> OneRunAuditor:
    return OneRunAuditor(torch.randn(m, 3), torch.zeros(m, dtype=torch.long), seed=0)


def test_inclusion_is_seeded_and_about_half():
    a, b = _auditor(), _auditor()
    assert torch.equal(a.included, b.included)
    assert 450 < int(a.included.sum()) < 550
    data = a.training_set(TensorDataset(torch.zeros(10, 3), torch.zeros(10, dtype=torch.long)))
    assert len(data) == 10 + int(a.included.sum())


def test_perfect_scores_give_the_ceiling_and_random_scores_nothing():
    a = _auditor()
    perfect = a.audit(a.included.double(), epsilon=100.0, delta=1e-5)
    assert perfect.correct == perfect.guesses_in + perfect.guesses_out
    assert 4.0 < perfect.epsilon_lb <= perfect.ceiling
    noise = a.audit(np.random.default_rng(0).standard_normal(a.m), epsilon=100.0, delta=1e-5)
    assert noise.epsilon_lb == 0.0


def test_leaky_scores_are_a_violation():
    """Scores that reveal membership almost perfectly contradict a claimed ε = 1."""
    a = _auditor()
    r = a.audit(a.included.double() + 0.01 * torch.randn(a.m, dtype=torch.float64), epsilon=1.0,
                delta=1e-5)
    assert r.verdict == VERDICT_VIOLATION and r.epsilon_lb > 1.0


def test_observe_chains_the_accountant_and_restores_the_hook():
    torch.manual_seed(0)
    a = OneRunAuditor(torch.randn(20, 4), torch.randint(0, 3, (20,)), seed=1)
    data = a.training_set(TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,))))
    net = nn.Linear(4, 3)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=12), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    hook = opt.step_hook
    with a.observe(model, opt, nn.functional.cross_entropy, norm_every=2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert opt.step_hook is hook
    assert a.observed_steps == len(loader) == len(engine.accountant)
    assert torch.isfinite(a.white_box_scores).all() and a.white_box_scores.abs().sum() > 0


def test_digits_black_box_at_epsilon_8():
    """A complete run: MLP on digits with 1000 canaries, ε = 8; the black-box (loss) audit
    detects some leakage and stays below the reported ε."""
    r = audit_digits_one_run(epsilon=8.0, scores="black", seed=0)
    assert 0 < r.epsilon_lb <= r.epsilon, r.report()
    assert r.epsilon == pytest.approx(8.0, abs=0.1)
    assert r.details["test_accuracy"] > 0.85


@pytest.mark.skipif(
    os.environ.get("DPTORCH_AUDIT_FULL") != "1", reason="set DPTORCH_AUDIT_FULL=1 for bigger audits"
)
@pytest.mark.slow
def test_digits_white_box_at_epsilon_8():
    """White-box scores (gradient alignment at each of the 480 steps): about 10 s."""
    r = audit_digits_one_run(epsilon=8.0, scores="white", seed=0)
    assert 0 < r.epsilon_lb <= r.epsilon, r.report()
