"""Per-sample gradients through PyTorch's ExpandedWeights (``grad_sample_mode="ew"``)."""

from __future__ import annotations

import torch
from torch import nn

from ..validators.errors import UnsupportedModuleError
from .grad_sample_module import infer_batch_size
from .gsm_base import AbstractGradSampleModule, weak_method
from .unit_params import trainable_signature, trainable_units, unit_parameters
from .use_trace import check_structure, tensors_in

# Trainable layers whose functional form ExpandedWeights cannot differentiate per sample.
_EW_UNSUPPORTED = (
    nn.EmbeddingBag,
    nn.RMSNorm,
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,
    nn.modules.batchnorm._BatchNorm,
)
_EW_UNSUPPORTED_NAMES = ("DPLSTM", "DPGRU", "DPRNN", "DPMultiheadAttention")


def check_torch_version_for_ew_sample() -> bool:
    """Whether this torch has the ExpandedWeights API that ``grad_sample_mode="ew"`` runs on
    (``torch.nn.utils._per_sample_grad``, torch >= 1.13), as Opacus's function of this name."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) >= (1, 13)


class ExpandedWeightsUnsupportedError(NotImplementedError, UnsupportedModuleError):
    """A model that ExpandedWeights cannot differentiate per sample, found when the model is
    wrapped (``make_private``). Both a ``NotImplementedError`` (as the other refusals of this
    mode) and a :class:`~dptorch.validators.errors.UnsupportedModuleError` (a ``ValueError``, as
    every other refusal of ``make_private``; Opacus raises that for a BatchNorm layer in this
    mode)."""


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor default hooks are set (``torch.utils.checkpoint``'s non-reentrant
    recompute hooks, ``save_on_cpu``): ExpandedWeights' saved activations would then be replaced
    by a recompute or a copy that its per-sample rules do not see."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _hf_unsupported(module: nn.Module) -> str | None:
    """Why a Hugging Face layer with trainable parameters of its own cannot run under
    ExpandedWeights, or ``None``: GPT-2's ``Conv1D`` computes ``addmm(bias, x, weight)`` and the
    RMS norms (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``T5LayerNorm``, ...) ``weight * x``, two
    functions ExpandedWeights has no per-sample rule for."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    if not any(p.requires_grad for p in module.parameters(recurse=False)):
        return None
    name = cls.__name__
    if name == "Conv1D":
        return "computes torch.addmm(bias, x, weight)"
    if name.endswith("RMSNorm") or name == "T5LayerNorm":
        return "computes weight * x"
    return None


def _embedding_unsupported(sub: nn.Module) -> str | None:
    """Why ExpandedWeights' embedding rule would be wrong for ``sub`` (``None``: it is exact):
    it ignores ``scale_grad_by_freq``, and its ``padding_idx`` row is corrected here only for
    calls of ``nn.Embedding.forward`` itself."""
    if not isinstance(sub, nn.Embedding) or not sub.weight.requires_grad:
        return None
    if sub.scale_grad_by_freq:
        return "scales its gradient by the ids' frequencies (scale_grad_by_freq=True)"
    if sub.padding_idx is not None and type(sub).forward is not nn.Embedding.forward:
        return "has a padding_idx and a forward of its own"
    return None


