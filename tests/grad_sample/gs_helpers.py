"""Brute-force per-sample gradients for the grad-sample tests.

Reference: each sample alone through a copy of the model (float64, plain autograd), with the
loss ``sum(model(x_b) * R_b)`` for a fixed random ``R``; the batched run uses
``sum(model(x) * R)`` (divided by ``B`` for ``loss_reduction="mean"``), so the per-sample
gradients must equal the reference for both reductions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dptorch.grad_sample import wrap_model

MODES = ("hooks", "functorch", "ew")
RTOL = 1e-6
ATOL = 1e-9


def _narrow_batch(inputs: Sequence, bdim: int, b: int, batch_size: int) -> tuple:
    return tuple(
        a.narrow(bdim, b, 1)
        if isinstance(a, torch.Tensor) and a.dim() > bdim and a.shape[bdim] == batch_size
        else a
        for a in inputs
    )


def brute_force_grad_samples(
    model: nn.Module,
    inputs: Sequence,
    out_weights: torch.Tensor,
    batch_first: bool = True,
    sample_inputs: Callable[[int], tuple] | None = None,
    kwargs: dict | None = None,
) -> dict[str, torch.Tensor]:
    """``{name: (B, *p.shape)}``: gradient of ``sum(model(x_b) * R_b)`` for each sample alone."""
    bdim = 0 if batch_first else 1
    batch_size = out_weights.shape[bdim]
    kwargs = kwargs or {}
    per_sample: dict[str, list] = {}
    for b in range(batch_size):
        m = copy.deepcopy(model)
        args = sample_inputs(b) if sample_inputs else _narrow_batch(inputs, bdim, b, batch_size)
        kw = dict(zip(kwargs, _narrow_batch(list(kwargs.values()), bdim, b, batch_size)))
        out = m(*args, **kw)
        (out * out_weights.narrow(bdim, b, 1)).sum().backward()
        for n, p in m.named_parameters():
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                per_sample.setdefault(n, []).append(g.clone())
    return {n: torch.stack(v) for n, v in per_sample.items()}


def run_grad_sample_module(
    model: nn.Module,
    inputs: Sequence,
    mode: str,
    batch_first: bool = True,
    loss_reduction: str = "sum",
    seed: int = 0,
    kwargs: dict | None = None,
):
    """Wraps a copy of ``model`` for ``mode``, runs one forward/backward and returns
    ``(gsm, R)`` with ``R`` the random output weights used in the loss."""
    gsm = wrap_model(
        copy.deepcopy(model), mode, batch_first=batch_first, loss_reduction=loss_reduction
    )
    out = gsm(*inputs, **(kwargs or {}))
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    loss = (out * r).sum()
    if loss_reduction == "mean":
        loss = loss / out.shape[0 if batch_first else 1]
    loss.backward()
    return gsm, r


def assert_grad_samples_match(
    model: nn.Module,
    inputs: Sequence,
    mode: str,
    batch_first: bool = True,
    loss_reduction: str = "sum",
    sample_inputs: Callable[[int], tuple] | None = None,
    kwargs: dict | None = None,
    brute_kwargs: bool = True,
    check_reduced: bool = True,
) -> None:
    """grad_sample of every trainable parameter equals the brute force, and its sum (``"sum"``)
    or mean (``"mean"``) over the batch equals ``p.grad``.

    ``sample_inputs(b)`` gives sample ``b``'s positional inputs when slicing the batch dimension
    does not (EmbeddingBag offsets); ``brute_kwargs=False`` keeps ``kwargs`` out of those calls.
    ``check_reduced=False`` skips the ``p.grad`` check (``scale_grad_by_freq`` couples samples).
    """
    gsm, r = run_grad_sample_module(model, inputs, mode, batch_first, loss_reduction, kwargs=kwargs)
    ref = brute_force_grad_samples(
        model, inputs, r, batch_first, sample_inputs, kwargs=kwargs if brute_kwargs else None
    )
    params = dict(gsm._module.named_parameters())
    assert set(ref) == {n for n, p in params.items() if p.requires_grad}
    for name, expected in ref.items():
        p = params[name]
        assert isinstance(p.grad_sample, torch.Tensor), name
        torch.testing.assert_close(p.grad_sample, expected, rtol=RTOL, atol=ATOL, msg=name)
        if not check_reduced:
            continue
        reduced = p.grad_sample.mean(0) if loss_reduction == "mean" else p.grad_sample.sum(0)
        assert p.grad is not None, name
        torch.testing.assert_close(reduced, p.grad, rtol=RTOL, atol=ATOL, msg=name)
