"""Shared machinery of the privacy-invariant tests: one DP step in any mode (noise 0, float64)
and the brute-force reference it must equal (each sample alone, clipped, summed)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from dptorch.grad_sample import wrap_model
from dptorch.optimizers import get_optimizer_class
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

MODES = ["hooks", "functorch", "ghost", "bk"]
#: every way to clip: the modes, per-layer clipping (hooks and bk) and multi-pass (hooks)
VARIANTS = MODES + ["hooks-per_layer", "bk-per_layer", "multi_pass"]


def variant_bounds(model: nn.Module, variant: str, c: float) -> float | list[float]:
    """``c``, or one bound per trainable parameter for the per-layer variants."""
    if variant.endswith("per_layer"):
        return [c] * len(unique_trainable(model))
    return c


def unique_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters`` (tied parameters once), trainable only."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def sample_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum()


def reference_update(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, bounds: float | list[float],
    batch_dim: int = 0,
) -> dict[str, torch.Tensor]:
    """``Σ_b clip(∇ loss_b)`` computed one sample at a time: flat clipping for a float bound,
    per-parameter clipping for a list (one bound per unique trainable parameter)."""
    named = unique_trainable(model)
    total = {n: torch.zeros_like(p) for n, p in named}
    for b in range(x.shape[batch_dim]):
        xb = x.narrow(batch_dim, b, 1)
        loss = sample_loss(model(xb), y[b : b + 1])
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)]
        if isinstance(bounds, list):
            factors = [min(1.0, c / (float(g.norm()) + 1e-6)) for g, c in zip(grads, bounds)]
        else:
            norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
            factors = [min(1.0, bounds / (norm + 1e-6))] * len(grads)
        for (n, _), g, f in zip(named, grads, factors):
            total[n] += f * g
    return total


def private_pair(
    model: nn.Module, mode: str, bounds: float | list[float], batch_size: int,
    *, batch_first: bool = True, multi: bool = False,
):
    """``(optimizer, wrapped module)`` of ``model`` in ``mode`` (SGD lr=1, noise 0, loss sum),
    paired as ``make_private`` pairs them: the fast modes clip with the optimizer's contract."""
    per_layer = isinstance(bounds, list)
    cls = get_optimizer_class("per_layer" if per_layer else "flat", False, mode)
    opt = cls(torch.optim.SGD([p for p in model.parameters()], lr=1.0), noise_multiplier=0.0,
              max_grad_norm=bounds, expected_batch_size=batch_size,
              loss_reduction="sum", **({"accum_passes": True} if multi else {}))
    gsm = wrap_model(model, mode, batch_first=batch_first, loss_reduction="sum",
                     **({"clipping": opt.clipping} if mode in ("ghost", "bk") else {}),
                     **({"multi_pass": True} if multi else {}))
    return opt, gsm


def dp_backward(gsm: nn.Module, opt, mode: str, out: torch.Tensor, y: torch.Tensor) -> None:
    """Back-propagates :func:`sample_loss` of ``out`` against ``y`` as ``mode`` requires
    (ghost: through its DP loss wrapper)."""
    if mode == "ghost":
        crit = DPLossFastGradientClipping(gsm, opt, nn.MSELoss(reduction="sum"), "sum")
        crit(out, y).backward()
    else:
        sample_loss(out, y).backward()


def dp_update(
    model: nn.Module, mode: str, x: torch.Tensor, y: torch.Tensor, bounds: float | list[float],
    *, batch_first: bool = True, between: Callable | None = None,
    before_backward: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """One DP-SGD step (SGD lr=1, noise 0, loss sum) of a deep copy of ``model`` in ``mode``;
    returns ``{name: before - after}``. ``before_backward(model, opt, gsm)`` and
    ``between(model, opt, gsm)`` run after wrapping and after the backward pass."""
    model = copy.deepcopy(model)
    mode = mode.split("-")[0]
    multi = mode == "multi_pass"
    mode = "hooks" if multi else mode
    opt, gsm = private_pair(model, mode, bounds, x.shape[0 if batch_first else 1],
                            batch_first=batch_first, multi=multi)
    if before_backward is not None:
        before_backward(model, opt, gsm)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    dp_backward(gsm, opt, mode, gsm(x), y)
    if between is not None:
        between(model, opt, gsm)
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def assert_exact_or_refused(model, mode, x, y, bounds, *, must_work: bool = False, **kw) -> str:
    """The DP step equals the brute-force reference (rel. 1e-7), or raises ``ValueError``.
    Returns ``"exact"`` or ``"refused"``; ``must_work`` forbids the refusal."""
    try:
        got = dp_update(model, mode, x, y, bounds, **kw)
    except ValueError as e:
        if must_work:
            raise
        assert str(e), "a refusal must say why"
        return "refused"
    ref = reference_update(copy.deepcopy(model), x, y, bounds,
                           batch_dim=0 if kw.get("batch_first", True) else 1)
    for n, r in ref.items():
        torch.testing.assert_close(got[n], r, rtol=1e-7, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")
    return "exact"
