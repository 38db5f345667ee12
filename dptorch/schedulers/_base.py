"""Shared machinery of the noise and clipping-norm schedulers (LR-scheduler-like API)."""

from __future__ import annotations

import math
from typing import Any


class _DPParamScheduler:
    """Sets ``optimizer.<_attr>`` from a schedule each time :meth:`step` is called.

    Like ``torch.optim.lr_scheduler``: the constructor performs the first ``step()`` (epoch 0),
    ``state_dict()`` holds everything but the optimizer and functions (lambdas cannot be pickled;
    re-create the scheduler with the same function and load the state).
    """

    _attr = ""
    _hint = ""

    def __init__(self, optimizer, *, last_epoch: int = -1):
        if not hasattr(optimizer, self._attr):
            raise ValueError(
                f"{type(self).__name__} needs an optimizer with a .{self._attr} attribute; "
                f"wrap it in a dptorch.optimizers.DPOptimizer first ({self._hint})."
            )
        self.optimizer = optimizer
        self.last_epoch = last_epoch
        self.step()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (no optimizer, no functions)."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer" and not callable(v)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a state returned by :meth:`state_dict`."""
        self.__dict__.update(state_dict)

    def _next_value(self) -> float:
        raise NotImplementedError

    def _check_value(self, value: float) -> None:
        raise NotImplementedError

    def step(self) -> None:
        """Advances one epoch and sets the optimizer's value for it."""
        self.last_epoch += 1
        value = self._next_value()
        self._check_value(value)
        setattr(self.optimizer, self._attr, value)


def exponential_rule(current: float, gamma: float, epoch: int) -> float:
    """Multiply by ``gamma`` at every epoch but the first."""
    return current if epoch == 0 else current * gamma


def step_rule(current: float, gamma: float, step_size: int, epoch: int) -> float:
    """Multiply by ``gamma`` every ``step_size`` epochs."""
    return current if epoch == 0 or epoch % step_size != 0 else current * gamma


def check_step_size(step_size: int) -> None:
    if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size <= 0:
        raise ValueError(f"step_size must be a positive integer, got {step_size!r}")


def check_noise_multiplier(value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(
            f"The noise schedule produced noise_multiplier={value!r}; it must be finite and >= 0."
        )


def check_max_grad_norm(value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"The clipping schedule produced max_grad_norm={value!r}; it must be > 0.")
