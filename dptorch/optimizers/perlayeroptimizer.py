"""DP-SGD with one clipping norm per parameter (per-layer clipping)."""

from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from .optimizer import CLIP_EPS, DPOptimizer

__all__ = ["DPPerLayerOptimizer"]


class DPPerLayerOptimizer(DPOptimizer):
    """:class:`DPOptimizer` clipping each parameter's per-sample gradient to its own norm.

    Parameter ``i`` of a sample is clipped to ``max_grad_norm[i]``, so a sample's whole gradient
    has norm at most ``sqrt(Σ C_i²)``; the noise is calibrated to that total norm
    (``self.max_grad_norm``). Only :meth:`compute_clip_factors` differs from :class:`DPOptimizer`.

    Args:
        max_grad_norm: one positive clipping norm per trainable parameter of ``optimizer``, in
            the order of its param groups.
        Other arguments: as :class:`DPOptimizer`.

    Setting ``max_grad_norm`` (e.g. a grad-clip scheduler) rescales every per-parameter norm by
    the same factor.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: list[float],
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        **kwargs,
    ):
        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if isinstance(max_grad_norm, (int, float)) or not hasattr(max_grad_norm, "__len__"):
            raise ValueError(
                "clipping='per_layer' needs max_grad_norm as a list with one norm per trainable "
                f"parameter ({len(trainable)} here), got {max_grad_norm!r}."
            )
        norms = [float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else c for c in max_grad_norm]
        if len(norms) != len(trainable):
            raise ValueError(
                f"max_grad_norm has {len(norms)} entries but the optimizer has {len(trainable)} "
                "trainable parameters; give one clipping norm per parameter."
            )
        for c in norms:
            self._validate_max_grad_norm(c)
        self.max_grad_norms = norms
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )
        self._param_index = {id(p): i for i, p in enumerate(self.params)}

    @property
    def max_grad_norm(self) -> float:
        """Total clipping norm ``sqrt(Σ C_i²)``: the sensitivity the noise is calibrated to."""
        return math.sqrt(sum(c * c for c in self.__dict__["max_grad_norms"]))

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        current = self.max_grad_norm
        if value == current:
            return
        self._validate_max_grad_norm(value)
        ratio = value / current
        self.max_grad_norms = [c * ratio for c in self.max_grad_norms]

    def compute_clip_factors(self, unit_grads=None) -> list[torch.Tensor]:
        """Per-parameter factors ``min(1, C_i / (‖g_i‖ + 1e-6))``, each ``(P, B)``."""
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        factors = []
        for p, gs in unit_grads:
            c = self.max_grad_norms[self._param_index[id(p)]]
            norms = gs.flatten(2).norm(2, dim=2)
            factors.append((c / (norms + CLIP_EPS)).clamp(max=1.0))
        return factors
