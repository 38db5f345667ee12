"""Checking a model's per-sample gradients against microbatches (Opacus's
``per_sample_gradients_utils``, at ``dptorch.utils.per_sample_gradients_utils``).

The loss is Opacus's testing loss, :class:`ModelWithLoss`: the L1 distance of the outputs to
zero, reduced by ``loss_reduction``. With ``"sum"`` a sample's per-sample gradient is the
gradient of ``Σ |out_b|``; with ``"mean"`` of the mean of ``|out_b|`` over its elements (the
module's ``1/B`` is undone by the GradSampleModule). The microbatch reference runs each sample
alone through a clone of the model, so it computes exactly that, slowly and obviously right.

Every dptorch mode can be checked: hooks, functorch and ew by their ``p.grad_sample``; ghost and
bk, which never build per-sample gradients, by their per-sample gradient norms.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..utils.packed_sequences import compute_seq_lengths
from .norm_samplers import sq_norms
from .utils import wrap_model

logger = logging.getLogger(__name__)

__all__ = [
    "ModelWithLoss",
    "check_per_sample_gradients_are_correct",
    "clone_module",
    "compute_grad_samples",
    "compute_grad_samples_microbatch_and_opacus",
    "compute_microbatch_grad_sample",
    "compute_microbatch_grad_sample_tensor_or_seq",
    "compute_opacus_grad_sample",
    "compute_per_sample_norms",
    "get_grad_sample_modes",
    "is_batch_empty",
    "unpack_packedsequences",
]

#: modes that never build ``p.grad_sample``: checked through their per-sample norms
_NORM_ONLY = ("ghost", "bk")


def clone_module(module: nn.Module) -> nn.Module:
    """A copy of ``module`` made by serialising it (works where ``copy.deepcopy`` does not)."""
    with io.BytesIO() as buf:
        torch.save(module, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)


def is_batch_empty(batch: torch.Tensor | Iterable[torch.Tensor]) -> bool:
    """Whether the batch (a tensor, or a sequence whose first entry is the input) has no data."""
    first = batch if isinstance(batch, torch.Tensor) else next(iter(batch))
    return first.numel() == 0


def unpack_packedsequences(X: PackedSequence) -> list[torch.Tensor]:
    """The sequences of a ``PackedSequence``, each ``(T_i, ...)``, longest first (the packed
    order; Opacus's convention)."""
    padded = pad_packed_sequence(X, batch_first=True)[0]
    lengths = compute_seq_lengths(X.batch_sizes)  # longest first, i.e. in sorted order
    if X.sorted_indices is not None:
        padded = padded[X.sorted_indices]
    else:
        lengths = sorted(lengths, reverse=True)
    return [padded[i, :n] for i, n in enumerate(lengths)]


class ModelWithLoss(nn.Module):
    """``module`` followed by Opacus's testing loss: ``L1(module(x), 0)`` with
    ``loss_reduction`` (``"mean"`` or ``"sum"``). A tuple ``x`` is unpacked into the call; a
    ``PackedSequence`` output is reduced per sequence under ``"mean"``."""

    supported_reductions = ["mean", "sum"]

    def __init__(self, module: nn.Module, loss_reduction: str = "mean"):
        super().__init__()
        if loss_reduction not in self.supported_reductions:
            raise ValueError(
                f"Passed loss_reduction={loss_reduction}. Only {self.supported_reductions} supported."
            )
        self.wrapped_module = module
        self.criterion = nn.L1Loss(reduction=loss_reduction)

    def forward(self, x):
        out = self.wrapped_module(*x) if isinstance(x, tuple) else self.wrapped_module(x)
        if isinstance(out, PackedSequence):
            if self.criterion.reduction == "sum":
                return self.criterion(out.data, torch.zeros_like(out.data))
            seqs = unpack_packedsequences(out)
            return sum(self.criterion(s, torch.zeros_like(s)) for s in seqs) / len(seqs)
        return self.criterion(out, torch.zeros_like(out))


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def compute_microbatch_grad_sample(
    x: torch.Tensor | list[torch.Tensor],
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    chunk_method: Callable = iter,
) -> dict[str, torch.Tensor]:
    """Per-sample gradients by running each sample alone through a clone of ``module``.

    Args:
        x: the batch ``(B, ...)`` (``(T, B, ...)`` without ``batch_first``), or a list of
            samples (e.g. :func:`unpack_packedsequences`); tuples yielded by ``chunk_method``
            are passed as they are (EmbeddingBag inputs).

    Returns:
        ``{parameter name: (B, *p.shape)}`` for every trainable parameter (always batch first).
    """
    model = ModelWithLoss(clone_module(module), loss_reduction)
    params = _trainable(model.wrapped_module)
    if not batch_first and isinstance(x, torch.Tensor):
        x = x.transpose(0, 1)
    per_sample: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for x_i in chunk_method(x):
        if not isinstance(x_i, tuple):
            x_i = x_i.unsqueeze(0 if batch_first else 1)
        grads = torch.autograd.grad(model(x_i), list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            per_sample[n].append(torch.zeros_like(p) if g is None else g.detach())
    return {
        n: torch.stack(v) if v else p.new_zeros((0, *p.shape))
        for (n, v), p in zip(per_sample.items(), params.values())
    }


def compute_microbatch_grad_sample_tensor_or_seq(
    x: torch.Tensor | PackedSequence,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """:func:`compute_microbatch_grad_sample`, a ``PackedSequence`` unpacked into samples."""
    if isinstance(x, PackedSequence):
        x = unpack_packedsequences(x)
    return compute_microbatch_grad_sample(x, module, batch_first, loss_reduction)


def _backward_through(x, module, batch_first, loss_reduction, grad_sample_mode, **kw):
    gsm = wrap_model(
        clone_module(module), grad_sample_mode, batch_first=batch_first,
        loss_reduction=loss_reduction, **kw,
    )
    loss = ModelWithLoss(gsm, loss_reduction)(x)
    if grad_sample_mode == "ghost":
        gsm.norm_backward(loss)
    else:
        loss.backward()
    return gsm


def compute_opacus_grad_sample(
    x: torch.Tensor | PackedSequence,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
) -> dict[str, torch.Tensor]:
    """``{parameter name: p.grad_sample (B, *p.shape)}`` from ``grad_sample_mode`` on a clone of
    ``module`` (Opacus's name). Ghost and bk build no per-sample gradients: use
    :func:`compute_per_sample_norms` for them."""
    if grad_sample_mode in _NORM_ONLY:
        raise ValueError(
            f"grad_sample_mode={grad_sample_mode!r} computes per-sample norms, never per-sample "
            "gradients; use compute_per_sample_norms (check_per_sample_gradients_are_correct "
            "does so for it)."
        )
    gsm = _backward_through(x, module, batch_first, loss_reduction, grad_sample_mode)
    return {n: p.grad_sample for n, p in _trainable(gsm._module).items()}


#: dptorch's earlier name of :func:`compute_opacus_grad_sample`
compute_grad_samples = compute_opacus_grad_sample


def compute_per_sample_norms(
    x: torch.Tensor,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "bk",
) -> torch.Tensor:
    """The ``(B,)`` norms of the per-sample gradients over all trainable parameters, as
    ``grad_sample_mode`` computes them (any mode; ghost and bk without per-sample gradients)."""
    if grad_sample_mode not in _NORM_ONLY:
        gs = compute_opacus_grad_sample(x, module, batch_first, loss_reduction, grad_sample_mode)
        return torch.stack([sq_norms(g) for g in gs.values()]).sum(0).sqrt()
    gsm = _backward_through(
        x, module, batch_first, loss_reduction, grad_sample_mode, max_grad_norm=1.0
    )
    return gsm.per_sample_gradient_norms


def compute_grad_samples_microbatch_and_opacus(
    x: torch.Tensor | PackedSequence,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
    chunk_method: Callable = iter,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(microbatch reference, grad_sample_mode's)`` per-sample gradients of ``module``."""
    sample_x = unpack_packedsequences(x) if isinstance(x, PackedSequence) else x
    reference = compute_microbatch_grad_sample(
        sample_x, module, batch_first, loss_reduction, chunk_method
    )
    return reference, compute_opacus_grad_sample(
        x, module, batch_first, loss_reduction, grad_sample_mode
    )


def get_grad_sample_modes(use_ew: bool = False) -> list[str]:
    """The modes that fill ``p.grad_sample``: hooks and functorch, and ew with ``use_ew``."""
    return ["hooks", "functorch", "ew"] if use_ew else ["hooks", "functorch"]


def _close(name: str, got, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        shape = None if got is None else getattr(got, "shape", type(got).__name__)
        logger.warning("%s: got %s, expected shape %s", name, shape, tuple(ref.shape))
        return False
    if not torch.allclose(got, ref, atol=atol, rtol=rtol):
        logger.warning("%s: max |computed - microbatch| = %.3g", name, (got - ref).abs().max().item())
        return False
    return True


def check_per_sample_gradients_are_correct(
    x: torch.Tensor | PackedSequence,
    module: nn.Module,
    *,
    batch_first: bool = True,
    atol: float = 10e-6,
    rtol: float = 10e-5,
    grad_sample_mode: str = "hooks",
    loss_reduction: str | None = None,
) -> bool:
    """Whether ``grad_sample_mode`` gives ``module`` the per-sample gradients of running each
    sample alone (``torch.allclose`` with ``atol``/``rtol``), for both loss reductions (or
    only ``loss_reduction``). Ghost and bk are checked by their per-sample gradient norms.
    Mismatches are logged with the parameter's name. Use float64 for tight tolerances."""
    if grad_sample_mode == "ew" and not batch_first:
        raise RuntimeError("Batch should be first dimension.")
    ok = True
    for red in [loss_reduction] if loss_reduction else ["sum", "mean"]:
        sample_x = unpack_packedsequences(x) if isinstance(x, PackedSequence) else x
        reference = compute_microbatch_grad_sample(sample_x, module, batch_first, red)
        if grad_sample_mode in _NORM_ONLY:
            want = torch.stack([sq_norms(g) for g in reference.values()]).sum(0).sqrt()
            got = compute_per_sample_norms(x, module, batch_first, red, grad_sample_mode)
            ok &= _close(f"per-sample norms ({red})", got, want, atol, rtol)
            continue
        computed = compute_opacus_grad_sample(x, module, batch_first, red, grad_sample_mode)
        for name, ref in reference.items():
            ok &= _close(f"{name} ({red})", computed.get(name), ref, atol, rtol)
    return bool(ok)
