"""Noise std of both multi-pass modes (chi-square bounds) and one accounting step per step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from scipy import stats
from torch import nn

from dptorch import GradSampleModule
from dptorch.optimizers import DPOptimizer


def _noise_only_step(accum: bool, k: int, sigma: float, c: float, n_passes: int):
    """Runs ``n_passes`` passes whose per-sample gradients are all zero, so ``p.grad`` is the
    noise alone; returns it flattened."""
    torch.manual_seed(0)
    model = nn.Linear(60, 50, dtype=torch.float64)
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    kw = {"accum_passes": True} if accum else {"accum_passes": False, "num_private_passes": k}
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=sigma,
        max_grad_norm=c,
        expected_batch_size=None,
        loss_reduction="sum",
        generator=torch.Generator().manual_seed(123),
        **kw,
    )
    for i in range(n_passes):
        public = not accum and i >= k  # passes beyond the k private ones are declared public
        with gsm.public_pass() if public else contextlib.nullcontext():
            (0.0 * gsm(torch.randn(4, 60, dtype=torch.float64))).sum().backward()
    opt.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), opt


@pytest.mark.parametrize(
    "accum, k, n_passes, factor",
    [(True, None, 3, 1), (False, 1, 2, 1), (False, 3, 3, 3)],
    ids=["accum", "split-k1", "split-k3"],
)
def test_noise_std(accum, k, n_passes, factor):
    sigma, c = 0.8, 2.5
    noise, opt = _noise_only_step(accum, k, sigma, c, n_passes)
    expected = sigma * c * factor
    assert opt.noise_std == pytest.approx(expected)
    n = noise.numel()  # 3050 coordinates
    stat = (noise.pow(2).sum() / expected**2).item()  # chi2(n) under N(0, expected^2)
    lo, hi = stats.chi2.ppf([1e-5, 1 - 1e-5], n)
    assert lo < stat < hi, (stat, lo, hi)
    assert abs(noise.mean().item()) < 5 * expected / n**0.5


def _gan_like_step(gsm, opt, n_passes):
    for _ in range(n_passes):
        gsm(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    assert opt.accumulated_iterations == 1
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("n_passes", [1, 2, 3])
def test_one_accounting_step_per_optimizer_step(n_passes):
    model = nn.Linear(4, 2, dtype=torch.float64)
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=3,
        accum_passes=False,
        num_private_passes=n_passes,
    )
    calls = []
    opt.attach_step_hook(lambda o: calls.append(o.noise_std))
    for _ in range(4):
        _gan_like_step(gsm, opt, n_passes)
    assert calls == [float(n_passes)] * 4


def test_skipped_physical_steps_accumulate_into_one_step():
    """BatchMemoryManager-style: two physical batches (two passes each), one logical step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2, dtype=torch.float64)
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=1e6,
        expected_batch_size=None,
        loss_reduction="sum",
        accum_passes=True,
    )
    calls = []
    opt.attach_step_hook(lambda o: calls.append(1))
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(4)]
    for i in range(2):
        opt.signal_skip_step(i == 0)
        for x in xs[2 * i : 2 * i + 2]:
            gsm(x).sum().backward()
        opt.step()
        assert len(calls) == i  # the skipped step is not accounted
        if i == 0:
            opt.zero_grad()  # keeps summed_grad after a skipped step
    # no clipping (C huge), no noise: the released gradient is the plain sum of the 4 passes
    expected_w = sum((torch.ones(3, 2, 1) * x[:, None, :]).sum(0) for x in xs)
    torch.testing.assert_close(model.weight.grad, expected_w)
    assert opt.accumulated_iterations == 1