def check_ew_model(module: nn.Module, *, batch_first: bool = True, **_settings: object) -> None:
    """Raises :class:`ExpandedWeightsUnsupportedError` (a ``NotImplementedError`` and a
    ``ValueError``) naming the first layer of ``module`` that ExpandedWeights cannot
    differentiate per sample, with the reason and the fix; also for ``batch_first=False``.

    The ``"ew"`` mode entry runs it among ``make_private``'s checks, before anything (model,
    optimizer, parameters) is modified, and the module's constructor runs it for direct
    ``wrap_model`` calls. A GradSampleModule passed in is checked through the model it wraps."""
    if not batch_first:
        raise ExpandedWeightsUnsupportedError(
            "ExpandedWeights (grad_sample_mode='ew') supports only batch_first=True; "
            "use grad_sample_mode='hooks' or 'functorch'."
        )
    if isinstance(module, AbstractGradSampleModule):
        module = module._module
    for name, sub in module.named_modules():
        if isinstance(sub, _EW_UNSUPPORTED) or type(sub).__name__ in _EW_UNSUPPORTED_NAMES:
            trainable = any(p.requires_grad for p in sub.parameters())
            unsupported = isinstance(sub, nn.modules.batchnorm._BatchNorm) or trainable
        else:
            unsupported = (
                isinstance(sub, nn.Conv3d)
                and tuple(sub.dilation) != (1, 1, 1)
                and any(p.requires_grad for p in sub.parameters())
            )
        if unsupported:
            what = "Conv3d with dilation" if isinstance(sub, nn.Conv3d) else type(sub).__name__
            raise ExpandedWeightsUnsupportedError(
                f"{name or '<root>'} ({what}) is not supported by ExpandedWeights "
                "(grad_sample_mode='ew'). Use grad_sample_mode='hooks' (after "
                "dptorch.validators.ModuleValidator.fix(model) for BatchNorm and torch.nn "
                "recurrent/attention layers)."
            )
        why = _hf_unsupported(sub) or _embedding_unsupported(sub)
        if why is not None:
            raise ExpandedWeightsUnsupportedError(
                f"{name or '<root>'} ({type(sub).__name__}) {why}, which ExpandedWeights "
                "(grad_sample_mode='ew') cannot differentiate per sample. Use "
                "grad_sample_mode='bk' (fastest, exact) or 'hooks', or freeze the layer "
                "(e.g. train LoRA adapters only)."
            )


