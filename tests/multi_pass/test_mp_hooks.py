"""Forward / backward hooks switched off separately record no per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from mp_helpers import IN_DIM, make_disc

from dptorch import GradSampleModule


def _x(b=3, seed=0):
    return torch.randn(
        b, IN_DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


@pytest.mark.parametrize("which", ["forward", "backward", "all"])
def test_disabled_hooks_record_nothing(which):
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    gsm(_x()).sum().backward()
    before = [p.grad_sample.clone() for p in model.parameters()]
    off = {
        "forward": gsm.disable_forward_hooks,
        "backward": gsm.disable_backward_hooks,
        "all": gsm.disable_hooks,
    }[which]
    on = {
        "forward": gsm.enable_forward_hooks,
        "backward": gsm.enable_backward_hooks,
        "all": gsm.enable_hooks,
    }[which]
    off()
    out = gsm(_x(5, seed=1)).sum()
    out.backward()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.grad_sample, b)  # no new pass, values untouched
    on()
    gsm(_x(2, seed=2)).sum().backward()
    assert model[0].weight.grad_sample.shape[:2] == (2, 3)


def test_backward_hooks_checked_at_backward_time():
    """Forward with hooks on, backward with them off: the recorded graph stays inert."""
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    out = gsm(_x()).sum()
    gsm.disable_backward_hooks()
    out.backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert model[0].weight.grad is not None  # ordinary gradients still flow


def test_generator_update_through_disabled_discriminator():
    torch.manual_seed(0)
    gen = torch.nn.Linear(2, IN_DIM, dtype=torch.float64)
    model = make_disc()
    gsm = GradSampleModule(model, multi_pass=True, loss_reduction="sum")
    gsm(_x()).sum().backward()  # the discriminator's real pass
    gsm.disable_hooks()
    z = torch.randn(7, 2, dtype=torch.float64)
    (-gsm(gen(z)).sum()).backward()
    gsm.enable_hooks()
    assert model[0].weight.grad_sample.shape[:2] == (1, 3)
    assert gen.weight.grad is not None and gen.weight.grad.abs().sum() > 0
    assert not hasattr(gen.weight, "grad_sample")
