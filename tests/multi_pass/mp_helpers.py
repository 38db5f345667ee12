"""Shared helpers of the multi-pass tests: a small float64 discriminator and brute-force
per-sample gradients computed one sample at a time with plain autograd (no dptorch code)."""

from __future__ import annotations

import torch
from torch import nn

from dptorch import GradSampleModule
from dptorch.optimizers import DPOptimizer

IN_DIM = 4


def make_disc(seed: int = 0) -> nn.Module:
    """A tiny discriminator (two Linear layers), float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_DIM, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def brute_per_sample_grads(model: nn.Module, x: torch.Tensor, sign: float = 1.0) -> list:
    """``[(B, *p.shape) per parameter]``: gradient of ``sign * model(x_b).sum()`` per sample.

    ``model`` must not be wrapped in a GradSampleModule (its hooks would record these passes):
    use an identical copy, e.g. ``make_disc(seed)`` again."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [[] for _ in params]
    for b in range(x.shape[0]):
        out = sign * model(x[b : b + 1]).sum()
        gs = torch.autograd.grad(out, params, allow_unused=True)
        for i, (p, g) in enumerate(zip(params, gs)):
            rows[i].append(torch.zeros_like(p) if g is None else g)
    return [torch.stack(r) if r else p.new_zeros((0, *p.shape)) for r, p in zip(rows, params)]


def clip_units(units: list[torch.Tensor], c: float) -> list[torch.Tensor]:
    """Flat clipping of units stacked on dim 0 (one list entry per parameter)."""
    n = torch.sqrt(sum(u.flatten(1).pow(2).sum(1) for u in units))
    f = (c / (n + 1e-6)).clamp(max=1.0)
    return [u * f.view(-1, *([1] * (u.dim() - 1))) for u in units]


def reference_sum(
    model: nn.Module, passes: list[tuple[torch.Tensor, float]], c: float, accum: bool
) -> list[torch.Tensor]:
    """Independent pre-noise sum: passes are ``(inputs, sign)``; ``accum`` sums per sample index
    (zero padding shorter passes) then clips, else clips every (pass, sample) then sums."""
    per_pass = [brute_per_sample_grads(model, x, s) for x, s in passes]
    params = [p for p in model.parameters() if p.requires_grad]
    if accum:
        b = max(x.shape[0] for x, _ in passes)
        units = [p.new_zeros((b, *p.shape)) for p in params]
        for gp in per_pass:
            for i, g in enumerate(gp):
                units[i][: g.shape[0]] += g
        return [u.sum(0) for u in clip_units(units, c)]
    total = [torch.zeros_like(p) for p in params]
    for gp in per_pass:
        for i, u in enumerate(clip_units(gp, c)):
            total[i] += u.sum(0)
    return total


def run_passes(gsm: GradSampleModule, passes: list[tuple[torch.Tensor, float]]) -> None:
    """One backward pass per ``(inputs, sign)``: loss ``sign * gsm(x).sum()``."""
    for x, s in passes:
        (s * gsm(x).sum()).backward()


def make_optimizer(gsm: nn.Module, **kw) -> DPOptimizer:
    """A DPOptimizer over SGD(lr=0) with ``loss_reduction='sum'`` and no noise unless given."""
    kw.setdefault("noise_multiplier", 0.0)
    kw.setdefault("max_grad_norm", 1.0)
    kw.setdefault("expected_batch_size", None)
    kw.setdefault("loss_reduction", "sum")
    return DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), **kw)
