"""The white-box audit's model, data and loss: a probe whose per-sample gradients are exactly
the records' features, so that a canary record has a chosen ("Dirac") gradient.

The probe computes ``z = Σ_l W_l x`` with ``L`` bias-free ``Linear(d, 1)`` maps of the same input
and the per-sample loss ``z``; the per-sample gradient of every ``W_l`` is then ``x`` itself,
whatever the parameters. Canary ``k`` is the record ``x = a/√L · e_k`` (``a`` the canary's
gradient norm, ``≥ C``): its whole gradient lies on coordinate ``k`` of each ``W_l``, the unit
direction ``u_k = (e_k, …, e_k)/√L``. No other record has a gradient on coordinate ``k``, so
the released update projected on ``u_k`` is ``C`` (the clipped canary) when canary ``k`` is in
the batch, plus the mechanism's noise.

``K`` canary slots share one probe: slot ``k`` holds canary ``k`` when it is *present* (dataset
``D'``) and a record with a zero gradient otherwise (``D``; such a record changes nothing in a
correct DP-SGD step, and keeps the dataset size ``N``, which the accountant treats as public,
the same in both worlds). One optimizer step therefore gives ``K`` independent trials.
Background records (always present) have gradients on coordinates of their own.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = ["CanaryProbe", "CanarySlots", "ProbeLoss"]


class CanaryProbe(nn.Module):
    """``z = Σ_l W_l x`` for ``layers`` bias-free ``Linear(in_features, 1)`` maps.

    Input ``(B, in_features)``, output ``(B, 1)``. With the loss :class:`ProbeLoss` the
    per-sample gradient of each ``W_l`` is the sample's features ``x`` (shape ``(1, d)``).
    """

    def __init__(self, in_features: int, layers: int = 2):
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(in_features, 1, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.maps[0](x)
        for m in self.maps[1:]:
            out = out + m(x)
        return out

    @property
    def weights(self) -> list[nn.Parameter]:
        """The ``L`` weights ``W_l``, each ``(1, in_features)``."""
        return [m.weight for m in self.maps]


class ProbeLoss(nn.Module):
    """Per-sample loss ``z_b`` (the probe's output, summed over its last axis), reduced by
    ``reduction`` (``"mean"``, ``"sum"`` or ``"none"``, as torch losses; the ghost loss wrapper
    sets ``"none"`` while it calls it). The target is ignored."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, output: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        per_sample = (output.flatten(1) if output.dim() > 1 else output[:, None]).sum(1)
        if self.reduction == "none":
            return per_sample
        if self.reduction == "sum":
            return per_sample.sum()
        return per_sample.mean() if per_sample.numel() else per_sample.sum()


class CanarySlots(Dataset):
    """``N`` records of ``d`` features: ``K`` canary slots, then background records.

    Args:
        canaries: ``K``, the number of canary slots (canary ``k`` uses coordinate ``k``).
        background: the number of background records.
        background_dims: the coordinates ``K … K + background_dims − 1`` that background
            records use.
        canary_norm: ``a``, the gradient norm of a canary (all ``L`` layers together).
        background_norm: the typical gradient norm of a background record (norms spread
            between 0.5 and 1.5 times it, so some are clipped and some are not).
        layers: ``L``, the probe's number of maps (a record's gradient norm is ``√L ‖x‖``).
        generator: draws the background features.

    ``present`` (``(N,)`` bool) says which canaries are in the dataset; background records are
    always present. Items are indices; :meth:`collate` gathers the rows of a batch (a batch is
    one tensor gather rather than ``B`` item look-ups), returning the 1-tuple ``(x,)`` with
    ``x`` of shape ``(B, d)``.
    """

    def __init__(
        self,
        canaries: int,
        background: int,
        *,
        background_dims: int = 8,
        canary_norm: float = 2.0,
        background_norm: float = 1.0,
        layers: int = 2,
        generator: torch.Generator | None = None,
    ):
        self.canaries = canaries
        self.dims = canaries + background_dims
        n = canaries + background
        self.features = torch.zeros(n, self.dims)
        idx = torch.arange(canaries)
        self.features[idx, idx] = canary_norm / math.sqrt(layers)
        if background:
            z = torch.randn(background, background_dims, generator=generator)
            z = z / z.norm(dim=1, keepdim=True).clamp_min(1e-12)
            scale = background_norm * (0.5 + torch.rand(background, 1, generator=generator))
            self.features[canaries:, canaries:] = z * scale / math.sqrt(layers)
        self.present = torch.ones(n, dtype=torch.bool)

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int) -> int:
        return int(index)

    def set_canaries(self, present: torch.Tensor) -> None:
        """Puts canary ``k`` in the dataset iff ``present[k]`` (``(K,)`` bool)."""
        self.present[: self.canaries] = present

    def collate(self, indices: list[int]) -> tuple[torch.Tensor]:
        """``(x,)``: the features of the records ``indices``, zero for absent canaries."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        rows = self.features[idx]
        return (rows * self.present[idx, None].to(rows.dtype),)
