"""The DP optimizer reads the wrapped optimizer's param groups: every group it updates is
clipped and noised, also one added after ``load_state_dict`` (a layer unfrozen on resume)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

D, K = 5, 3


def _model() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D, 6), nn.Tanh())
    model.fc = nn.Linear(6, K)
    return model.double()


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, D, generator=g, dtype=torch.float64), torch.randint(0, K, (8,), generator=g)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_groups_added_after_load_state_dict_are_clipped(mode):
    """load_state_dict replaces the wrapped optimizer's param_groups list; the DP optimizer
    reads that list at every access, so a group added afterwards (a layer unfrozen after a
    resume) is clipped like the others. Before, the DP optimizer kept the old list and the
    wrapped optimizer updated the new group with its raw gradient."""
    model = _model()
    model.fc.requires_grad_(False)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    kw = dict(noise_multiplier=0.0, max_grad_norm=1e-3, expected_batch_size=8)
    if mode == "bk":
        gsm = wrap_model(model, "bk", max_grad_norm=1e-3)
        opt = DPOptimizerFastGradientClipping(sgd, **kw)
        gsm.bind_clipping(opt.clipping)
    else:
        gsm, opt = wrap_model(model, "hooks"), DPOptimizer(sgd, **kw)
    opt.load_state_dict(opt.state_dict())
    model.fc.requires_grad_(True)
    opt.add_param_group({"params": list(model.fc.parameters())})
    assert opt.param_groups is opt.original_optimizer.param_groups
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch()
    F.cross_entropy(gsm(x), y).backward()
    opt.step()
    update = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before)])
    assert update.norm() <= 1e-3 * (1 + 1e-6)  # lr · C: every record clipped to C, mean of 8
