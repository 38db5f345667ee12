"""One DP-SGD step captured in a CUDA graph and replayed, with no Python on the launch path.

On a GPU a small or medium model's DP step is bound by the host: the per-layer Python of the
per-sample machinery launches many small kernels (README, "On a GPU"). :func:`make_graphed_dp_step`
runs the first steps eagerly, then captures one whole step (forward, loss, backward, per-sample
clipping, noise, optimizer update) with ``torch.cuda.CUDAGraph`` and replays it for each later
batch.

Privacy by construction:

* **Nothing stale.** A graph replays what Python decided at capture: the clipping bound(s), σ,
  the expected batch size, the learning rate and every optimizer hyper-parameter, which
  parameters train, the modules' training flags, the storages of parameters, buffers and
  optimizer state, and the batch's shapes. Before every replay all of them are compared with
  their values at capture (:func:`step_signature`); when any differs, the step is captured
  again, where every eager check runs again (a parameter unfrozen after wrapping, a changed C,
  ...).
* **Accounting per executed step.** The optimizer's step hooks (the accountant's first) run once
  per eager step and once per replay, never at capture, and always with the σ and batch size the
  graph was captured with (the signature guarantees it). They run just before each replay, so a
  replay that fails part-way is already charged; a hook that reads gradients sees the previous
  step's.
* **Fresh noise.** Noise comes from torch's default CUDA generator, whose Philox offset
  advances at every replay.
* **Padding rows.** With ``poisson_sampling="fixed_shape"`` the padding rows of each batch reach
  the graph through a static device mask, refilled from the batch's layout before each replay.

Refused with ``ValueError``: a module or batch tensor not on CUDA, ``secure_mode`` (its noise
comes from the host's CSPRNG), a noise ``generator`` of the user's (the graph would advance only
the default one), distributed, adaptive-clipping and multi-pass optimizers, user-level batches
(several rows per unit), and skipped steps (``signal_skip_step``, ``BatchMemoryManager``
splitting a logical batch: a replay is always one whole step). Skip requests and layouts are checked at every
step, the rest again at every capture (a ``generator`` or ``secure_mode`` set later included).

Between replays Python does not run the step, so the optimizer's Python-side results (``p.grad``,
``p.grad_sample``, ``p.summed_grad``) are the tensors the captured step left, refilled by each
replay; they are put back before each replay (a ``zero_grad()`` of the user's between steps
drops them, and the accountant's hook reads them).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .grad_sample.gsm_base import AbstractGradSampleModule
from .optimizers import (
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
)
from .optimizers.optimizer_fast_gradient_clipping import DPPerLayerOptimizerFastGradientClipping

__all__ = ["GraphedDPStep", "make_graphed_dp_step", "step_signature"]

_SUPPORTED = (DPOptimizer, DPOptimizerFastGradientClipping, DPPerLayerOptimizer,
              DPPerLayerOptimizerFastGradientClipping)


def _frozen(v: Any) -> Any:
    """A hyper-parameter as a comparable value (a tensor by its storage: a graph reads it at
    every replay, so its value may change)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.data_ptr(), v.dtype, tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def step_signature(
    module: nn.Module, optimizer: DPOptimizer, modules: list[nn.Module] | None = None
) -> tuple:
    """Everything a captured DP step bakes in, as one comparable value: the clipping bound(s),
    σ, the expected batch size, the loss reduction, every param group's hyper-parameters and
    parameters (identity, ``requires_grad``, storage; the DP optimizer's groups and the wrapped
    optimizer's), the optimizer state's storages, each module's ``training`` flag, children,
    parameters (identity, ``requires_grad``, storage) and buffers (storage), and the per-sample
    hooks' switches.

    ``modules``: ``list(module.modules())`` as it was when last computed (a caller's cache; a
    module added, removed or replaced anywhere changes some module's children, so the
    signature changes with the structure). Default: walked now."""
    mods = list(module.modules()) if modules is None else modules
    tree = tuple(
        (m.training, tuple(map(id, m._modules.values())),
         tuple((id(p), p.requires_grad, p.data_ptr()) for p in m._parameters.values()
               if p is not None),
         tuple((k, _frozen(b)) for k, b in m._buffers.items()))
        for m in mods
    )
    groups = tuple(
        (tuple((id(p), p.requires_grad, p.data_ptr()) for p in g["params"]),
         tuple((k, _frozen(v)) for k, v in sorted(g.items()) if k != "params"))
        for g in optimizer.param_groups
    )
    state = tuple(
        (id(p), tuple((k, _frozen(v)) for k, v in sorted(s.items())))
        for p, s in optimizer.state.items()
    )
    hooks = tuple(
        (getattr(m, "hooks_enabled", None), getattr(m, "forward_hooks_enabled", None),
         getattr(m, "backward_hooks_enabled", None))
        for m in mods if isinstance(m, AbstractGradSampleModule)
    )
    dp = (id(optimizer.clipping), optimizer.clipping.snapshot(), optimizer.noise_multiplier,
          optimizer.expected_batch_size, optimizer.loss_reduction, optimizer.secure_mode,
          optimizer.generator)
    return dp, groups, state, hooks, tree


