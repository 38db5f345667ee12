"""Shared helpers of the fast-clipping tests: reference DP-SGD updates from materialised
per-sample gradients (hooks mode) and the same step in the ghost / bk modes."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.optimizers import DPOptimizer, get_optimizer_class
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

SIGMA = 0.7


def reference_norms(model: nn.Module, criterion, x, y, batch_first: bool = True) -> torch.Tensor:
    """Per-sample gradient norms from materialised per-sample gradients (hooks mode)."""
    gsm = wrap_model(copy.deepcopy(model), "hooks", batch_first=batch_first, loss_reduction="sum")
    crit = copy.deepcopy(criterion)
    crit.reduction = "sum"
    crit(gsm(x), y).backward()
    sq = [p.grad_sample.flatten(1).pow(2).sum(1) for p in gsm.parameters() if p.requires_grad
          and getattr(p, "grad_sample", None) is not None]
    return torch.stack(sq).sum(0).sqrt()


def dp_step(model, mode, criterion, batches, *, C=1.0, seed=0, clipping="flat",
            expected_batch_size=None, batch_first=True, skip_between=True, wrapper=True):
    """Runs one DP-SGD step over ``batches`` (physical batches of one logical batch; with
    ``skip_between`` each but the last is a skipped step as in BatchMemoryManager, else they are
    accumulated by several backward passes). Returns (model, gsm)."""
    model = copy.deepcopy(model)
    criterion = copy.deepcopy(criterion)
    gsm = wrap_model(model, mode, batch_first=batch_first, loss_reduction=criterion.reduction,
                     **({"max_grad_norm": C} if mode in ("ghost", "bk") else {}))
    cls = get_optimizer_class(clipping, False, mode)
    opt = cls(
        torch.optim.SGD([p for p in gsm.parameters() if p.requires_grad], lr=1.0),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        expected_batch_size=expected_batch_size or sum(len(b[1]) for b in batches),
        loss_reduction=criterion.reduction,
        generator=torch.Generator().manual_seed(seed),
    )
    if mode == "ghost" or (mode == "bk" and wrapper):
        crit = DPLossFastGradientClipping(gsm, opt, criterion, criterion.reduction)
    else:
        crit = criterion
    opt.zero_grad()
    for i, (x, y) in enumerate(batches):
        crit(gsm(x), y).backward()
        if skip_between:
            if i < len(batches) - 1:
                opt.signal_skip_step(True)
            opt.step()
            opt.zero_grad()
    if not skip_between:
        opt.step()
    return model, gsm


def assert_same_params(m1: nn.Module, m2: nn.Module, atol=1e-9) -> None:
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-7, msg=lambda s, n=n: f"{n}: {s}")


__all__ = ["DPOptimizer", "assert_same_params", "dp_step", "reference_norms"]
