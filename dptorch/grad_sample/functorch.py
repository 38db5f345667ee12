"""Per-sample gradients of an arbitrary layer through ``torch.func`` (vmap over grad).

Used for layers without a registered grad sampler, or for every layer with ``force_functorch``.
The layer's forward is recomputed once per call, vectorised over the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.stateless import _reparametrize_module

from .recompute_state import (
    ForwardFingerprint,
    check_recompute,
    current_fingerprint,
    recompute_fingerprint,
    recompute_guard,
)
from .unit_params import unit_parameters
from .use_trace import tensors_in


def ft_compute_per_sample_gradient(
    layer: nn.Module,
    activations: Sequence,
    backprops: torch.Tensor,
    kwargs: dict | None = None,
    batch_first: bool = True,
    params: Sequence[tuple[str, nn.Parameter]] | None = None,
    name: str | None = None,
    shared: Mapping[int | str, torch.Size] | None = None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients of ``<layer(x_b), g_b>`` w.r.t. the layer's own trainable parameters
    (or the named ``params`` of the layer, when given).

    ``activations`` are the layer's positional inputs and ``backprops`` the output gradient, both
    batch-first ``(B, ...)``; tensors whose leading size is not ``B`` are treated as shared by all
    samples, as are those at the positions (ints) or keywords in ``shared`` with the shape
    given there (inputs known not to come from the batch, such as a ``[T, T]`` mask when
    ``T = B``). ``batch_first`` says where
    the batch dimension must be re-inserted when calling the layer on one sample. Returns
    ``{param: (B, *param.shape)}``.

    Raises ``ValueError`` (naming the layer as ``name``) where one sample's call would still
    see other samples: a tensor of ``B`` rows inside a tuple, list or dict input (only
    top-level tensors are split per sample), or an output with more than one row per sample.
    """
    kwargs = kwargs or {}
    if params is None:
        params = unit_parameters(layer)
    named = [(n, p) for n, p in params if p.requires_grad]
    if not named:
        return {}
    names = [n for n, _ in named]
    values = tuple(p.detach() for _, p in named)
    if backprops.shape[0] == 0:
        return {p: p.new_zeros((0, *p.shape)) for _, p in named}
    label = f"{name or type(layer).__name__} ({type(layer).__name__})"
    _check_no_nested_batch(label, activations, kwargs, backprops.shape[0])
    # the forward's fingerprint, when called from the capture hook of that call
    fingerprint = current_fingerprint(layer)
    with recompute_guard(layer, label):  # a stateful forward is refused (recompute_state.py)
        per_sample = _vmap_grad(
            layer, names, values, activations, backprops, kwargs, batch_first, label, shared,
            fingerprint,
        )
    if fingerprint is not None:  # the recompute must have reproduced the forward's output
        per_sample, got = per_sample
        per_sample = check_recompute(label, fingerprint, got, per_sample)
    return {p: gs for (_, p), gs in zip(named, per_sample)}