_WHERE = "make_graphed_dp_step"


def _check_supported(module: nn.Module, optimizer: DPOptimizer) -> None:
    if type(optimizer) not in _SUPPORTED:
        raise ValueError(
            f"{_WHERE}: {type(optimizer).__name__} is not supported (only "
            f"{', '.join(c.__name__ for c in _SUPPORTED)}): distributed, adaptive-clipping and "
            "multi-pass optimizers decide on the host at every step. Train eagerly with it."
        )
    if optimizer.secure_mode:
        raise ValueError(
            f"{_WHERE}: secure_mode draws the noise from the host's CSPRNG, which a CUDA graph "
            "cannot replay. Train eagerly with secure_mode, or turn it off."
        )
    if optimizer.generator is not None:
        raise ValueError(
            f"{_WHERE}: the optimizer has its own noise generator; a CUDA graph advances only "
            "torch's default CUDA generator between replays. Seed that one "
            "(torch.cuda.manual_seed) and build the optimizer without generator."
        )
    _check_device(module)


def _check_device(module: nn.Module) -> None:
    devices = {p.device.type for p in module.parameters()}
    if not torch.cuda.is_available() or devices != {"cuda"}:
        why = "" if torch.cuda.is_available() else ", and CUDA is not available"
        raise ValueError(
            f"{_WHERE}: CUDA graphs need the model on a CUDA device (its parameters are on "
            f"{sorted(devices) or 'no device'}{why}). Move the model to the GPU before "
            "make_private, or train eagerly."
        )


def _check_batch(leaves: list) -> None:
    """The batch's tensors must be on the GPU: a CPU tensor is read by the host at capture (a
    0-dim one becomes a constant of the graph) and would be stale at every replay."""
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device.type != "cuda":
            raise ValueError(
                f"{_WHERE}: a tensor of the batch (shape {tuple(x.shape)}) is on "
                f"{x.device}; a CUDA graph would keep its value at capture. Move every tensor "
                "of the batch to the model's GPU before calling the step."
            )


