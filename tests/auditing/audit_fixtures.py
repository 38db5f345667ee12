"""Deliberately broken DP-SGD components, built only for the auditing tests.

Each one is a real dptorch component with one privacy bug, reached through the public
extension points (a registered ``grad_sample_mode`` whose optimizer class is the broken one, or
the audit's ``after_make_private`` hook); the audit must flag every one as a violation.
"""

from __future__ import annotations

import copy

import torch

from dptorch.data_loader import DPDataLoader
from dptorch.grad_sample import GradSampleModule
from dptorch.modes import Mode, register_mode
from dptorch.optimizers import DPOptimizer
from dptorch.optimizers.optimizer import UnitGrads


class ClipAtTwiceC(DPOptimizer):
    """Clips each sample's gradient to 2C; the noise is still calibrated to C."""

    def compute_clip_factors(self, unit_grads: UnitGrads | None = None) -> list[torch.Tensor]:
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        norms = self.per_sample_norms(unit_grads)
        factor = (2 * self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        return [factor] * len(unit_grads)


class HalfNoise(DPOptimizer):
    """Adds noise of std σC/2 (as if σ/2) while the accountant records σ."""

    @property
    def noise_std(self) -> float:
        return 0.5 * self.noise_multiplier * self.max_grad_norm


class Unclipped(DPOptimizer):
    """Releases every per-sample gradient unclipped."""

    def compute_clip_factors(self, unit_grads: UnitGrads | None = None) -> list[torch.Tensor]:
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        norms = self.per_sample_norms(unit_grads)
        return [torch.ones_like(norms)] * len(unit_grads)


class StaleClip(DPOptimizer):
    """The old bug: the clipping side keeps its own copy of C, taken at construction, so a C
    changed later (a scheduler, ``optimizer.max_grad_norm = ...``) moves the noise but not the
    clipping."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stale = copy.deepcopy(self.clipping)

    def compute_clip_factors(self, unit_grads: UnitGrads | None = None) -> list[torch.Tensor]:
        unit_grads = self._unit_grad_samples() if unit_grads is None else unit_grads
        factor = self._stale.flat_factors(self.per_sample_norms(unit_grads))
        return [factor] * len(unit_grads)


BROKEN_MODES = {
    "audit-bug-clip-2c": ClipAtTwiceC,
    "audit-bug-half-noise": HalfNoise,
    "audit-bug-unclipped": Unclipped,
    "audit-bug-stale-c": StaleClip,
}
for _name, _cls in BROKEN_MODES.items():
    register_mode(Mode(_name, GradSampleModule, optimizers={("flat", False): _cls}))


def halve_clipping_bound(module, optimizer, data_loader, criterion):
    """After ``make_private``: C ← C/2 through the optimizer (what a grad-clip scheduler does)."""
    optimizer.max_grad_norm = optimizer.max_grad_norm / 2
    return None


class LargerSampleRate:
    """After ``make_private``: batches drawn by a real Poisson DPDataLoader with rate
    ``sample_rate`` instead of the accounted one."""

    def __init__(self, sample_rate: float, seed: int = 5):
        self.sample_rate = sample_rate
        self.seed = seed

    def __call__(self, module, optimizer, data_loader, criterion):
        loader = DPDataLoader(
            data_loader.dataset,
            sample_rate=self.sample_rate,
            collate_fn=data_loader.dataset.collate,
            generator=torch.Generator().manual_seed(self.seed),
        )
        return module, optimizer, loader, criterion
