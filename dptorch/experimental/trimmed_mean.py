"""Trimmed-mean engine: per-coordinate trimmed mean of clamped per-sample gradients, released
with smooth-sensitivity Laplace-log-normal (LLN) noise and accounted in zero-concentrated DP.

Mechanism, for every coordinate ``j`` of every trainable tensor and a batch of ``n`` examples:

1. clamp the per-sample gradients to ``[a, b] = [min_val, max_val]`` and sort them; a
   non-finite entry is first mapped into ``[a, b]`` (``−inf → a``, ``+inf → b``, NaN → 0
   clamped to ``[a, b]``), so an example with a NaN or infinite gradient is one in-range
   example like any other;
2. ``TM_j`` = mean of the middle ``n − 2m`` values (``m`` trimmed from each end);
3. ``S_j`` = the ``t``-smooth sensitivity of the trimmed mean under replace-one adjacency
   (Bun & Steinke 2019)::

       S_j = max_{k ≥ 0} e^{−t k} max_{0 ≤ l ≤ k+1} (x_(n−m+1+k−l) − x_(m+1−l)) / (n − 2m)

   with order statistics ``x_(i) = a`` for ``i ≤ 0`` and ``x_(i) = b`` for ``i ≥ n + 1``;
4. release ``TM_j + (S_j / s) · Z_j`` with ``Z_j = X · exp(σ_L Y)``, ``X ~ Laplace(0, 1)``,
   ``Y ~ N(0, 1)``.

By the LLN theorem of Bun & Steinke ("Average-case averages", NeurIPS 2019), step 4 is
``½ ε_c²``-zCDP with ``ε_c = t/σ_L + e^{1.5 σ_L²} s``. Given a per-coordinate budget
``ρ_c = ρ / d`` (``d`` coordinates released, i.e. trainable at that step: ``d`` is recounted
every step, so freezing or unfreezing parameters keeps a step at ``ρ``; zCDP composes
additively) we set
``ε_c = √(2 ρ_c)``, pick ``σ_L`` minimizing the noise std ``∝ e^{2.5 σ_L²} / (ε_c − t/σ_L)``,
i.e. the positive root of ``5 ε_c σ³ − 5 t σ² − t = 0``, and ``s = (ε_c − t/σ_L) e^{−1.5 σ_L²}``.
So one step is ``ρ``-zCDP. If every example is in exactly one batch of an epoch (a shuffled
partition into fixed-size batches, *not* Poisson sampling), an epoch is ``ρ``-zCDP too
(parallel composition; the shuffle is data-independent), ``E`` epochs are ``E ρ``-zCDP, and
``(ρ_tot + 2 √(ρ_tot log(1/δ)), δ)``-DP follows (Bun & Steinke 2016, Prop. 1.3).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from ..grad_sample.gsm_base import clear_grad_sample
from ._base import (
    ExperimentalPrivacyEngine,
    PerSampleGradientMixin,
    as_grad_sample_module,
    describe_loader,
    validate_positive,
)

logger = logging.getLogger(__name__)

def trimmed_mean(x: torch.Tensor, m: int, dim: int = 0) -> torch.Tensor:
    """Mean of ``x`` along ``dim`` after dropping the ``m`` smallest and ``m`` largest values."""
    n = x.shape[dim]
    if not 0 <= 2 * m < n:
        raise ValueError(f"Cannot trim m={m} values from each end of {n} values (need 2m < n).")
    return x.sort(dim=dim).values.narrow(dim, m, n - 2 * m).mean(dim=dim)


def clamp_with_nonfinite(x: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """``x`` (any shape) with every entry mapped into ``[lower, upper]``, same shape and dtype.

    Finite entries are clamped; ``−inf → lower``, ``+inf → upper`` and NaN → ``0`` clamped to
    ``[lower, upper]``. ``torch.clamp`` alone keeps NaN, which would make the trimmed mean and
    its smooth sensitivity NaN for every coordinate the entry's example touches.
    """
    nan_fill = min(max(0.0, lower), upper)
    return torch.nan_to_num(x, nan=nan_fill, posinf=upper, neginf=lower).clamp(lower, upper)


def trimmed_mean_smooth_sensitivity(
    x: torch.Tensor, m: int, t: float, lower: float, upper: float
) -> torch.Tensor:
    """``t``-smooth sensitivity of the trimmed mean of each row of ``x`` (values in [lower, upper]).

    Args:
        x: ``(d, n)``: ``d`` independent rows of ``n`` values, already clamped to the bounds.
        m: number of values trimmed from each end (``2m < n``).
        t: smoothness parameter (> 0).
        lower, upper: the clamping bounds ``a < b``.

    Returns:
        ``(d,)`` smooth sensitivities under replace-one adjacency (see the module docstring).
    """
    d, n = x.shape
    if not 0 <= 2 * m < n:
        raise ValueError(f"Cannot trim m={m} values from each end of {n} values (need 2m < n).")
    srt = x.sort(dim=1).values
    # padded[:, n + 1 + i] = x_(i) for every i in [-(n+1), 2n+1]: a below 1, b above n
    padded = torch.cat(
        [srt.new_full((d, n + 2), lower), srt, srt.new_full((d, n + 2), upper)], dim=1
    )
    off = n + 1
    best = srt.new_zeros(d)
    for k in range(n + 1):
        decay = math.exp(-t * k)
        if decay * (upper - lower) <= float(best.min()):
            break  # A^(k) <= b - a: no larger k can raise any row's maximum
        # l = 0..k+1  ->  lower index m+1-l runs over m-k..m+1, upper index is n-2m+k above it
        lo = padded[:, off + m - k : off + m + 2]
        hi = padded[:, off + n - m : off + n - m + k + 2]
        best = torch.maximum(best, decay * (hi - lo).max(dim=1).values)
    return best / (n - 2 * m)


def sample_laplace_log_normal(
    shape: tuple[int, ...] | torch.Size,
    sigma: float,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``X · exp(σ Y)`` with ``X ~ Laplace(0, 1)``, ``Y ~ N(0, 1)`` (variance ``2 e^{2σ²}``)."""
    e1 = torch.empty(shape, dtype=dtype, device=device).exponential_(generator=generator)
    e2 = torch.empty(shape, dtype=dtype, device=device).exponential_(generator=generator)
    y = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    return (e1 - e2) * torch.exp(sigma * y)


