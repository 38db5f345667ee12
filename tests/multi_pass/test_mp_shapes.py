"""Multi-pass per-sample gradients: one slice per backward pass, values exact (float64)."""

from __future__ import annotations

import pytest
import torch
from mp_helpers import IN_DIM, brute_per_sample_grads, make_disc

from dptorch import GradSampleModule


@pytest.mark.parametrize("force_functorch", [False, True], ids=["hooks", "functorch"])
@pytest.mark.parametrize("sizes", [(4,), (4, 4), (3, 5, 2)], ids=["1pass", "2pass", "3pass"])
@pytest.mark.parametrize("loss_reduction", ["sum", "mean"])
def test_pass_slices_match_brute_force(force_functorch, sizes, loss_reduction):
    model = make_disc()
    gsm = GradSampleModule(
        model, multi_pass=True, force_functorch=force_functorch, loss_reduction=loss_reduction
    )
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, IN_DIM, generator=gen, dtype=torch.float64) for b in sizes]
    signs = [1.0, -1.0, 0.5][: len(sizes)]
    for x, s in zip(xs, signs):
        out = s * gsm(x)
        (out.mean() if loss_reduction == "mean" else out.sum()).backward()
    params = list(model.parameters())
    b_max = max(sizes)
    for k, (x, s) in enumerate(zip(xs, signs)):
        ref = brute_per_sample_grads(make_disc(), x, s)  # an identical, unwrapped model
        for p, r in zip(params, ref):
            assert p.grad_sample.shape == (len(sizes), b_max, *p.shape)
            torch.testing.assert_close(p.grad_sample[k, : x.shape[0]], r, rtol=1e-10, atol=1e-12)
            assert torch.count_nonzero(p.grad_sample[k, x.shape[0] :]) == 0
    # the sum over passes and samples is the ordinary gradient (up to the mean's 1/B)
    for p in params:
        if loss_reduction == "sum":
            torch.testing.assert_close(p.grad_sample.sum((0, 1)), p.grad, rtol=1e-10, atol=1e-12)


def test_single_pass_default_shape_unchanged():
    model = make_disc()
    gsm = GradSampleModule(model, loss_reduction="sum")
    x = torch.randn(6, IN_DIM, dtype=torch.float64)
    gsm(x).sum().backward()
    for p, r in zip(model.parameters(), brute_per_sample_grads(make_disc(), x)):
        assert p.grad_sample.shape == (6, *p.shape)
        torch.testing.assert_close(p.grad_sample, r)


def test_pass_reaching_only_some_layers_gets_zero_slice():
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    x = torch.randn(3, IN_DIM, dtype=torch.float64)
    h = torch.randn(2, 5, dtype=torch.float64)
    gsm(x).sum().backward()
    model[2](h).sum().backward()  # second pass only through the last layer
    first, last = model[0].weight, model[2].weight
    assert first.grad_sample.shape == (2, 3, *first.shape)
    assert torch.count_nonzero(first.grad_sample[1]) == 0
    torch.testing.assert_close(last.grad_sample[1, :2], torch.ones(2, 1, 1) * h[:, None, :])
    assert [r.batch_size for r in gsm.record.passes] == [3, 2]
    assert [id(first) in r.covered for r in gsm.record.passes] == [True, False]
    assert [id(last) in r.covered for r in gsm.record.passes] == [True, True]


def test_zero_grad_starts_new_passes():
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True)
    for _ in range(2):
        gsm(torch.randn(3, IN_DIM, dtype=torch.float64)).sum().backward()
    gsm.zero_grad()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    gsm(torch.randn(2, IN_DIM, dtype=torch.float64)).sum().backward()
    assert model[0].weight.grad_sample.shape[:2] == (1, 2)
