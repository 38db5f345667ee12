"""DP-SGD with one clipping norm per parameter (per-layer clipping)."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..clipping import ClippingContract
from .optimizer import DPOptimizer, UnitGrads
from .unit_grads import row_norms

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
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )

    def _make_contract(self, optimizer: Optimizer, max_grad_norm: list[float]) -> ClippingContract:
        """A per-parameter :class:`ClippingContract`: one bound per trainable parameter."""
        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if isinstance(max_grad_norm, (int, float)) or not hasattr(max_grad_norm, "__len__"):
            raise ValueError(
                "clipping='per_layer' needs max_grad_norm as a list with one norm per trainable "
                f"parameter ({len(trainable)} here), got {max_grad_norm!r}."
            )
        return ClippingContract(list(max_grad_norm), params=trainable)

    @property
    def max_grad_norms(self) -> list[float]:
        """The per-parameter bounds (the shared contract's)."""
        return self.clipping.max_grad_norms

    @max_grad_norms.setter
    def max_grad_norms(self, values: list[float]) -> None:
        self.clipping.max_grad_norms = values

    def compute_clip_factors(self, unit_grads: UnitGrads | None = None) -> list[torch.Tensor]:
        """Per-parameter factors ``min(1, C_i / (‖g_i‖ + 1e-6))``, each ``(P, B)``."""
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        return [
            self.clipping.param_factors(row_norms(gs), p)
            for p, gs in unit_grads
        ]
