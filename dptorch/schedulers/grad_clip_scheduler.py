"""Clipping-norm schedulers: change ``optimizer.max_grad_norm`` between epochs.

The noise std is ``noise_multiplier × max_grad_norm`` at each step, so a clipping schedule does
not change the privacy cost (which depends only on the noise multiplier).
"""

from __future__ import annotations

from collections.abc import Callable

from ._base import (
    _DPParamScheduler,
    check_max_grad_norm,
    check_step_size,
    exponential_rule,
    step_rule,
)

__all__ = ["_GradClipScheduler", "ExponentialGradClip", "LambdaGradClip", "StepGradClip"]


class _GradClipScheduler(_DPParamScheduler):
    """Base class: subclasses implement :meth:`get_max_grad_norm` for ``self.last_epoch``."""

    _attr = "max_grad_norm"
    _hint = "clipping schedulers act on DP optimizers"

    def get_max_grad_norm(self) -> float:
        """The clipping norm for epoch ``self.last_epoch``."""
        raise NotImplementedError

    def _next_value(self) -> float:
        return self.get_max_grad_norm()

    def _check_value(self, value: float) -> None:
        check_max_grad_norm(value)


class ExponentialGradClip(_GradClipScheduler):
    """Multiplies the clipping norm by ``gamma`` at every ``step()``."""

    def __init__(self, optimizer, *, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def get_max_grad_norm(self) -> float:
        return exponential_rule(self.optimizer.max_grad_norm, self.gamma, self.last_epoch)


class LambdaGradClip(_GradClipScheduler):
    """Clipping norm = initial norm × ``scheduler_function(epoch)`` (no accumulation)."""

    def __init__(
        self, optimizer, *, scheduler_function: Callable[[int], float], last_epoch: int = -1
    ):
        self.scheduler_function = scheduler_function
        self.base_max_grad_norm = optimizer.max_grad_norm
        super().__init__(optimizer, last_epoch=last_epoch)

    def get_max_grad_norm(self) -> float:
        return self.base_max_grad_norm * self.scheduler_function(self.last_epoch)


class StepGradClip(_GradClipScheduler):
    """Multiplies the clipping norm by ``gamma`` every ``step_size`` epochs."""

    def __init__(self, optimizer, *, step_size: int, gamma: float, last_epoch: int = -1):
        check_step_size(step_size)
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def get_max_grad_norm(self) -> float:
        return step_rule(self.optimizer.max_grad_norm, self.gamma, self.step_size, self.last_epoch)
