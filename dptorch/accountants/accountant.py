"""The accountant interface: a run-length compressed history of DP-SGD steps."""

from __future__ import annotations

import abc
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any, TypeVar

T_state_dict = TypeVar("T_state_dict", bound=Mapping[str, Any])


class IAccountant(abc.ABC):
    """Tracks the privacy cost of Poisson-subsampled Gaussian steps.

    ``history`` is a list of ``(noise_multiplier, sample_rate, num_steps)`` tuples; consecutive
    steps with identical parameters are merged into one tuple. It is the whole state.
    """

    def __init__(self) -> None:
        self.history: list[tuple[float, float, int]] = []

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Records one step with noise multiplier σ ≥ 0 and sampling rate q in [0, 1]."""
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}.")
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in [0, 1], got {sample_rate}.")
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, n = self.history[-1]
            self.history[-1] = (sigma, q, n + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    @abc.abstractmethod
    def get_epsilon(self, delta: float, *args: Any, **kwargs: Any) -> float:
        """The ε spent so far at the given δ."""

    def __len__(self) -> int:
        """Number of steps recorded."""
        return sum(n for _, _, n in self.history)

    @classmethod
    @abc.abstractmethod
    def mechanism(cls) -> str:
        """Short name of the accounting method (the registry key)."""

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A ``DPOptimizer`` step hook recording one step per optimizer step.

        The recorded rate is ``sample_rate · optim.accumulated_iterations`` (a logical batch built
        from several Poisson batches is charged as one step at the summed rate).
        """

        def hook_fn(optim: Any) -> None:
            self.step(
                noise_multiplier=optim.noise_multiplier,
                sample_rate=sample_rate * optim.accumulated_iterations,
            )

        return hook_fn

    def state_dict(self, destination: T_state_dict | None = None) -> T_state_dict:
        """The accountant state (``history`` and ``mechanism``), into ``destination`` if given."""
        if destination is None:
            destination = OrderedDict()  # type: ignore[assignment]
        destination["history"] = deepcopy(self.history)  # type: ignore[index]
        destination["mechanism"] = self.mechanism()  # type: ignore[index]
        return destination  # type: ignore[return-value]

    def load_state_dict(self, state_dict: T_state_dict) -> None:
        """Restores a state produced by :meth:`state_dict` of the same mechanism."""
        if not state_dict:
            raise ValueError("state_dict is None or empty; pass the output of state_dict().")
        for key in ("history", "mechanism"):
            if key not in state_dict:
                raise ValueError(f"state_dict has no key {key!r}; pass the output of state_dict().")
        if state_dict["mechanism"] != self.mechanism():
            raise ValueError(
                f"state_dict of mechanism {state_dict['mechanism']!r} cannot be loaded into an "
                f"accountant of mechanism {self.mechanism()!r}; create_accountant("
                f"{state_dict['mechanism']!r}) instead."
            )
        self.history = [(float(s), float(q), int(n)) for s, q, n in state_dict["history"]]