def lln_calibration(epsilon: float, t: float) -> tuple[float, float]:
    """``(σ_L, s)`` giving ``½ ε²``-zCDP for LLN noise with smoothness ``t`` and the least std.

    ``ε = t/σ_L + e^{1.5 σ_L²} s``; the std of ``Z/s`` is ``√2 e^{2.5 σ_L²} / (ε − t/σ_L)``,
    minimized at the unique positive root of ``5 ε σ³ − 5 t σ² − t = 0``.
    """
    validate_positive("epsilon", epsilon)
    validate_positive("t", t)
    roots = np.roots([5.0 * epsilon, -5.0 * t, 0.0, -t])
    sigma = float(max(r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0))
    s = (epsilon - t / sigma) * math.exp(-1.5 * sigma**2)
    return sigma, s


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """``ρ``-zCDP implies ``(ρ + 2√(ρ log(1/δ)), δ)``-DP."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


_PARTITION_FIX = (
    "Fix: use a torch DataLoader whose batches partition the records, e.g. "
    "DataLoader(dataset, batch_size=b, shuffle=True, drop_last=True) (a RandomSampler without "
    "replacement; a SequentialSampler or a SubsetRandomSampler of distinct indices work too), or "
    "pass steps_per_epoch=... instead of data_loader=... if you guarantee yourself that every "
    "example is in at most one batch of each epoch."
)


def partition_steps_per_epoch(data_loader: Any) -> int:
    """``len(data_loader)``, when every pass over ``data_loader`` provably puts each record in
    at most one batch, which is the trimmed-mean analysis's assumption (one step of an epoch
    touches the replaced record). Trusted are the loaders dptorch's main engine trusts to use
    every record at most once per pass (:func:`~dptorch.data_loader.uses_each_record_once`,
    behind :func:`~dptorch.data_loader.steps_per_pass`): torch's ``BatchSampler`` over a
    ``SequentialSampler``, a ``RandomSampler`` without replacement, a ``SubsetRandomSampler`` of
    distinct indices or a ``DistributedSampler`` that pads nothing. Any other loader raises
    ``ValueError``: Poisson loaders, samplers with replacement, custom (batch) samplers,
    iterable datasets.
    """
    from torch.utils.data import DataLoader

    from .. import data_loader as dl

    batch_sampler = getattr(data_loader, "batch_sampler", None)
    if (
        getattr(data_loader, "sample_rate", None) is not None
        or getattr(batch_sampler, "sample_rate", None) is not None
    ):
        raise ValueError(
            "The trimmed-mean analysis needs every example in at most one fixed-size batch per "
            f"epoch; {describe_loader(data_loader)} draws Poisson batches (sample_rate), where an "
            "example can be in any number of batches of an epoch. " + _PARTITION_FIX
        )
    if not isinstance(data_loader, DataLoader):
        raise ValueError(
            f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}: "
            "the trimmed-mean analysis needs every example in at most one batch per epoch, which "
            "dptorch can check only on a DataLoader's sampler. " + _PARTITION_FIX
        )
    once = getattr(dl, "uses_each_record_once", None)
    try:
        per_pass = dl.steps_per_pass(data_loader, poisson_sampling=False)
        batches = len(data_loader)
        # steps_per_pass answers len(data_loader) for a trusted loader, else 1: ambiguous for a
        # loader of one batch, which only the predicate behind it (when there is one) settles
        trusted = once(data_loader) if once is not None else per_pass == batches >= 2
    except (TypeError, ValueError) as e:
        raise ValueError(
            "The trimmed-mean analysis needs every example in at most one batch per epoch, and "
            f"{describe_loader(data_loader)} cannot be shown to do that: {e} " + _PARTITION_FIX
        ) from None
    if batches == 0:
        raise ValueError(
            f"{describe_loader(data_loader)} yields no batch (len(data_loader) == 0): use a "
            "batch size of at most the number of examples, or drop_last=False."
        )
    if trusted:
        return batches
    if once is None and batches == 1 and per_pass == 1:
        raise ValueError(
            f"{describe_loader(data_loader)} yields a single batch per epoch, and dptorch cannot "
            "tell whether its sampler can put an example in it more than once (the trimmed-mean "
            "analysis needs every example in at most one batch, once). Pass steps_per_epoch=1 "
            "instead of data_loader=... if every example is in the batch at most once (e.g. "
            "DataLoader(dataset, batch_size=len(dataset), shuffle=True))."
        )
    raise ValueError(
        "The trimmed-mean analysis needs every example in at most one batch per epoch (so that "
        f"an epoch is one rho-zCDP release per example), and {describe_loader(data_loader)} is "
        "not known to do that: a sampler with replacement or a weighted one can put an example "
        "in several batches or twice in one, and a custom sampler, batch sampler or iterable "
        "dataset is not checked. " + _PARTITION_FIX
    )


class TrimmedMeanPrivacyEngine(PerSampleGradientMixin, ExperimentalPrivacyEngine):
    """Trimmed mean of clamped per-sample gradients with smooth-sensitivity LLN noise.

    Guarantee: ``rho_per_epoch × epochs``-zCDP, hence ``(ρ + 2√(ρ log 1/δ), δ)``-DP, under
    replace-one adjacency, provided each example is in exactly one fixed-size batch per epoch
    (a shuffled, non-Poisson loader); it rests on Bun & Steinke's LLN smooth-sensitivity
    theorem and does not cover add/remove adjacency.

    The model is wrapped in a :class:`~dptorch.grad_sample.GradSampleModule` (``engine.module``).
    Loop: ``loss = criterion(engine.module(x), y); loss.backward(); optimizer.step();
    optimizer.zero_grad()``. The released gradient is the noisy trimmed mean (a mean, so no
    further scaling).

    Args:
        module, optimizer: the model and its ``torch.optim.Optimizer``.
        rho_per_epoch: zCDP budget ρ of one epoch (split evenly over the ``d`` coordinates
            trainable at each step; ``d`` is recounted every step).
        steps_per_epoch / data_loader: number of batches per epoch, or a ``DataLoader`` whose
            batches put every example in at most one batch per epoch (``len(data_loader)``; see
            :func:`partition_steps_per_epoch`: other loaders, Poisson ones included, raise
            ``ValueError``).
        m_trim: number of values trimmed from each end; or ``trim_fraction`` in ``[0, 0.5)``,
            ``m = floor(trim_fraction · n)`` for a batch of ``n`` (default 0.1).
        min_val, max_val: per-coordinate clamping bounds of the per-sample gradients
            (non-finite entries are mapped into them, see :func:`clamp_with_nonfinite`).
        smooth_sensitivity_t: smoothness parameter ``t`` > 0.
        loss_reduction: reduction of the loss (``GradSampleModule`` undoes ``"mean"``).
        generator: random generator for the noise.
    """

    is_approximate = False
    guarantee = (
        "rho-zCDP per epoch (so (rho_tot + 2*sqrt(rho_tot*log(1/delta)), delta)-DP) under "
        "replace-one adjacency, assuming every example is in exactly one fixed-size batch per "
        "epoch (shuffled partition, not Poisson sampling), via Bun & Steinke's LLN "
        "smooth-sensitivity theorem; not an add/remove guarantee."
    )

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        *,
        rho_per_epoch: float,
        steps_per_epoch: int | None = None,
        data_loader: Any | None = None,
        m_trim: int | None = None,
        trim_fraction: float | None = None,
        min_val: float = -1.0,
        max_val: float = 1.0,
        smooth_sensitivity_t: float = 0.01,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
    ):
        self.rho_per_epoch = validate_positive("rho_per_epoch", rho_per_epoch)
        self.t = validate_positive("smooth_sensitivity_t", smooth_sensitivity_t)
        if not (math.isfinite(min_val) and math.isfinite(max_val) and min_val < max_val):
            raise ValueError(f"Need finite min_val < max_val, got [{min_val}, {max_val}].")
        if m_trim is not None and trim_fraction is not None:
            raise ValueError("Pass m_trim or trim_fraction, not both.")
        if m_trim is not None and (isinstance(m_trim, bool) or not isinstance(m_trim, int) or m_trim < 0):
            raise ValueError(f"m_trim must be an int >= 0, got {m_trim!r}.")
        if m_trim is None:
            trim_fraction = 0.1 if trim_fraction is None else trim_fraction
            if isinstance(trim_fraction, bool) or not isinstance(trim_fraction, (int, float)) or not (
                0 <= trim_fraction < 0.5
            ):
                raise ValueError(
                    f"trim_fraction must be in [0, 0.5), got {trim_fraction!r}: it is the "
                    "fraction of each batch trimmed from each end."
                )
        self.m_trim = m_trim
        self.trim_fraction = trim_fraction
        self.min_val, self.max_val = float(min_val), float(max_val)
        self.steps_per_epoch = self._resolve_steps_per_epoch(steps_per_epoch, data_loader)
        super().__init__(
            module, optimizer, generator=generator,
            wrap=partial(as_grad_sample_module, loss_reduction=loss_reduction),
        )
        self._calibrations: dict[int, tuple[float, float, float]] = {}
        self._calibration(self.num_coordinates)  # logs the calibration at construction

    def _calibration(self, num_coordinates: int) -> tuple[float, float, float]:
        """``(ε_c, σ_L, s)`` for ``d = num_coordinates``: ``ε_c = √(2ρ/d)``, LLN ``(σ_L, s)``."""
        if num_coordinates not in self._calibrations:
            eps_c = math.sqrt(2.0 * self.rho_per_epoch / num_coordinates)
            sigma, s = lln_calibration(eps_c, self.t)
            self._calibrations[num_coordinates] = (eps_c, sigma, s)
            logger.info(
                "TrimmedMeanPrivacyEngine: d=%d coordinates, eps_c=%.4g, LLN sigma=%.4g, s=%.4g",
                num_coordinates, eps_c, sigma, s,
            )
        return self._calibrations[num_coordinates]

    @property
    def num_coordinates(self) -> int:
        """``d``: number of coordinates of the parameters trainable now (``requires_grad``)."""
        return sum(p.numel() for p in self.params)

    @property
    def epsilon_per_coordinate(self) -> float:
        """``ε_c = √(2ρ/d)`` for the current :attr:`num_coordinates` ``d``."""
        return self._calibration(self.num_coordinates)[0]

    @property
    def lln_sigma(self) -> float:
        """LLN ``σ_L`` for the current :attr:`num_coordinates`."""
        return self._calibration(self.num_coordinates)[1]

    @property
    def lln_s(self) -> float:
        """LLN ``s`` for the current :attr:`num_coordinates`."""
        return self._calibration(self.num_coordinates)[2]

    @staticmethod
    def _resolve_steps_per_epoch(steps_per_epoch: int | None, data_loader: Any | None) -> int:
        if data_loader is not None:
            if steps_per_epoch is not None:
                raise ValueError("Pass steps_per_epoch or data_loader, not both.")
            steps_per_epoch = partition_steps_per_epoch(data_loader)
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
            raise ValueError(
                f"steps_per_epoch must be a positive int (batches per epoch), got {steps_per_epoch!r}."
            )
        return steps_per_epoch

    def trim_count(self, n: int) -> int:
        """``m`` for a batch of ``n`` examples."""
        m = self.m_trim if self.m_trim is not None else int(math.floor(self.trim_fraction * n))
        if 2 * m >= n:
            raise ValueError(
                f"A batch of {n} examples cannot have m={m} values trimmed from each end; use "
                "larger batches (drop_last=True) or a smaller trim."
            )
        return m

    def noise_scale(self, sensitivity: torch.Tensor) -> torch.Tensor:
        """Multiplier ``S / s`` of the LLN variable ``Z`` for a coordinate of smooth sensitivity
        ``S`` (``s`` for the current :attr:`num_coordinates`); same shape as ``sensitivity``."""
        return sensitivity / self.lln_s

    def _privatize(self) -> None:
        self.check_no_frozen_grad_samples()
        params = self.params
        gss = self.grad_samples()
        n = gss[0].shape[0]
        m = self.trim_count(n)
        _, lln_sigma, lln_s = self._calibration(sum(p.numel() for p in params))
        grads = []
        for gs in gss:
            x = clamp_with_nonfinite(gs.reshape(n, -1).t(), self.min_val, self.max_val)  # (d_p, n)
            tm = trimmed_mean(x, m, dim=1)
            sens = trimmed_mean_smooth_sensitivity(x, m, self.t, self.min_val, self.max_val)
            z = sample_laplace_log_normal(
                tm.shape, lln_sigma, generator=self.generator, dtype=tm.dtype, device=tm.device
            )
            grads.append(tm + (sens / lln_s) * z)
        for p, g in zip(params, grads):  # nothing is released before every tensor is computed
            p.grad = g.view_as(p)
            clear_grad_sample(p)

    def _account(self) -> None:
        pass  # the budget is a function of the number of epochs, see _epsilon

    @property
    def epochs(self) -> int:
        """Epochs started so far (each is charged ``rho_per_epoch``)."""
        return math.ceil(self.steps / self.steps_per_epoch)

    @property
    def rho(self) -> float:
        """Total zCDP ρ spent so far."""
        return self.rho_per_epoch * self.epochs

    def _epsilon(self, delta: float) -> float:
        return zcdp_to_epsilon(self.rho, delta) if self.steps else 0.0
