"""Seventh review round: silent failures found and fixed, each tried against the brute-force
per-sample computation (float64, noise 0) or shown to be refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleModule
from dptorch.optimizers import DPOptimizer

DT = torch.float64


def test_per_sample_rows_of_different_lengths_are_refused_not_padded():
    """*Finding*: per-sample gradients with fewer rows for one parameter (set by hand, or two
    wrapped models fed batches of different sizes under one optimizer) were zero-padded up to the
    longest, so row ``i`` of each parameter was clipped as one sample although nothing says the
    rows are the same records. Opacus fails on them (``torch.stack``); dptorch refuses with a
    ValueError that says why."""
    a, b = nn.Linear(3, 2).to(DT), nn.Linear(3, 2).to(DT)
    opt = DPOptimizer(
        torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    ga, gb = GradSampleModule(a), GradSampleModule(b)
    ga(torch.randn(4, 3, dtype=DT)).sum().backward()
    gb(torch.randn(3, 3, dtype=DT)).sum().backward()
    before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
    with pytest.raises(ValueError, match="different numbers of rows"):
        opt.step()
    for p, q in zip([*a.parameters(), *b.parameters()], before):
        assert torch.equal(p, q)


def test_equal_rows_under_one_optimizer_still_clip_jointly():
    """Two wrapped models with the same batch size under one optimizer: row ``i`` of both is
    clipped as one sample (the joint norm), as in Opacus."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2).to(DT), nn.Linear(3, 2).to(DT)
    opt = DPOptimizer(
        torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=0.3,
        expected_batch_size=4,
    )
    ga, gb = GradSampleModule(a), GradSampleModule(b)
    xa, xb = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    ga(xa).sum().backward()
    gb(xb).sum().backward()
    params = [*a.parameters(), *b.parameters()]
    gs = [p.grad_sample.reshape(4, -1) for p in params]
    norms = torch.cat(gs, dim=1).norm(dim=1)
    f = (0.3 / (norms + 1e-6)).clamp(max=1.0)
    want = [p.detach() - torch.einsum("b,b...->...", f, p.grad_sample) / 4 for p in params]
    opt.step()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12)