class GraphedDPStep:
    """``step(*batch, **kw) -> loss``: one DP step on ``batch``, eager for the first
    ``warmup_steps`` calls, then replayed from a CUDA graph (captured again whenever
    :func:`step_signature` or the batch's shapes change). See the module docstring.

    Attributes:
        calls: steps taken. captures: graphs captured (1 in steady state).
    """

    #: recent steps over which frequent re-captures are warned about
    WINDOW = 20

    def __init__(
        self,
        module: nn.Module,
        optimizer: DPOptimizer,
        loss_fn: Callable[..., torch.Tensor],
        *,
        warmup_steps: int = 3,
    ):
        if not (isinstance(warmup_steps, int) and warmup_steps >= 1):
            raise ValueError(
                f"warmup_steps must be an integer >= 1 (got {warmup_steps!r}): CUDA libraries "
                "initialise lazily on the first steps, which a capture cannot contain."
            )
        _check_supported(module, optimizer)
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.warmup_steps = warmup_steps
        self.calls = self.captures = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple | None = None
        self._static: list[torch.Tensor] = []
        self._loss: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._recent: deque[bool] = deque(maxlen=self.WINDOW)
        self._warned = False
        self._stream: torch.cuda.Stream | None = None
        self._modules: list[nn.Module] = list(module.modules())
        #: (p, p.grad, p.grad_sample, p.summed_grad) as the captured step left them
        self._outputs: list[tuple] = []

    # ------------------------------------------------------------------ the step
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        leaves, spec = tree_flatten((args, kwargs))
        layout = self._layout()
        if self.calls < self.warmup_steps:
            loss = self._eager(args, kwargs)
            self.calls += 1
            return loss
        self._check_whole_step()
        key = (step_signature(self.module, self.optimizer, self._modules), spec,
               self._batch_key(leaves), None if layout is None else layout.num_rows)
        captured = key != self._key
        if captured:
            self._modules = list(self.module.modules())
            key = (step_signature(self.module, self.optimizer, self._modules), *key[1:])
            self._capture(leaves, spec, layout)
            self._key = key
        else:
            self.optimizer.take_skip_request()  # a do_skip=False, consumed as a step does
            for s, x in zip(self._static, (x for x in leaves if isinstance(x, torch.Tensor))):
                s.copy_(x)
            if layout is not None:
                self._valid.copy_(layout.valid)
        for p, grad, grad_sample, summed in self._outputs:
            p.grad, p.grad_sample, p.summed_grad = grad, grad_sample, summed
        self.optimizer.run_step_hooks()  # charged before the replay releases anything
        self._graph.replay()
        self.calls += 1
        self._note(captured)
        return self._loss.clone()

    def _check_whole_step(self) -> None:
        """A replay is one whole step: no skip may be requested for it, and no clipped sum of
        skipped steps may be pending (the graph would read that eager tensor at every
        replay, releasing it again and again)."""
        if self.optimizer.last_step_skipped or self.optimizer.skip_requested:
            raise ValueError(
                "make_graphed_dp_step: a skipped step is requested or pending (signal_skip_step, "
                "or BatchMemoryManager splitting a logical batch); a replay cannot skip, and the "
                "clipped sum of skipped steps would be added again at every replay. Use "
                "physical batches of the logical size (poisson_sampling='fixed_shape' with "
                "max_batch_size), or train eagerly."
            )

    def _eager(self, args, kwargs) -> torch.Tensor:
        """One eager DP step on a side stream (as capture wants its warm-up)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(*args, **kwargs)
            loss.backward()
            self.optimizer.step()
        torch.cuda.current_stream().wait_stream(stream)
        return loss.detach()

    def _capture(self, leaves: list, spec, layout) -> None:
        """Captures one step on static copies of ``leaves``; the step hooks are held back (the
        caller runs them before each replay that executes it)."""
        self._graph = self._loss = self._key = None  # free the old graph's memory first
        self._outputs = []
        _check_supported(self.module, self.optimizer)
        _check_batch(leaves)
        self._static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(self._static, spec)
        self._static = [x for x in self._static if isinstance(x, torch.Tensor)]
        layouts = self.optimizer.clipping.layouts
        if layout is not None:
            self._valid = torch.empty(layout.num_rows, dtype=torch.bool,
                                      device=next(self.module.parameters()).device)
            layouts.current = layout.held_in(self._valid)
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        failure = None
        try:
            with self.optimizer.deferred_step_hooks(), torch.cuda.graph(graph):
                try:
                    loss = self.loss_fn(*args, **kwargs)
                    loss.backward()
                    self.optimizer.step()
                except BaseException as e:  # noqa: BLE001 - re-raised below, after the capture
                    failure = e
        except Exception as e:
            if failure is None:
                self._discard()
                raise RuntimeError(
                    f"make_graphed_dp_step: the DP step of {type(self.module).__name__} could not "
                    f"be captured in a CUDA graph ({type(e).__name__}: {e}). Something in the "
                    "model or loss synchronises with the host (.item(), nonzero, boolean "
                    "indexing, torch.unique); train eagerly."
                ) from e
        if failure is not None:
            self._discard()
            raise failure
        if self.optimizer.last_step_skipped:
            self._discard()  # its sum was never computed
            raise ValueError(
                "make_graphed_dp_step: the captured step was skipped (signal_skip_step or "
                "BatchMemoryManager): a graphed step must be one whole logical step. Use "
                "batches of the logical size, or train eagerly."
            )
        self._graph, self._loss = graph, loss.detach()
        self._outputs = [(p, p.grad, getattr(p, "grad_sample", None),
                          getattr(p, "summed_grad", None)) for p in self.optimizer.params]
        self.captures += 1

    def _discard(self) -> None:
        """After a failed capture: drops the tensors the step left, which a capture records
        but never computes."""
        self.optimizer.discard_step()

    def _layout(self):
        """The current batch's layout (fixed-shape padding), checked to be record-level."""
        layout = self.optimizer.clipping.layouts.training_layout()
        if layout is not None and not layout.one_row_per_group:
            raise ValueError(
                "make_graphed_dp_step: user-level batches (privacy_unit='user') sum several rows "
                "per unit, with shapes that depend on the batch; train them eagerly."
            )
        return layout

    @staticmethod
    def _batch_key(leaves: list) -> tuple:
        return tuple(
            (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else _frozen(x)
            for x in leaves
        )

    def _note(self, captured: bool) -> None:
        self._recent.append(captured)
        if (not self._warned and len(self._recent) == self.WINDOW
                and sum(self._recent) > self.WINDOW // 2):
            self._warned = True
            warnings.warn(
                f"make_graphed_dp_step captured {sum(self._recent)} of the last {self.WINDOW} "
                "steps again: something it bakes in (batch shape, C, σ, learning rate, "
                "trainable parameters, training flags, a buffer the forward replaces) changes "
                "at almost every step, so the graph costs more than it saves. Use fixed shapes "
                "(poisson_sampling='fixed_shape') and change hyper-parameters per epoch, or "
                "train eagerly.",
                stacklevel=3,
            )


def make_graphed_dp_step(
    module: nn.Module,
    optimizer: DPOptimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    warmup_steps: int = 3,
) -> GraphedDPStep:
    """One DP-SGD step of ``module`` and ``optimizer`` (as returned by ``make_private``),
    captured in a CUDA graph.

    ``loss_fn(*batch, **kw)`` computes the loss of one batch with ``module``; the returned
    ``step(*batch, **kw)`` trains on that batch (zero_grad, forward, loss, backward,
    ``optimizer.step()``) and returns the loss, detached. Tensors of the batch must be on the
    model's GPU, with the same shapes at every step (``poisson_sampling="fixed_shape"``); other
    arguments must stay equal. The first ``warmup_steps`` steps run eagerly; each is a real,
    accounted step. See the module docstring for what is checked before every replay.

    Example::

        model, optimizer, loader = engine.make_private(..., poisson_sampling="fixed_shape",
                                                       max_batch_size=M, grad_sample_mode="bk")
        step = make_graphed_dp_step(model, optimizer, lambda x, y: F.cross_entropy(model(x), y))
        for x, y in loader:
            loss = step(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
    """
    return GraphedDPStep(module, optimizer, loss_fn, warmup_steps=warmup_steps)

