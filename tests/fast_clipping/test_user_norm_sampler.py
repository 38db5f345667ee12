"""A norm sampler registered by a user with Opacus's convention (it returns per-sample norms,
not squared norms) drives ghost/bk clipping correctly."""

import copy

import pytest
import torch
from torch import nn

from dptorch.grad_sample import (
    GRAD_SAMPLERS,
    NORM_SAMPLERS,
    register_grad_sampler,
    register_norm_sampler,
)
from dptorch.grad_sample.utils import wrap_model


class Scale(nn.Module):
    """y = x * w (elementwise), a layer dptorch has no sampler for."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, x):
        return x * self.w


@pytest.fixture
def scale_samplers():
    @register_grad_sampler(Scale)
    def _gs(layer, activations, backprops):
        return {layer.w: activations[0] * backprops}

    @register_norm_sampler(Scale)
    def _ns(layer, activations, backprops):
        return {layer.w: (activations[0] * backprops).norm(dim=1)}

    yield
    GRAD_SAMPLERS.pop(Scale)
    NORM_SAMPLERS.pop(Scale)


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_user_norm_sampler_gives_exact_norms(scale_samplers, mode):
    torch.manual_seed(0)
    model = nn.Sequential(Scale(4), nn.Linear(4, 2, dtype=torch.float64))
    x = 3 * torch.randn(6, 4, dtype=torch.float64)
    reference = copy.deepcopy(model)
    gsm = wrap_model(model, mode, batch_first=True, loss_reduction="sum", max_grad_norm=1e9)
    if mode == "ghost":
        gsm.norm_backward(gsm(x).pow(2).sum())
    else:
        gsm(x).pow(2).sum().backward()
    norms = gsm.per_sample_gradient_norms
    brute = []
    for i in range(6):
        out = reference(x[i : i + 1]).pow(2).sum()
        g = torch.autograd.grad(out, list(reference.parameters()))
        brute.append(torch.sqrt(sum(t.pow(2).sum() for t in g)))
    torch.testing.assert_close(norms.flatten(), torch.stack(brute), rtol=1e-9, atol=1e-12)
