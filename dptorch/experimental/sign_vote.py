"""Sign-vote engine: a noisy majority vote of per-sample gradient signs (DP signSGD).

Every example votes ``v_i = sign(g_i) ∈ {−1, 0, +1}^d`` over all ``d`` trainable coordinates
(a NaN entry of ``g_i`` votes 0). The vote counts ``c = Σ_i v_i`` change by one vote vector when
an example is added or removed, so their L2 sensitivity is ``max ‖v_i‖₂ ≤ √d``. Releasing
``c + N(0, σ² d I)`` is therefore the Gaussian mechanism with noise multiplier σ; with Poisson
sampling at rate ``q`` each step is a sampled Gaussian mechanism, accounted by ``RDPAccountant``
at ``(σ, q)``. The update direction ``sign(c + noise)`` (or the noisy counts rescaled) is
post-processing.

``d`` is counted at every step over the parameters trainable at that step (``requires_grad``),
so freezing or unfreezing parameters between steps keeps the noise multiplier at σ.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..grad_sample.gsm_base import clear_grad_sample
from ..utils.randomness import generate_noise
from ._base import PerSampleGradientMixin, RDPAccountedEngine, as_grad_sample_module

_OUTPUTS = ("sign", "mean")


def sign_vote_counts(grad_sample: torch.Tensor) -> torch.Tensor:
    """``Σ_i sign(g_i)``: per-coordinate vote counts of a ``(B, *shape)`` per-sample gradient.

    Returns a ``(*shape)`` tensor of ``grad_sample``'s dtype. Each entry votes ``+1`` if ``> 0``
    (``+inf`` included), ``−1`` if ``< 0`` (``−inf`` included) and ``0`` otherwise, NaN included,
    so every example's vote vector lies in ``{−1, 0, +1}^shape`` whatever its gradient.
    """
    positive = (grad_sample > 0).to(grad_sample.dtype)
    negative = (grad_sample < 0).to(grad_sample.dtype)
    return (positive - negative).sum(dim=0)


def _num_coordinates(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _noise_std(noise_multiplier: float, num_coordinates: int) -> float:
    return noise_multiplier * math.sqrt(num_coordinates)


class SignVotePrivacyEngine(PerSampleGradientMixin, RDPAccountedEngine):
    """Majority vote of per-sample gradient signs with Gaussian noise on the vote counts.

    Guarantee: (ε, δ)-DP under add/remove adjacency with Poisson sampling — each step is the
    Gaussian mechanism on vote counts of L2 sensitivity √d with noise std σ√d, accounted by the
    sampled-Gaussian ``RDPAccountant`` at noise multiplier σ.

    The model is wrapped in a :class:`~dptorch.grad_sample.GradSampleModule` (``engine.module``).
    Loop: ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` (for an empty Poisson
    batch call ``engine.backward(None)`` instead, so the step still releases noise).

    Args:
        module, optimizer: the model and its ``torch.optim.Optimizer``.
        noise_multiplier: σ > 0; the count noise std is ``σ √d``, with ``d`` the number of
            coordinates trainable at the step (recounted every step).
        sample_rate / data_loader: ``q``, the probability that every record joins every batch
            independently (train on Poisson batches at that rate); or a loader drawing such
            batches, whose ``q`` is read: a ``DPDataLoader`` or a ``DataLoader`` whose batch
            sampler is ``UniformWithReplacementSampler``. Any other loader (shuffled fixed-size
            batches, sampling with replacement, the fixed-shape or user-level loaders of
            ``make_private``) raises ``ValueError``: the analysis does not cover it.
        output: ``"sign"`` — ``p.grad = sign(noisy counts)`` (signSGD; use a small learning
            rate); ``"mean"`` — ``p.grad = noisy counts / expected_batch_size``.
        expected_batch_size: needed for ``output="mean"``.
        loss_reduction: reduction of the loss (signs do not depend on it).
        generator / secure_mode: noise randomness, as in ``DPOptimizer``.
    """

    is_approximate = False
    guarantee = (
        "(epsilon, delta)-DP under add/remove adjacency with Poisson sampling: Gaussian "
        "mechanism on sign-vote counts (L2 sensitivity sqrt(d), noise std sigma*sqrt(d)), "
        "accounted by the sampled-Gaussian RDP accountant at noise multiplier sigma."
    )

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        sample_rate: float | None = None,
        data_loader: Any | None = None,
        output: str = "sign",
        expected_batch_size: int | None = None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
    ):
        if output not in _OUTPUTS:
            raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}.")
        if output == "mean" and (
            isinstance(expected_batch_size, bool)
            or not isinstance(expected_batch_size, int)
            or expected_batch_size <= 0
        ):
            raise ValueError(
                "output='mean' needs expected_batch_size (a positive int, sample_rate * "
                f"len(dataset)), got {expected_batch_size!r}."
            )
        super().__init__(
            module,
            optimizer,
            wrap=partial(as_grad_sample_module, loss_reduction=loss_reduction),
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            data_loader=data_loader,
            generator=generator,
            secure_mode=secure_mode,
        )
        self.output = output
        self.expected_batch_size = expected_batch_size

    @property
    def num_coordinates(self) -> int:
        """``d``: number of coordinates of the parameters trainable now (``requires_grad``)."""
        return _num_coordinates(self.params)

    @property
    def noise_std(self) -> float:
        """Std of the noise on every vote count: ``σ √d``, ``d`` = :attr:`num_coordinates` now."""
        return _noise_std(self.noise_multiplier, self.num_coordinates)

    def backward(self, loss: torch.Tensor | None, inputs: Any = None) -> None:
        """``loss.backward()``; ``loss=None`` marks an empty batch (zero votes, noise only)."""
        if loss is not None:
            loss.backward()
        self._pending = True

    def noisy_counts(self) -> list[torch.Tensor]:
        """Noisy vote counts, one tensor of shape ``p.shape`` per trainable parameter ``p``.

        The parameters are those trainable now, ``d`` their total number of coordinates; each
        count gets ``N(0, σ² d)`` noise (zero votes where ``p`` has no per-sample gradient).
        """
        return self._noisy_counts(self.params)

    def _noisy_counts(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        std = _noise_std(self.noise_multiplier, _num_coordinates(params))
        out = []
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if isinstance(gs, list):
                raise ValueError(
                    "Per-sample gradients were accumulated over several backward passes; run "
                    "one loss.backward() per step."
                )
            counts = torch.zeros_like(p) if gs is None else sign_vote_counts(gs)
            out.append(counts + generate_noise(std, counts, self.generator, self.secure_mode))
        return out

    def _privatize(self) -> None:
        self.check_no_frozen_grad_samples()
        params = self.params
        for p, counts in zip(params, self._noisy_counts(params)):  # every count before any p.grad
            if self.output == "sign":
                p.grad = torch.sign(counts)
            else:
                p.grad = counts / self.expected_batch_size
            clear_grad_sample(p)