class GradSampleModuleExpandedWeights(AbstractGradSampleModule):
    """ExpandedWeights-based implementation of :class:`AbstractGradSampleModule`.

    Each forward runs under ``torch.nn.utils._per_sample_grad.call_for_per_sample_grads``, which
    makes PyTorch's own kernels fill ``p.grad_sample`` (``(B, *p.shape)``). With
    ``loss_reduction="mean"`` they are rescaled by ``B``, as in hooks mode: the mean of
    ``p.grad_sample`` over the batch is the gradient of the loss. At the end of each backward pass
    this module also sets ``p.grad`` to that gradient (PyTorch leaves it ``None``) and zeroes the
    ``padding_idx`` contribution of ``nn.Embedding`` (PyTorch's ExpandedWeights does not).

    A second backward pass without ``zero_grad()`` turns ``p.grad_sample`` into a list (one entry
    per pass), or raises ``ValueError`` after :meth:`forbid_grad_accumulation`.

    An empty batch (Poisson sampling can draw one), which ExpandedWeights refuses, runs as a
    plain forward; its backward gives every trainable parameter of the layers that ran a
    zero-size ``p.grad_sample`` of shape ``(0, *p.shape)`` (and autograd's ``p.grad``), as in
    hooks mode, so that the optimizer's step adds the noise and is accounted for.

    Inputs may be positional or keyword (``gsm(input_ids=..., attention_mask=...)``, as Hugging
    Face models are called); the batch size is the first dimension of the first tensor. A layer
    called on inputs whose batch dimension is 1 (Hugging Face's ``position_ids`` of shape
    ``[1, T]``) gets them expanded to the batch, which makes its per-sample gradients exact (the
    structure check of the first forward pass verifies that the rows stay per sample).

    Limits (each raises rather than returning wrong numbers): ``batch_first=False``, recurrent
    layers, attention, EmbeddingBag, RMSNorm, BatchNorm, a trainable Hugging Face ``Conv1D``
    (GPT-2) or RMS norm (Llama, Qwen2, T5) — refused when the model is wrapped, i.e. by
    ``make_private`` —, a layer called on inputs that are not the batch (a relative position
    bias), and any function ExpandedWeights has no rule for.
    """

    def __init__(
        self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean", **kwargs
    ):
        check_ew_model(m, batch_first=batch_first)
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self._callback_queued = False
        self._previous: dict[int, tuple[nn.Parameter, list]] = {}
        self._padding_corrections: list[tuple[nn.Parameter, int, torch.Tensor]] = []
        self._empty_forward = False  # inside the plain forward of an empty batch
        self._empty_units: list[nn.Module] = []  # layers that ran on an empty batch (this pass)
        self._hooks = []
        self._checked: tuple = ()
        self._batch_size: int | None = None  # B while a training forward pass runs
        for _, unit in trainable_units(m):
            self._hooks.append(
                unit.register_forward_pre_hook(self._expand_shared_inputs, with_kwargs=True)
            )
            self._hooks.append(unit.register_forward_hook(self._on_unit_forward))

    def forward(self, *args, **kwargs):
        """The wrapped module's forward, positional and keyword inputs alike
        (``gsm(input_ids=..., attention_mask=...)``); the batch size is the first dimension of
        the first tensor input."""
        from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

        if not self.training or not torch.is_grad_enabled():
            return self._module(*args, **kwargs)
        if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
            raise NotImplementedError(
                "ExpandedWeights (grad_sample_mode='ew') cannot run under torch.autocast: torch's "
                "per-sample rules multiply the autocast (bf16/fp16) activations with float32 "
                "weights. Use grad_sample_mode='hooks', 'functorch', 'ghost' or 'bk', which "
                "support mixed precision (per-sample norms in float32)."
            )
        batch_size = infer_batch_size(args, kwargs, batch_first=True)
        if batch_size is None:
            raise ValueError(
                "ExpandedWeights (grad_sample_mode='ew') needs a tensor input whose first "
                "dimension is the batch; got no tensor input (or an EmbeddingBag-style flat "
                "index with offsets). Use grad_sample_mode='hooks' or 'bk'."
            )
        self._stash_previous_grad_samples()
        if batch_size == 0:
            # ExpandedWeights refuses batch_size=0: a plain forward, whose backward hooks give
            # zero-size per-sample gradients (see _end_of_backward)
            self._empty_forward = True
            try:
                return self._module(*args, **kwargs)
            finally:
                self._empty_forward = False
        self._batch_size = batch_size
        try:
            signature = trainable_signature(self._module)
            if signature != self._checked:
                # once, and again when the trainable parameters change: a layer called on
                # inputs that do not come from the batch (an index of shape [T, T], even with
                # T == B) would get per-sample gradients whose rows are not the samples
                check_structure(self._module, args, kwargs, batch_size, check_uses=False)
                if batch_size > 1:  # one sample cannot tell batch data from shared data
                    self._checked = signature
            try:
                out = call_for_per_sample_grads(
                    self._module, batch_size=batch_size, loss_reduction=self.loss_reduction
                )(*args, **kwargs)
                for t in tensors_in(out):
                    if t.requires_grad:
                        t.register_hook(_refuse_create_graph)
                return out
            except RuntimeError as e:
                if "Expanded Weights" not in str(e):
                    raise
                raise NotImplementedError(
                    f"ExpandedWeights (grad_sample_mode='ew') cannot compute per-sample gradients "
                    f"of this model: {e}. Use grad_sample_mode='hooks' or 'functorch'."
                ) from e
        finally:
            self._batch_size = None

    def _expand_shared_inputs(self, module: nn.Module, args, kwargs):
        """Forward pre-hook of every trainable layer: a call whose tensor inputs all have a
        batch dimension of size 1 while the batch has ``B > 1`` samples (Hugging Face's
        ``position_ids`` of shape ``[1, T]``) gets them expanded (a view) to ``B`` rows, so that
        ExpandedWeights computes one exact per-sample gradient per row (as hooks mode expands
        the call's output). The structure check then verifies that the rows stay per sample."""
        b = self._batch_size
        if b is not None and module.training and _saved_tensor_hooks_active():
            name = next((n for n, m in self._module.named_modules() if m is module), "")
            raise ExpandedWeightsUnsupportedError(
                f"{name or '<root>'} ({type(module).__name__}) runs under saved-tensor hooks "
                "(activation checkpointing with use_reentrant=False, or save_on_cpu): the "
                "checkpoint recomputes the layer in the backward pass outside ExpandedWeights, "
                "whose per-sample gradients would then be wrong. Use grad_sample_mode='hooks', "
                "'functorch' or 'bk', which support activation checkpointing."
            )
        if b is None or b <= 1 or not module.training:
            return None
        tensors = [t for t in tensors_in((args, kwargs), 2) if t.dim() > 0]
        if not tensors or any(t.shape[0] != 1 for t in tensors):
            return None

        def expand(v):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1:
                return v.expand(b, *v.shape[1:])
            return v

        return tuple(expand(a) for a in args), {k: expand(v) for k, v in kwargs.items()}

    # ------------------------------------------------------------------ accumulation
    def _stash_previous_grad_samples(self) -> None:
        """Moves ``grad_sample`` of an earlier pass aside (PyTorch refuses to run otherwise)."""
        for p in self.trainable_parameters():
            prev = getattr(p, "grad_sample", None)
            if prev is None:
                continue
            if not self.grad_accumulation_allowed:
                raise ValueError(
                    "A second forward/backward pass ran before optimizer.step()/zero_grad(), and "
                    "gradient accumulation is forbidden (Poisson sampling). Call "
                    "optimizer.zero_grad() after every step, or use BatchMemoryManager."
                )
            self._previous[id(p)] = (p, prev if isinstance(prev, list) else [prev])
            del p.grad_sample

    # ------------------------------------------------------------------ end of backward
    def _on_unit_forward(self, module: nn.Module, args, output) -> torch.Tensor | None:
        if not self.training or not torch.is_grad_enabled():
            return
        for t in tensors_in(output):  # also a backward from an intermediate tensor
            if t.requires_grad:
                t.register_hook(_refuse_create_graph)
        out = output if isinstance(output, torch.Tensor) else None
        if out is None or not out.requires_grad:
            return
        # this object and the module weakly (weak_method): a module that keeps its output on
        # itself would otherwise be held by its own graph, a cycle the garbage collector does
        # not see
        if self._empty_forward:
            out.register_hook(weak_method(self._on_unit_backprops, module, None, None))
            return
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            out.register_hook(
                weak_method(self._on_unit_backprops, None, module, args[0].detach())
            )
        else:
            out.register_hook(weak_method(self._on_unit_backprops, None, None, None))
        if out._is_view():
            # a view made inside ExpandedWeights' Function (a Linear on (B, T, d)) cannot be
            # modified in place (nn.ReLU(inplace=True), h += x): the layer returns a copy
            return out.clone()
        return None

    def _on_unit_backprops(
        self, empty_unit: nn.Module | None, module: nn.Module | None, ids, grad: torch.Tensor
    ) -> None:
        if empty_unit is not None:
            self._empty_units.append(empty_unit)
        elif ids is not None:
            # ExpandedWeights adds the output gradient at padding positions to the padding row;
            # remember that contribution to subtract it at the end of the pass.
            scale = grad.shape[0] if self.loss_reduction == "mean" else 1
            mask = (ids == module.padding_idx).to(grad.dtype).unsqueeze(-1)
            corr = (grad * mask).reshape(grad.shape[0], -1, grad.shape[-1]).sum(1) * scale
            self._padding_corrections.append((module.weight, module.padding_idx, corr))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        # an empty batch: autograd has set p.grad (zeros); the per-sample gradients are (0, ...)
        empty = {}
        for unit in self._empty_units:
            for _, p in unit_parameters(unit):
                if p.requires_grad and getattr(p, "grad_sample", None) is None:
                    p.grad_sample = p.new_zeros((0, *p.shape))
                    empty[id(p)] = p
        self._empty_units = []
        for p, idx, corr in self._padding_corrections:
            gs = getattr(p, "grad_sample", None)
            if isinstance(gs, torch.Tensor):
                gs[:, idx] -= corr
        self._padding_corrections = []
        for p in self.trainable_parameters():
            gs = getattr(p, "grad_sample", None)
            if not isinstance(gs, torch.Tensor):
                continue
            if id(p) not in empty:
                g = gs.mean(0) if self.loss_reduction == "mean" else gs.sum(0)
                p.grad = g if p.grad is None else p.grad + g
            prev = self._previous.pop(id(p), None)
            if prev is not None:
                p.grad_sample = prev[1] + [gs]
        # parameters untouched by this pass keep their earlier grad_sample
        for p, prev in self._previous.values():
            p.grad_sample = prev[0] if len(prev) == 1 else prev
        self._previous = {}

    def remove_hooks(self) -> None:
        """Removes the forward hooks that watch the trainable layers' outputs."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _refuse_create_graph(grad: torch.Tensor) -> None:
    """Output hook: a backward pass with ``create_graph=True`` (a gradient penalty, a double
    backward) makes the weights reach the loss through the backward graph, where
    ExpandedWeights' per-sample rules do not apply."""
    if torch.is_grad_enabled():
        raise ValueError(
            "A backward pass with create_graph=True went through a layer of the model under "
            "grad_sample_mode='ew'. A loss built from that gradient (a gradient penalty, a double "
            "backward) reaches the weights through the backward graph, whose per-sample "
            "gradients ExpandedWeights does not compute, so it cannot be clipped per sample. "
            "Compute such terms without create_graph (or on an unwrapped copy of the model), "
            "or train without them."
        )
