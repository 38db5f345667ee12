"""Under Poisson sampling, the fast-clipping modes refuse a second backward without a step,
exactly like hooks mode (two Poisson batches are not one)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def _make(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        criterion=nn.CrossEntropyLoss(),
    )
    if mode == "ghost":
        model, optimizer, criterion, _ = out
    else:
        model, optimizer, _ = out
        criterion = nn.CrossEntropyLoss()
    return model, optimizer, criterion


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_second_backward_without_step_raises(mode):
    model, optimizer, criterion = _make(mode)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    criterion(model(x), y).backward()
    with pytest.raises(ValueError, match="second backward"):
        criterion(model(x), y).backward()


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_step_then_backward_is_allowed(mode):
    model, optimizer, criterion = _make(mode)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        criterion(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_backward_after_step_without_zero_grad_raises(mode):
    """p.grad still holds the released noisy gradient after step(): a backward pass without
    zero_grad() would add the next clipped sum to it."""
    model, optimizer, criterion = _make(mode)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    criterion(model(x), y).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="zero_grad"):
        criterion(model(x), y).backward()
