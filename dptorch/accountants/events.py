"""Privacy events: frozen descriptions of what a training run released (dp-accounting style).

An accountant composes events (``accountant.compose(event)``) and knows nothing of training:
the optimizer describes each step as an event, the accountant turns the events into ε. Every
Gaussian below has its noise and sensitivity in units of the clipping bound ``C``:

* :class:`GaussianEvent` ``(noise_multiplier, sensitivity=1)``: one release of a sum to which
  one record contributes at most ``sensitivity·C`` (L2), with ``N(0, (noise_multiplier·C)²)``
  noise. Its privacy depends only on ``noise_multiplier / sensitivity``. Split-clipped
  multi-pass training with ``k`` private passes is ``GaussianEvent(σ·k, sensitivity=k)`` (noise
  ``σ·C·k``, one record in every private pass); public passes add nothing to the sensitivity.
  Under ``replace_one`` a record's contribution is replaced by another of norm ≤ ``C``, so the
  sum moves by up to ``2·sensitivity·C`` (the convention of dp-accounting's PLD accountant).
* :class:`PoissonSampledEvent` ``(sampling_probability, event)``: the event run on a batch that
  holds each record independently with that probability (a DP-SGD step on a Poisson batch;
  with users as records, user-level sampling).
* :class:`FixedSizeBatchEvent` ``(event, steps_per_epoch, sample_rate)``: the event run on a
  batch of a fixed-size loader (shuffled or sequential) in which each record takes part in at
  most one of ``steps_per_epoch`` consecutive steps (one pass over the data). No amplification
  by sampling is assumed: a pass costs one ``event`` under ``replace_one`` (the data set size
  is public). ``sample_rate`` is the Poisson rate such a loader is *usually* (wrongly)
  accounted with; it is kept only for the ``(σ, q, steps)`` history view.
* :class:`SelfComposedEvent` ``(event, count)``, :class:`ComposedEvent` ``(events)``: sequential
  (adaptive) composition.
* :class:`NoOpEvent` (releases nothing about the data; also ends a run of fixed-size-batch
  steps: the next one starts a new pass), :class:`NonPrivateEvent` (ε = ∞).

Events are hashable, compare by value and convert to and from plain dicts
(:func:`event_to_dict`, :func:`event_from_dict`) for checkpoints. :func:`gaussian_phases`
reduces a sequence of events to the Poisson-sampled Gaussian phases the analyses compose.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "PrivacyEvent",
    "NoOpEvent",
    "NonPrivateEvent",
    "GaussianEvent",
    "PoissonSampledEvent",
    "FixedSizeBatchEvent",
    "SelfComposedEvent",
    "ComposedEvent",
    "NEIGHBORING_RELATIONS",
    "check_relation",
    "event_to_dict",
    "event_from_dict",
    "gaussian_phases",
    "dpsgd_event",
]

#: the neighbouring relations the accountants understand
NEIGHBORING_RELATIONS = ("add_remove", "replace_one")


def check_relation(relation: str) -> str:
    """``relation`` if it is one of :data:`NEIGHBORING_RELATIONS`, else ``ValueError``."""
    if relation not in NEIGHBORING_RELATIONS:
        raise ValueError(
            f"neighboring_relation must be one of {NEIGHBORING_RELATIONS}, got {relation!r}."
        )
    return relation


def _real(name: str, x: Any, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False) -> float:
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or math.isnan(x):
        raise ValueError(f"{name} must be a real number, got {x!r}.")
    x = float(x)
    if x < lo or x > hi or (lo_open and x == lo):
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must lie in {bracket}{lo:g}, {hi:g}], got {x!r}.")
    return x


def _count(name: str, x: Any, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or int(x) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {x!r}.")
    return int(x)


class PrivacyEvent:
    """Base class of the privacy events (frozen dataclasses)."""

    def __post_init__(self) -> None:  # validation and normalisation (floats, tuples)
        pass


@dataclass(frozen=True)
class NoOpEvent(PrivacyEvent):
    """Nothing about the data is released."""


@dataclass(frozen=True)
class NonPrivateEvent(PrivacyEvent):
    """A release with no privacy guarantee (ε = ∞)."""


@dataclass(frozen=True)
class GaussianEvent(PrivacyEvent):
    """A Gaussian release: noise std ``noise_multiplier·C``, sensitivity ``sensitivity·C``."""

    noise_multiplier: float
    sensitivity: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", _real("noise_multiplier", self.noise_multiplier))
        object.__setattr__(self, "sensitivity", _real("sensitivity", self.sensitivity, lo_open=True))
        if math.isinf(self.noise_multiplier) or math.isinf(self.sensitivity):
            raise ValueError("noise_multiplier and sensitivity must be finite.")

    @property
    def effective_noise_multiplier(self) -> float:
        """``noise_multiplier / sensitivity``: the only thing its privacy depends on."""
        return self.noise_multiplier / self.sensitivity


@dataclass(frozen=True)
class PoissonSampledEvent(PrivacyEvent):
    """``event`` run on a Poisson sample: each record in it independently with probability
    ``sampling_probability``."""

    sampling_probability: float
    event: PrivacyEvent

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling_probability",
                           _real("sampling_probability", self.sampling_probability, 0.0, 1.0))
        _check_event(self.event)


@dataclass(frozen=True)
class FixedSizeBatchEvent(PrivacyEvent):
    """``event`` run on a batch of a fixed-size loader: each record takes part in at most one of
    ``steps_per_epoch`` consecutive steps (see the module docstring). ``sample_rate`` is the
    nominal Poisson rate (``1 / len(data_loader)``), used only by the ``(σ, q, steps)`` view."""

    event: PrivacyEvent
    steps_per_epoch: int
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        _check_event(self.event)
        object.__setattr__(self, "steps_per_epoch", _count("steps_per_epoch", self.steps_per_epoch, 1))
        object.__setattr__(self, "sample_rate", _real("sample_rate", self.sample_rate, 0.0, 1.0))


@dataclass(frozen=True)
class SelfComposedEvent(PrivacyEvent):
    """``event`` composed ``count`` times."""

    event: PrivacyEvent
    count: int

    def __post_init__(self) -> None:
        _check_event(self.event)
        object.__setattr__(self, "count", _count("count", self.count))


@dataclass(frozen=True)
class ComposedEvent(PrivacyEvent):
    """The events of ``events``, one after the other."""

    events: tuple[PrivacyEvent, ...]

    def __post_init__(self) -> None:
        events = tuple(self.events)
        for e in events:
            _check_event(e)
        object.__setattr__(self, "events", events)


def _check_event(event: Any) -> None:
    if not isinstance(event, PrivacyEvent):
        raise ValueError(f"expected a PrivacyEvent, got {event!r}.")


# ---------------------------------------------------------------------------- serialisation
_TYPES: dict[str, type[PrivacyEvent]] = {
    cls.__name__: cls
    for cls in (NoOpEvent, NonPrivateEvent, GaussianEvent, PoissonSampledEvent,
                FixedSizeBatchEvent, SelfComposedEvent, ComposedEvent)
}


def event_to_dict(event: PrivacyEvent) -> dict[str, Any]:
    """A plain dict (str, float, int, list, dict only) describing ``event``."""
    _check_event(event)
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):  # type: ignore[arg-type]
        v = getattr(event, f.name)
        if isinstance(v, PrivacyEvent):
            v = event_to_dict(v)
        elif isinstance(v, tuple):
            v = [event_to_dict(e) for e in v]
        out[f.name] = v
    return out


def event_from_dict(d: dict[str, Any]) -> PrivacyEvent:
    """The event :func:`event_to_dict` described."""
    try:
        cls = _TYPES[d["type"]]
    except (KeyError, TypeError):
        raise ValueError(f"not a privacy event description: {d!r}") from None
    kwargs = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in d:
            continue
        v = d[f.name]
        if isinstance(v, dict):
            v = event_from_dict(v)
        elif isinstance(v, list):
            v = tuple(event_from_dict(e) for e in v)
        kwargs[f.name] = v
    return cls(**kwargs)


def dpsgd_event(noise_multiplier: float, sample_rate: float, sensitivity: float = 1.0) -> PrivacyEvent:
    """One DP-SGD step on a Poisson batch: ``PoissonSampledEvent(q, GaussianEvent(σ, Δ))``."""
    return PoissonSampledEvent(sample_rate, GaussianEvent(noise_multiplier, sensitivity))


# ---------------------------------------------------------------------------- reduction
#: a phase of the reduced history: (effective noise multiplier, sampling probability, steps);
#: sampling probability 1 is an unsampled Gaussian
Phase = tuple[float, float, int]


def _flatten(event: PrivacyEvent, count: int, out: list[tuple[PrivacyEvent, int]]) -> None:
    """Appends ``(leaf event, count)`` pairs in order (leaves: everything but the compositions)."""
    if count == 0:
        return
    if isinstance(event, SelfComposedEvent):
        _flatten(event.event, count * event.count, out)
    elif isinstance(event, ComposedEvent):
        if count == 1 or not event.events:
            for e in event.events:
                _flatten(e, 1, out)
        else:  # repeated composition: keep the order of every repetition
            inner: list[tuple[PrivacyEvent, int]] = []
            for e in event.events:
                _flatten(e, 1, inner)
            if len(inner) == 1:
                out.append((inner[0][0], inner[0][1] * count))
            else:
                out.extend(inner * count)
    else:
        if out and out[-1][0] == event:
            out[-1] = (event, out[-1][1] + count)
        else:
            out.append((event, count))


def flatten(events: Iterable[PrivacyEvent]) -> list[tuple[PrivacyEvent, int]]:
    """The leaf events of ``events`` in order, run-length compressed."""
    out: list[tuple[PrivacyEvent, int]] = []
    for e in events:
        _flatten(e, 1, out)
    return out


class UnsupportedEventError(ValueError):
    """An event the accountant cannot analyse (with the reason)."""


def _gaussian_sigma(event: PrivacyEvent) -> float | None:
    """Effective noise multiplier of a composition of Gaussians (``None``: not one).

    ``k`` Gaussians with multipliers ``σ_i`` on the same data are one Gaussian with
    ``1/σ² = Σ 1/σ_i²`` (as in dp-accounting's RDP accountant)."""
    inv = 0.0
    for e, k in flatten([event]):
        if isinstance(e, NoOpEvent):
            continue
        if not isinstance(e, GaussianEvent):
            return None
        s = e.effective_noise_multiplier
        if s == 0:
            return 0.0
        inv += k / (s * s)
    return math.inf if inv == 0 else 1.0 / math.sqrt(inv)


def gaussian_phases(events: Sequence[PrivacyEvent], relation: str = "add_remove") -> list[Phase]:
    """The events as phases ``(σ_eff, q, steps)`` of Poisson-sampled Gaussians (``q = 1``: not
    sampled), in order, for the given neighbouring relation.

    * a ``GaussianEvent`` is ``(σ/Δ, 1, 1)``; a ``PoissonSampledEvent`` of a (composition of)
      Gaussian(s) is ``(σ_eff, q, 1)``; ``NoOpEvent`` and ``q = 0`` contribute nothing;
      ``NonPrivateEvent`` (or σ = 0) gives a phase ``(0, 1, 1)`` (ε = ∞);
    * a run of consecutive :class:`FixedSizeBatchEvent` with the same ``steps_per_epoch = m``
      is cut into passes of ``m`` steps from its first step (the last pass may be partial, and
      any other event ends the run); each pass is one unsampled Gaussian with the smallest
      effective multiplier of its steps. Only ``relation="replace_one"`` is sound for it (with
      ``add_remove`` the batches of neighbouring data sets are not comparable): any other
      relation raises :class:`UnsupportedEventError`.

    Raises :class:`UnsupportedEventError` for an event it cannot analyse.
    """
    check_relation(relation)
    phases: list[Phase] = []

    def add(sigma: float, q: float, k: int) -> None:
        if k <= 0 or q == 0 or math.isinf(sigma):
            return
        if phases and phases[-1][:2] == (sigma, q):
            phases[-1] = (sigma, q, phases[-1][2] + k)
        else:
            phases.append((sigma, q, k))

    run_len, run_sigma, run_m = 0, math.inf, 0  # the current pass: steps, smallest σ, m

    def end_pass() -> None:
        nonlocal run_len, run_sigma
        if run_len:
            add(run_sigma, 1.0, 1)
        run_len, run_sigma = 0, math.inf

    for event, k in flatten(events):
        if isinstance(event, FixedSizeBatchEvent):
            if relation != "replace_one":
                raise UnsupportedEventError(
                    "fixed-size batches (poisson_sampling=False) are only accounted under the "
                    "replace_one neighbouring relation (the data set size is public): with "
                    "add/remove the batches of neighbouring data sets differ in many records. "
                    "Use an accountant created with neighboring_relation='replace_one' (or "
                    "PrivacyEngine.get_epsilon, which does)."
                )
            sigma = _gaussian_sigma(event.event)
            if sigma is None:
                raise UnsupportedEventError(
                    f"FixedSizeBatchEvent of {event.event!r}: only Gaussian events are supported."
                )
            if event.steps_per_epoch != run_m:
                end_pass()
                run_m = event.steps_per_epoch
            fill = min(k, run_m - run_len)  # complete the current pass
            run_len, run_sigma, k = run_len + fill, min(run_sigma, sigma), k - fill
            if run_len == run_m:
                end_pass()
            full, rest = divmod(k, run_m)
            add(sigma, 1.0, full)
            if rest:
                run_len, run_sigma = rest, sigma
            continue
        end_pass()
        run_m = 0
        if isinstance(event, NoOpEvent):
            continue
        if isinstance(event, NonPrivateEvent):
            add(0.0, 1.0, k)
            continue
        if isinstance(event, GaussianEvent):
            add(event.effective_noise_multiplier, 1.0, k)
            continue
        if isinstance(event, PoissonSampledEvent):
            sigma = _gaussian_sigma(event.event)
            if sigma is None:
                raise UnsupportedEventError(
                    f"PoissonSampledEvent of {event.event!r}: only (compositions of) Gaussian "
                    "events can be Poisson-sampled."
                )
            add(sigma, event.sampling_probability, k)
            continue
        raise UnsupportedEventError(f"unsupported privacy event {event!r}.")
    end_pass()
    return phases