def _vmap_grad(
    layer: nn.Module,
    names: Sequence[str],
    values: tuple,
    activations: Sequence,
    backprops: torch.Tensor,
    kwargs: dict,
    batch_first: bool,
    label: str | None = None,
    shared: Mapping[int | str, torch.Size] | None = None,
    fingerprint: ForwardFingerprint | None = None,
) -> tuple:
    """Per-sample gradients of ``<layer(x_b), g_b>`` w.r.t. the parameters ``names`` (given the
    values ``values``), one ``(B, *shape)`` tensor per name: ``vmap`` over ``grad`` of
    :func:`call_forward` on one sample. The call on one sample must return one row (its batch
    dimension of size 1), else ``ValueError``: the layer read other samples' data. With
    ``fingerprint`` (the forward output's, recompute_state.py), returns ``(gradients,
    fingerprints)``: the same fingerprint of every sample's recomputed output, ``(B, K + 1)``."""
    batch_size = backprops.shape[0]
    bdim = 0 if batch_first else 1

    def is_batched(a):
        return isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch_size

    shared = shared or {}
    batched_pos = [i for i, a in enumerate(activations)
                   if is_batched(a) and shared.get(i) != a.shape]
    batched_kw = [k for k, v in kwargs.items() if is_batched(v) and shared.get(k) != v.shape]

    def sample_loss(param_values, pos_values, kw_values, g):
        args = list(activations)
        for i, v in zip(batched_pos, pos_values):
            args[i] = v.unsqueeze(bdim)
        kw = dict(kwargs)
        for k, v in zip(batched_kw, kw_values):
            kw[k] = v.unsqueeze(bdim)
        # tie_weights=False: only these names are substituted, so a parameter this layer shares
        # with another hooked module is differentiated where that module samples it
        out = call_forward(layer, dict(zip(names, param_values)), tuple(args), kw)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if out.dim() > bdim and out.shape[bdim] != 1:
            raise ValueError(
                f"{label or type(layer).__name__}: called on one sample, the layer returned "
                f"{out.shape[bdim]} rows in its batch dimension. Its per-sample gradients are "
                "computed by torch.func on each sample's slice of the layer's tensor inputs, "
                "so the layer must read every per-sample value from a top-level tensor "
                "argument with the batch in dimension "
                f"{bdim} (it read the batch from elsewhere: a tuple, list or dict input, an "
                "index such as EmbeddingBag's offsets, or a cached tensor). Pass the batch as "
                "tensor arguments, or register a grad sampler for the layer "
                "(dptorch.grad_sample.register_grad_sampler); for EmbeddingBag with offsets "
                "use grad_sample_mode='hooks'."
            )
        loss = (out * g.unsqueeze(bdim)).sum()
        if fingerprint is None:
            return loss
        return loss, recompute_fingerprint(fingerprint, out, bdim, label or type(layer).__name__)

    fn = grad(sample_loss) if fingerprint is None else grad(sample_loss, has_aux=True)
    try:
        return vmap(fn, in_dims=(None, 0, 0, 0))(
            tuple(values),
            tuple(activations[i] for i in batched_pos),
            tuple(kwargs[k] for k in batched_kw),
            backprops,
        )
    except RuntimeError as e:
        if "functorch transform" not in str(e) and "vmap" not in str(e):
            raise
        hooks = [h for m in layer.modules() if m is not layer
                 for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
        raise ValueError(
            f"{label or type(layer).__name__}: torch.func cannot compute its per-sample "
            f"gradients (vmap over the layer's call): {e.args[0].splitlines()[0]} "
            + (f"The forward hooks of its submodules run inside that call: {hooks}. "
               if hooks else "")
            + "Fix: use grad_sample_mode='hooks' or 'bk' (no torch.func), remove the hook "
            "(Hugging Face: gradient checkpointing adds one through enable_input_require_grads), "
            "or register a grad sampler for the layer (dptorch.grad_sample.register_grad_sampler)."
        ) from e


def call_forward(layer: nn.Module, params: dict, args: tuple, kwargs: dict):
    """``layer.forward(*args, **kwargs)`` with the tensors ``params`` (by name) in place of the
    layer's own (``torch.func.functional_call`` with ``tie_weights=False``, without the layer's
    own hooks): the recompute of one captured call. Its inputs were captured after the forward
    pre-hooks (global and the layer's) ran, and its output gradient is taken at the output of
    ``forward``, before any forward hook, so neither kind may run again here; the submodules
    are called as usual (their hooks are part of the layer's forward)."""
    with _reparametrize_module(layer, params, tie_weights=False):
        return layer.forward(*args, **kwargs)


def _check_no_nested_batch(label: str, activations: Sequence, kwargs: dict, rows: int) -> None:
    """``ValueError`` if a tuple, list or dict input of the layer holds a tensor of ``rows``
    (the batch's) leading rows: ``torch.func`` would pass it whole to every sample's call."""
    nested = [a for a in (*activations, *kwargs.values()) if not isinstance(a, torch.Tensor)]
    for t in tensors_in(nested):
        if t.dim() > 0 and t.shape[0] == rows and rows > 1:
            raise ValueError(
                f"{label}: an input of this layer is a tuple, list or dict holding a tensor of "
                f"{rows} rows, the batch's. Its per-sample gradients are computed by torch.func "
                "on each sample's slice of the top-level tensor arguments only, so every "
                "sample's call would see the whole tensor (every sample's data in every "
                "per-sample gradient). Pass such tensors as separate arguments, or register a "
                "grad sampler for the layer (dptorch.grad_sample.register_grad_sampler)."
            )


def make_functional(mod: nn.Module, disable_autograd_tracking: bool = False):
    """``(fmodel, params)``: ``params`` are ``mod``'s parameters (``named_parameters`` order;
    detached with ``disable_autograd_tracking=True``) and ``fmodel(params, *args, **kwargs)``
    runs ``mod`` with them in place of its own (``torch.func.functional_call``; buffers are the
    module's). The replacement of the removed ``functorch.make_functional``."""
    named = dict(mod.named_parameters())
    names = tuple(named)
    values = tuple(named.values())
    if disable_autograd_tracking:
        values = tuple(v.detach() for v in values)

    def fmodel(new_params, *args, **kwargs):
        return functional_call(mod, dict(zip(names, new_params)), args, kwargs)

    return fmodel, values


def prepare_layer(layer: nn.Module, batch_first: bool = True) -> None:
    """Attaches ``layer.ft_compute_sample_grad(params, activations, backprops)``: the per-sample
    gradients (a tuple, ``(B, *p.shape)`` each) of all ``layer.parameters()`` given their values
    ``params``, the layer's input ``activations`` and its output gradient ``backprops``, both
    batch first. ``batch_first`` is the layout the layer itself is called with (a layer may fix
    its own with ``grad_sample_batch_first``, as ``GradSampleModule`` does)."""
    names = [n for n, _ in layer.named_parameters()]
    bf = module_batch_first(layer, batch_first)

    def ft_compute_sample_grad(params, activations, backprops):
        return _vmap_grad(layer, names, tuple(params), [activations], backprops, {}, bf)

    layer.ft_compute_sample_grad = ft_compute_sample_grad


def module_batch_first(module: nn.Module, batch_first: bool) -> bool:
    """Whether ``module``'s inputs/outputs have the batch in dimension 0.

    A layer may fix its own layout with an attribute ``grad_sample_batch_first`` (``True``: always
    batch first, ``False``: always ``(T, B, ...)``), e.g. ``dptorch.layers.dp_rnn.RNNLinear``,
    whose calls are batch first whatever the ``batch_first`` of the ``GradSampleModule``; without
    it (or with ``None``) the module follows ``batch_first``.
    """
    own = getattr(module, "grad_sample_batch_first", None)
    return batch_first if own is None else bool(own)
