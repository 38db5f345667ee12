"""Per-sample gradients stay exact when a layer's output is modified in place afterwards
(``nn.ReLU(inplace=True)``, ``x += ...``): the hooks read the gradient of the layer's output
as autograd delivers it, before any in-place op on it is undone."""

import pytest
import torch
from torch import nn

from dptorch import GradSampleModule

F64 = torch.float64


class InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.fc1 = nn.Linear(3 * 4 * 4, 5)
        self.fc2 = nn.Linear(5, 5)

    def forward(self, x):
        h = self.relu(self.conv(x)).flatten(1)
        h = self.fc1(h)
        h.mul_(2.0)  # in place on a hooked layer's output
        h = torch.tanh(h)
        h2 = self.fc2(h)
        h2 += h  # in-place residual
        return h2


def brute_force(model, x, reduction):
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        out = model(x[i : i + 1]).pow(2).sum()
        rows.append(torch.autograd.grad(out, list(model.parameters())))
    return [torch.stack(g) for g in zip(*rows)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("force_functorch", [False, True])
def test_inplace_ops_after_hooked_layers(reduction, force_functorch):
    torch.manual_seed(0)
    model = InplaceNet().to(F64)
    x = torch.randn(5, 2, 4, 4, dtype=F64)
    expected = brute_force(model, x, reduction)
    gsm = GradSampleModule(model, loss_reduction=reduction, force_functorch=force_functorch)
    per_sample = gsm(x).pow(2).sum(1)
    (per_sample.sum() if reduction == "sum" else per_sample.mean()).backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad_sample, e, rtol=1e-9, atol=1e-12)
