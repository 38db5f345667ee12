"""Checking per-sample gradients against microbatch (one sample at a time) gradients.

The loss used throughout is the sum of the model's outputs per sample, reduced over the batch by
``loss_reduction``. For both reductions the per-sample gradient of sample ``b`` is then the
gradient of ``model(x_b).sum()``, which is what the microbatch reference computes.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from .utils import wrap_model

logger = logging.getLogger(__name__)

__all__ = ["check_per_sample_gradients_are_correct", "compute_grad_samples", "compute_microbatch_grad_sample"]


def _batch_dim(batch_first: bool) -> int:
    return 0 if batch_first else 1


def compute_microbatch_grad_sample(
    x: torch.Tensor,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """Per-sample gradients by running each sample alone through a copy of ``module``.

    Args:
        x: the batch, ``(B, ...)`` (``(T, B, ...)`` if not ``batch_first``).
        module: the model; it is not modified.
        loss_reduction: accepted for symmetry; the per-sample convention makes it irrelevant.

    Returns:
        ``{parameter name: (B, *p.shape)}`` for every parameter with ``requires_grad``.
    """
    bdim = _batch_dim(batch_first)
    module = copy.deepcopy(module)
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    per_sample: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for b in range(x.shape[bdim]):
        out = module(x.narrow(bdim, b, 1))
        grads = torch.autograd.grad(out.sum(), list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            per_sample[n].append(torch.zeros_like(p) if g is None else g)
    return {
        n: torch.stack(v) if v else p.new_zeros((0, *p.shape))
        for (n, v), p in zip(per_sample.items(), params.values())
    }


def compute_grad_samples(
    x: torch.Tensor,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a copy of ``module`` wrapped for ``grad_sample_mode``.

    Returns ``{parameter name: p.grad_sample}`` for every parameter with ``requires_grad``.
    """
    bdim = _batch_dim(batch_first)
    gsm = wrap_model(
        copy.deepcopy(module),
        grad_sample_mode,
        batch_first=batch_first,
        loss_reduction=loss_reduction,
    )
    out = gsm(x)
    loss = out.sum()
    if loss_reduction == "mean":
        loss = loss / x.shape[bdim]
    loss.backward()
    return {
        n: p.grad_sample for n, p in gsm._module.named_parameters() if p.requires_grad
    }


def check_per_sample_gradients_are_correct(
    x: torch.Tensor,
    module: nn.Module,
    batch_first: bool = True,
    atol: float = 10e-6,
    rtol: float = 10e-5,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
) -> bool:
    """Whether ``grad_sample_mode`` gives ``module`` the same per-sample gradients as running each
    sample of ``x`` alone (within ``atol``/``rtol``, as ``torch.allclose``).

    Args:
        x: the batch, ``(B, ...)`` (``(T, B, ...)`` if not ``batch_first``).
        module: the model (copied, not modified). Use float64 for tight tolerances.
        grad_sample_mode: ``"hooks"``, ``"functorch"``, ``"ew"`` or a registered mode.

    Returns:
        ``True`` if every trainable parameter matches; mismatches are logged with their size.
    """
    if grad_sample_mode == "ew" and not batch_first:
        raise ValueError("grad_sample_mode='ew' supports only batch_first=True")
    reference = compute_microbatch_grad_sample(x, module, batch_first, loss_reduction)
    computed = compute_grad_samples(x, module, batch_first, loss_reduction, grad_sample_mode)
    ok = True
    for name, ref in reference.items():
        got = computed.get(name)
        if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
            logger.warning(
                "%s: grad_sample %s, expected shape %s",
                name,
                None if got is None else getattr(got, "shape", type(got).__name__),
                tuple(ref.shape),
            )
            ok = False
        elif not torch.allclose(got, ref, atol=atol, rtol=rtol):
            logger.warning(
                "%s: max |grad_sample - microbatch| = %.3g", name, (got - ref).abs().max().item()
            )
            ok = False
    return ok
