"""The clipping contract: the one source of truth for the clipping bound C of a training run.

A :class:`ClippingContract` owns the bound(s) (flat ``C``, or one ``C_i`` per parameter for
per-layer clipping), their validation, the clip factors and the sensitivity the noise is
calibrated to. The DP optimizer creates it; every object that clips (the fast-clipping
GradSampleModules, the loss wrapper) and every object that changes C (grad-clip schedulers,
AdaClip, checkpoints) holds *the same instance*, so there is no copy of C to keep in sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .utils.batch_layout import BatchLayout, LayoutQueue

__all__ = ["CLIP_EPS", "ClippingContract", "check_bound"]

#: added to the norm in ``min(1, C / (norm + CLIP_EPS))`` so that a zero gradient is well defined
CLIP_EPS = 1e-6


def check_bound(value: Any, what: str = "max_grad_norm") -> float:
    """``value`` as a float if it is a valid clipping bound (a real number > 0; ``inf`` disables
    clipping), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{what} must be a real number (int or float, not bool) > 0, got {value!r} "
            f"({type(value).__name__}). It is the L2 norm each sample's gradient is clipped to "
            "(typical values 0.1-10)."
        )
    return float(value)


class ClippingContract:
    """The clipping bound(s) of one DP training run, shared by reference.

    Args:
        max_grad_norm: ``C`` (flat clipping), or a sequence with one ``C_i`` per parameter of
            ``params`` (per-layer clipping).
        params: with per-layer bounds, the parameters they belong to, in order.

    ``max_grad_norm`` is always the sensitivity of one sample's clipped gradient: ``C``, or
    ``sqrt(Σ C_i²)`` per layer. Setting it (a scheduler) rescales every per-layer bound by the
    same factor.

    ``layouts`` (a :class:`~dptorch.utils.batch_layout.LayoutQueue`, filled by a fixed-shape or
    user-level data loader) says what the rows of the current batch are: every clip factor is 0
    on a padding row, and :meth:`layout` gives the units whose summed gradients are clipped.
    """

    def __init__(
        self,
        max_grad_norm: float | Sequence[float],
        params: Iterable[torch.Tensor] | None = None,
    ):
        self._index: dict[int, int] = {}
        self._norms: list[float] | None = None
        self._flat = 1.0
        self.layouts = LayoutQueue()
        if isinstance(max_grad_norm, (list, tuple)):
            params = list(params) if params is not None else None
            if params is None:
                raise ValueError(
                    "Per-layer clipping (a list of max_grad_norm) needs the parameters the "
                    "bounds belong to."
                )
            if len(max_grad_norm) != len(params):
                raise ValueError(
                    f"max_grad_norm has {len(max_grad_norm)} entries but there are "
                    f"{len(params)} trainable parameters; give one clipping norm per parameter."
                )
            self._index = {id(p): i for i, p in enumerate(params)}
            self.max_grad_norms = list(max_grad_norm)
        else:
            self.max_grad_norm = max_grad_norm

    # ------------------------------------------------------------------ the bound(s)
    @property
    def per_layer(self) -> bool:
        """Whether each parameter has its own bound."""
        return self._norms is not None

    @property
    def max_grad_norm(self) -> float:
        """The sensitivity of one sample's clipped gradient: ``C``, or ``sqrt(Σ C_i²)``."""
        if self._norms is None:
            return self._flat
        return math.sqrt(sum(c * c for c in self._norms))

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        value = check_bound(value)
        if self._norms is None:
            self._flat = value
        else:
            ratio = value / self.max_grad_norm
            self._norms = [c * ratio for c in self._norms]

    @property
    def max_grad_norms(self) -> list[float] | None:
        """The per-parameter bounds (per-layer clipping), else ``None``."""
        return None if self._norms is None else list(self._norms)

    @max_grad_norms.setter
    def max_grad_norms(self, values: Sequence[float]) -> None:
        if self._norms is None and not self._index:
            raise ValueError("This contract clips flat: set max_grad_norm, not max_grad_norms.")
        values = [check_bound(c) for c in values]
        if len(values) != len(self._index):
            raise ValueError(
                f"max_grad_norms has {len(values)} entries but the contract covers "
                f"{len(self._index)} parameters."
            )
        self._norms = values

    def bound_for(self, p: torch.Tensor) -> float:
        """The bound of parameter ``p`` (per-layer), or ``C``."""
        if self._norms is None:
            return self._flat
        try:
            return self._norms[self._index[id(p)]]
        except KeyError:
            raise ValueError(
                f"Per-layer clipping has no bound for a parameter of shape {tuple(p.shape)}: it "
                "was not trainable (or not in the optimizer) when the optimizer was built, e.g. "
                "unfrozen after make_private. Unfreeze it before make_private and give it a "
                "bound, or keep it frozen."
            ) from None

    def snapshot(self) -> float | tuple[float, ...]:
        """The current bound(s) as an immutable value, to record which C a clipping used."""
        return self._flat if self._norms is None else tuple(self._norms)

    # ------------------------------------------------------------------ clipping
    @staticmethod
    def factors(norms: torch.Tensor, bound: float) -> torch.Tensor:
        """Clip factors ``min(1, bound / (norm + CLIP_EPS))``, shaped like ``norms``; 0 where a
        norm is not finite (inf or NaN: an overflowed norm whose sample cannot be clipped
        reliably is dropped, where ``bound / NaN`` would make the whole clipped sum NaN). No
        host synchronisation."""
        factors = (bound / (norms + CLIP_EPS)).clamp(max=1.0)
        return torch.where(torch.isfinite(norms), factors, 0.0)

    def layout(self, rows: int, where: str) -> BatchLayout | None:
        """The current batch's layout (``None``: every row is one unit), checked to have
        ``rows`` rows."""
        layout = self.layouts.training_layout()
        if layout is not None:
            layout.check_rows(rows, where)
        return layout

    def _masked(self, factors: torch.Tensor) -> torch.Tensor:
        """``factors (..., B)`` with 0 on the padding rows of the current batch."""
        layout = self.layout(factors.shape[-1], "clipping")
        if layout is None:
            return factors
        return factors * layout.valid.to(factors.device, factors.dtype)

    def flat_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """Flat clip factors for per-unit norms ``(..., B)`` over all parameters, 0 on padding
        rows."""
        if self.per_layer:
            raise ValueError("flat_factors() of a per-layer contract; use param_factors(p).")
        return self._masked(self.factors(norms, self._flat))

    def param_factors(self, norms: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Clip factors of parameter ``p``'s per-unit norms ``(..., B)`` with its bound
        (:meth:`bound_for`), 0 on padding rows."""
        return self._masked(self.factors(norms, self.bound_for(p)))

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum under adding/removing one sample (one pass)."""
        return self.max_grad_norm

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"max_grad_norm": self._flat, "max_grad_norms": self.max_grad_norms}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ``ValueError`` if ``state`` is of another kind (flat vs per-layer, or another
        number of per-layer bounds) than this contract."""
        norms = state.get("max_grad_norms")
        if (norms is None) != (self._norms is None) or (
            norms is not None and len(norms) != len(self._norms)
        ):
            kind = "flat" if norms is None else f"per-layer ({len(norms)} bounds)"
            mine = "flat" if self._norms is None else f"per-layer ({len(self._norms)} bounds)"
            raise ValueError(
                f"The checkpoint's clipping is {kind} but this optimizer's is {mine}: load it "
                "into an optimizer built with the same clipping mode (make_private(clipping=...))."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        if self._norms is None:
            self.max_grad_norm = state["max_grad_norm"]
        else:
            self.max_grad_norms = state["max_grad_norms"]

    def __repr__(self) -> str:
        if self._norms is None:
            return f"ClippingContract(C={self._flat:g})"
        return f"ClippingContract(per_layer, total C={self.max_grad_norm:g})"
