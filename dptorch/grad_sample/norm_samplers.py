"""Shared pieces of the per-layer norm and clipped-sum functions (fast clipping).

The per-layer functions themselves live in each layer's file (``linear.py``, ``conv.py`` ...)
and are registered in its :class:`~dptorch.grad_sample.registry.LayerRule`. This module holds
what they share: squared norms of instantiated gradients, the ghost-vs-instantiate cost model of
a linear map used at ``T`` positions, and the generic clipped sum of any layer.

Ghost norm of a linear map applied at ``T`` positions (Linear on ``(B, T, d_in)``, a convolution
after im2col with ``T`` output positions): with ``a_t`` the inputs and ``g_t`` the output
gradients of one sample, ``||Σ_t g_t a_tᵀ||² = Σ_{t,s} (a_t·a_s)(g_t·g_s)``: two ``T × T`` Gram
matrices instead of the ``d_out × d_in`` gradient. :func:`ghost_is_cheaper` picks the cheaper
(ghost ``~T²(d_in + d_out)`` vs instantiation ``~T·d_in·d_out`` multiply-adds per sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..utils import gemm
from .recompute_state import ForwardFingerprint, check_batch_recompute
from .unit_params import unit_parameters

ParamDict = dict[nn.Parameter, torch.Tensor]


@dataclass
class Factors:
    """One call's per-sample gradient of a parameter viewed as a matrix ``(r, c)``, in factored
    form ``G_b = Σ_t u_{bt} v_{btᵀ}`` over the call's ``T`` positions.

    ``v``: ``(B, T, c)``. Either ``u``: ``(B, T, r)`` (dense: Linear's ``u = g``, ``v = a``) or
    ``ids``: ``(B, T)`` integer rows of a one-hot ``u`` (Embedding: ``v`` the output gradient,
    zero at padding). Two calls' factors give the inner product of their per-sample gradients
    (:func:`factor_inner`) in ``O(B·T₁·T₂·(r + c))`` without building either gradient.
    """

    v: torch.Tensor
    u: torch.Tensor | None = None
    ids: torch.Tensor | None = None


def factor_inner(f: Factors, h: Factors) -> torch.Tensor:
    """``⟨G_b, H_b⟩`` per sample, ``(B,)``, of two factored per-sample gradients of one
    parameter: ``Σ_{t,s} (u_t·u'_s)(v_t·v'_s)`` (a one-hot ``u`` picks a row of the other's),
    in float32 for float16/bfloat16 factors (their Gram entries overflow)."""
    vv = gram(f.v, h.v)  # (B, T1, T2)
    if f.ids is None and h.ids is None:
        uu = gram(f.u, h.u)
    elif f.ids is not None and h.ids is not None:
        uu = (f.ids[:, :, None] == h.ids[:, None, :]).to(vv.dtype)
    else:
        if f.ids is None:
            f, h, vv = h, f, vv.transpose(1, 2)
        idx = f.ids[:, None, :].expand(-1, h.u.shape[1], -1)  # (B, T2, T1)
        uu = torch.gather(h.u, 2, idx).transpose(1, 2)  # u'_{bs}[ids_{bt}] -> (B, T1, T2)
        uu = uu.to(vv.dtype)  # picked entries, widened after the gather (no (B, T, V) copy)
    return (uu * vv).sum((1, 2))


def wants_grad(p: nn.Parameter | None) -> bool:
    return p is not None and p.requires_grad


#: dtypes whose squared norms are accumulated and returned in float32: a float16 ``‖x‖²``
#: overflows (inf) from ``‖x‖ > 256``, and both lose most of a sum's digits
NARROW_DTYPES = (torch.float16, torch.bfloat16)


def acc_dtype(x: torch.Tensor) -> torch.dtype | None:
    """``float32`` for a float16/bfloat16 ``x``, else ``None`` (``x``'s own dtype)."""
    return torch.float32 if x.dtype in NARROW_DTYPES else None


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is float16/bfloat16 (a copy), else ``x`` itself: the operand of a
    Gram matrix whose entries (``a_t·a_s``) overflow in float16."""
    return x.float() if x.dtype in NARROW_DTYPES else x


def gram(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """``x yᵀ`` per sample, ``(B, T1, d), (B, T2, d) -> (B, T1, T2)`` (``y = x`` by default),
    in float32 for float16/bfloat16 operands (products of float32 copies), whose Gram entries
    overflow. (torch's float32-output ``bmm(..., out_dtype=)`` for narrow operands, CUDA only,
    was measured on an H100: no faster on GPT-2's step than the copies.)"""
    y = x if y is None else y
    return gemm.bmm_nt(widened(x), widened(y))


def l2_norms(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """``‖x‖`` over ``dim``, accumulated and returned in float32 for float16/bfloat16 ``x``."""
    return torch.linalg.vector_norm(x, dim=dim, dtype=acc_dtype(x))


def sq_sum(x: torch.Tensor, dim: int | tuple[int, ...], *, wide: bool = False) -> torch.Tensor:
    """``Σ x²`` over ``dim``: one reduction, without the squared copy of ``x`` that
    ``x.pow(2).sum(dim)`` writes (about twice as fast on a CPU).

    With ``wide``, accumulated and returned in float32 for a float16/bfloat16 ``x`` (a float16
    ``Σ x²`` is inf from ``‖x‖ > 256``); by default in ``x``'s dtype (``embedding.py`` adds the
    result into a tensor of the gradient's dtype)."""
    if wide:
        return l2_norms(x, dim).square()
    return torch.linalg.vector_norm(x, dim=dim).square()


def norm_product_sq(a: torch.Tensor, g: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``(‖a‖·‖g‖)²`` per sample over ``dims``, the squared norm of a rank-one ``g aᵀ``, with
    the norms accumulated in float32 for float16/bfloat16 and the product formed before
    squaring (``‖a‖²·‖g‖²`` overflows while the result is finite). Where a norm still
    overflows the result is inf or NaN (``inf · 0``), whose clip factor is 0: the sample is
    dropped, never released unclipped."""
    return (l2_norms(a, dims) * l2_norms(g, dims)).square()


def sq_norms(gs: torch.Tensor) -> torch.Tensor:
    """``(B, ...) -> (B,)`` squared L2 norms (float32 for float16/bfloat16 ``gs``)."""
    return sq_sum(gs.reshape(gs.shape[0], positions(gs, 1, 0)), 1, wide=True)


def sample_norms(norms_sq: ParamDict) -> ParamDict:
    """``{param: (B,)}`` squared norms -> norms: the convention of Opacus's norm-sampler
    functions (``compute_linear_norm_sample`` ...), which dptorch exposes on top of these."""
    return {p: sq.clamp_min(0).sqrt() for p, sq in norms_sq.items()}


def instantiate_norms(grad_samples: ParamDict) -> ParamDict:
    """Squared norms of materialised per-sample gradients ``{p: (B, ...)} -> {p: (B,)}``."""
    return {p: sq_norms(gs) for p, gs in grad_samples.items()}


def ghost_is_cheaper(t: int, d_in: int, d_out: int) -> bool:
    """Whether the Gram-matrix (ghost) norm of a linear map used at ``t`` positions is cheaper
    than instantiating its ``d_out × d_in`` per-sample gradient.

    Per sample, ghost costs ``t²(d_in + d_out)`` multiply-adds and ``t²`` memory; instantiation
    ``t·d_in·d_out`` and ``d_in·d_out``. With ``t = 1`` ghost is always chosen."""
    return t == 1 or t * (d_in + d_out) < d_in * d_out


def positions(x: torch.Tensor, first: int = 1, last: int = -1) -> int:
    """Product of ``x.shape[first:last]`` (1 for an empty range)."""
    t = 1
    for s in x.shape[first:last] if last != 0 else x.shape[first:]:
        t *= s
    return t


def position_sum(x: torch.Tensor) -> torch.Tensor:
    """``(B, T, d) -> (B, d)``: ``Σ_t x[:, t]``, a view of ``x`` when ``T = 1`` (a sum over one
    position is a copy, and a reduction kernel on a CPU)."""
    return x[:, 0] if x.shape[1] == 1 else x.sum(1)


def rows_scaled(t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``t`` ``(B, ...)`` with row ``b`` multiplied by ``c_b`` (``c``: ``(B,)``)."""
    return t * c.view(-1, *([1] * (t.dim() - 1)))


def clip_weighted_pair(
    a: torch.Tensor, g: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` ``(B, T, ·)`` with the clip factors ``c`` ``(B,)`` applied to the rows of the
    smaller of the two: either way ``Σ_{b,t} (c_b g_{bt}) a_{bt}ᵀ`` is one matmul of the pair."""
    if a.numel() < g.numel():
        return rows_scaled(a, c), g
    return a, rows_scaled(g, c)


def instantiated_norm_sq(grad_sampler):
    """A ``norm_sq`` for a layer whose per-sample gradient is small (e.g. ``(B, C)`` for the
    normalisation layers): the squared norms ``{param: (B,)}`` of ``grad_sampler``'s result."""

    def norm_sq(layer, activations, backprops):
        return instantiate_norms(grad_sampler(layer, activations, backprops))

    norm_sq.__doc__ = (
        "Squared per-sample norms ``{param: (B,)}`` from the (small) instantiated per-sample "
        f"gradients of ``{grad_sampler.__name__}``."
    )
    return norm_sq


def generic_clipped_sum(
    layer: nn.Module, activations: Sequence, backprops: torch.Tensor, kwargs: dict | None = None,
    batch_first: bool = True,
    params: Sequence[tuple[str, nn.Parameter]] | None = None,
    fingerprint: ForwardFingerprint | None = None,
    label: str | None = None,
) -> ParamDict:
    """``Σ_b grad_b`` of any layer: recomputes its ``forward`` (not its own hooks) on the
    captured inputs and takes one vector-Jacobian product with ``backprops`` (batch-first; moved
    back for ``batch_first=False``), w.r.t. the layer's own trainable parameters (or the named
    ``params`` it samples).

    The recompute is the forward call only if the forward is a function of its inputs and
    parameters. With ``fingerprint`` (that of the forward call's first output,
    :func:`~dptorch.grad_sample.recompute_state.forward_fingerprint`), the recomputed output is
    checked against it sample by sample, and ``ValueError`` naming the layer (``label``) is
    raised where it differs (:func:`~dptorch.grad_sample.recompute_state.check_batch_recompute`);
    the caller also runs this under
    :func:`~dptorch.grad_sample.recompute_state.recompute_guard`, which refuses a recompute that
    changes the layer's state.
    """
    if params is None:
        params = unit_parameters(layer)
    params = [p for _, p in params if p.requires_grad]
    if not params:
        return {}
    args = list(activations)
    if not batch_first:
        args = [a.movedim(0, 1) if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args]
        backprops = backprops.movedim(0, 1)
    with torch.enable_grad():
        # ``forward`` only: the captured inputs went through the layer's forward pre-hooks, and
        # ``backprops`` is the gradient of the output of ``forward``, before its forward hooks
        out = layer.forward(*args, **(kwargs or {}))
        if isinstance(out, (tuple, list)):
            out = out[0]
        grads = torch.autograd.grad(out, params, backprops, allow_unused=True)
    sums = {p: (g if g is not None else torch.zeros_like(p)) for p, g in zip(params, grads)}
    if fingerprint is not None:
        sums = check_batch_recompute(
            label or type(layer).__name__, fingerprint, out, 0 if batch_first else 1, sums
        )
    return sums
