"""DP-SGD with adaptive (quantile) clipping, Andrew et al. 2021 (arXiv:1905.03871)."""

from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from ..utils.randomness import generate_noise
from .optimizer import DPOptimizer, UnitGrads

__all__ = ["AdaClipDPOptimizer"]


class AdaClipDPOptimizer(DPOptimizer):
    """:class:`DPOptimizer` whose clipping norm tracks a quantile of the per-sample norms.

    At each step the *centred* count of samples whose gradient was not clipped,
    ``s = Σ_b (1[unclipped_b] − 1/2)``, is released with Gaussian noise,
    ``s̃ = s + N(0, unclipped_num_std²)`` (kept in ``unclipped_num``), and the clipping norm moves
    geometrically towards the ``target_unclipped_quantile``::

        C ← clamp(C · exp(-clipbound_learning_rate · (s̃ / m + 1/2 - target_unclipped_quantile)),
                  min_clipbound, max_clipbound)

    where ``m`` is the expected (logical) batch size, a public quantity (the actual batch size is
    not: dividing by it would release it).

    Privacy: the gradient and the count are two Gaussian releases. Adding or removing one record
    moves ``s`` by exactly 1/2 (a plain 0/1 count would move by 1), so the count's noise
    multiplier is ``2 · unclipped_num_std``. ``noise_multiplier`` (σ) is the *total* noise
    multiplier, the one the accountant uses; the gradient gets the adjusted
    ``σ_grad = (σ⁻² − (2 · unclipped_num_std)⁻²)^(-1/2)`` (Theorem 1 of Andrew et al. 2021, which
    assumes this centred count) so that both together cost what a single σ release costs. This
    needs ``σ < 2 · unclipped_num_std``.

    Args:
        target_unclipped_quantile: target fraction of unclipped samples, in [0, 1].
        clipbound_learning_rate: step size η of the geometric update (>= 0).
        max_clipbound / min_clipbound: bounds of the clipping norm (``0 < min < max``).
        unclipped_num_std: std of the noise on the unclipped count (> 0).
        max_grad_norm: initial clipping norm.
        Other arguments: as :class:`DPOptimizer`.

    Multi-pass with split clipping (``accum_passes=False``) is refused: one record would move
    the count of every private pass, which the count's noise does not cover.
    """

    #: read by the multi-pass variant (``optimizers/multi_pass.py``)
    supports_split_clipping = False

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        target_unclipped_quantile: float,
        clipbound_learning_rate: float,
        max_clipbound: float,
        min_clipbound: float,
        unclipped_num_std: float,
        max_grad_norm: float,
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
        if expected_batch_size is None or expected_batch_size <= 0:
            raise ValueError(
                "AdaClipDPOptimizer needs expected_batch_size (> 0) for the unclipped fraction."
            )
        if not (0 < min_clipbound < max_clipbound):
            raise ValueError(
                "max_clipbound must be larger than min_clipbound. "  # Opacus's text
                f"Need 0 < min_clipbound < max_clipbound, got {min_clipbound}, {max_clipbound}."
            )
        if not (0 <= target_unclipped_quantile <= 1):
            raise ValueError(
                f"target_unclipped_quantile must be in [0, 1], got {target_unclipped_quantile}."
            )
        if not (clipbound_learning_rate >= 0):
            raise ValueError(f"clipbound_learning_rate must be >= 0, got {clipbound_learning_rate}.")
        if not (unclipped_num_std > 0):
            raise ValueError(f"unclipped_num_std must be > 0, got {unclipped_num_std}.")
        if noise_multiplier > 0 and noise_multiplier >= 2 * unclipped_num_std:
            raise ValueError(
                "noise_multiplier must be smaller than 2 * unclipped_num_std. "  # Opacus's text
                f"noise_multiplier ({noise_multiplier}) must be < 2 * unclipped_num_std "
                f"({2 * unclipped_num_std}): the count release alone would exceed the privacy "
                "budget of noise_multiplier (Theorem 1, Andrew et al. 2021). Increase "
                "unclipped_num_std (e.g. to expected_batch_size / 20)."
            )
        self.target_unclipped_quantile = target_unclipped_quantile
        self.clipbound_learning_rate = clipbound_learning_rate
        self.max_clipbound = max_clipbound
        self.min_clipbound = min_clipbound
        self.unclipped_num_std = unclipped_num_std
        self.sample_size = 0
        self.unclipped_num: float = 0.0

    @property
    def gradient_noise_multiplier(self) -> float:
        """σ_grad = (σ⁻² − (2 · unclipped_num_std)⁻²)^(-1/2), the gradient's share of σ."""
        sigma = self.noise_multiplier
        if sigma == 0:
            return 0.0
        inv = sigma**-2 - (2 * self.unclipped_num_std) ** -2
        if inv <= 0:
            raise ValueError(
                f"noise_multiplier ({sigma}) must be < 2 * unclipped_num_std "
                f"({2 * self.unclipped_num_std}) with adaptive clipping."
            )
        return inv**-0.5

    @property
    def noise_std(self) -> float:
        return self.gradient_noise_multiplier * self.max_grad_norm * self.noise_scale_factor

    def compute_clip_factors(self, unit_grads: UnitGrads | None = None) -> list[torch.Tensor]:
        """Flat clip factors; also adds the centred count ``Σ (1[factor = 1] − 1/2)`` of the
        units left unclipped (sensitivity 1/2 under add/remove)."""
        factors = super().compute_clip_factors(unit_grads)
        if factors:
            f = factors[0]
            self.sample_size += f.numel()
            self.unclipped_num += float((f >= 1.0).sum().item()) - 0.5 * f.numel()
        return factors

    def add_noise(self) -> None:
        """Noise on the gradient (σ_grad) and on the unclipped count (``unclipped_num_std``)."""
        super().add_noise()
        ref = torch.zeros((), dtype=torch.float64)
        noise = generate_noise(self.unclipped_num_std, ref, self.generator, self.secure_mode)
        self.unclipped_num = self.unclipped_num + float(noise.item())

    def update_max_grad_norm(self) -> None:
        """Geometric update of C from the noisy unclipped fraction, clamped to the bounds."""
        denom = self.expected_batch_size * self.accumulated_iterations
        unclipped_frac = self.unclipped_num / denom + 0.5
        new = self.max_grad_norm * math.exp(
            -self.clipbound_learning_rate * (unclipped_frac - self.target_unclipped_quantile)
        )
        self.max_grad_norm = min(self.max_clipbound, max(self.min_clipbound, new))

    def pre_step(self, closure=None) -> bool:
        done = super().pre_step(closure)
        if done:
            self.update_max_grad_norm()
        return done

    def _drop_pending(self) -> None:
        """Also resets the counts of the dropped skipped steps."""
        super()._drop_pending()
        self.sample_size = 0
        self.unclipped_num = 0.0

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Also resets the counts, except after a skipped step (physical batch of a logical one)."""
        if not self._is_last_step_skipped:
            self.sample_size = 0
            self.unclipped_num = 0.0
        super().zero_grad(set_to_none)
