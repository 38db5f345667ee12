"""The accountant interface: a history of privacy events, and the Opacus views on top of it.

An accountant holds the privacy events it was given (:meth:`IAccountant.compose`; one per
optimizer step from the engine's hook) and turns them into ε, δ, trade-off curves or μ. It knows
nothing of training. The Opacus API stays: ``history`` is the list of
``(noise_multiplier, sample_rate, num_steps)`` tuples of the events (assignable: plain tuples
become Poisson-sampled Gaussian events, the :class:`FixedSizeHistoryRow` rows of fixed-size
batches become those again), ``step(noise_multiplier=, sample_rate=)`` composes one such event,
and ``state_dict`` / ``load_state_dict`` carry the events (and the history).
"""

from __future__ import annotations

import abc
import functools
import inspect
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from scipy.special import ndtri

try:
    from torch.serialization import add_safe_globals
except ImportError:  # torch < 2.4
    add_safe_globals = None

from .events import (
    FixedSizeBatchEvent,
    GaussianEvent,
    NonPrivateEvent,
    NoOpEvent,
    PoissonSampledEvent,
    PrivacyEvent,
    SelfComposedEvent,
    _gaussian_sigma,
    check_relation,
    dpsgd_event,
    event_from_dict,
    event_to_dict,
    flatten,
    gaussian_phases,
)
from .truncation import Truncation, epsilon_with_truncation, truncated_delta

T_state_dict = TypeVar("T_state_dict", bound=Mapping[str, Any])

#: α grid on which trade-off curves are scanned for :meth:`IAccountant.get_mu`
_MU_ALPHAS = np.concatenate((np.logspace(-12, -1, 111), np.linspace(0.1, 0.5, 41)[1:]))


class IAccountant(abc.ABC):
    """Composes privacy events and reports the privacy spent.

    Args:
        neighboring_relation: ``"add_remove"`` (default: one record added or removed) or
            ``"replace_one"`` (one record replaced by another; the data set size is public).
            Add/remove is the usual DP claim; replace-one is the relation under which
            fixed-size batches (``FixedSizeBatchEvent``) have a sound bound.
    """

    def __init__(self, *, neighboring_relation: str = "add_remove") -> None:
        self.neighboring_relation = check_relation(neighboring_relation)
        self._events: list[tuple[PrivacyEvent, int]] = []  # run-length: (event, count)
        #: the Poisson-sampled steps are fixed-shape batches truncated to M rows (``None``: not
        #: truncated); every ε and δ this accountant reports then includes what truncation costs
        self.truncation: Truncation | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every subclass's ``get_epsilon``, ``get_delta``, ``get_privacy_spent``,
        ``get_tradeoff_curve`` and ``get_mu`` include the cost of :attr:`truncation`
        (:func:`_with_truncation`), so no reader of the privacy spent can miss it."""
        super().__init_subclass__(**kwargs)
        for name in ("get_epsilon", "get_delta", "get_privacy_spent", "get_tradeoff_curve",
                     "get_mu"):
            if name in cls.__dict__:
                setattr(cls, name, _with_truncation(name, cls.__dict__[name]))

    def truncation_tau(self) -> float:
        """τ: a bound on the probability that any step composed so far truncates its batch
        (0 without :attr:`truncation`)."""
        if self.truncation is None:
            return 0.0
        return self.truncation.tau([(e.sampling_probability, n) for e, n in flatten(self.events)
                                    if isinstance(e, PoissonSampledEvent)])

    # ------------------------------------------------------------------ events
    def compose(self, event: PrivacyEvent, count: int = 1) -> IAccountant:
        """Records ``event`` ``count`` times (in order); returns ``self``."""
        if not isinstance(event, PrivacyEvent):
            raise ValueError(f"compose() takes a PrivacyEvent, got {event!r}.")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}.")
        while isinstance(event, SelfComposedEvent):
            event, count = event.event, count * event.count
        if count == 0:
            return self
        if self._events and self._events[-1][0] == event:
            self._events[-1] = (event, self._events[-1][1] + count)
        else:
            self._events.append((event, count))
        return self

    @property
    def events(self) -> list[PrivacyEvent]:
        """The events composed so far, in order (a run of ``n`` equal events is one
        ``SelfComposedEvent(event, n)``)."""
        return [e if n == 1 else SelfComposedEvent(e, n) for e, n in self._events]

    @events.setter
    def events(self, events: Iterable[PrivacyEvent]) -> None:
        self._events = []
        for e in events:
            self.compose(e)

    def _phases(self, relation: str | None = None) -> list[tuple[float, float, int]]:
        """The events as Poisson-sampled Gaussian phases ``(σ, q, steps)`` (``q = 1``: not
        sampled) under ``relation`` (default: the accountant's)."""
        return gaussian_phases(self.events, relation or self.neighboring_relation)

    # ------------------------------------------------------------------ Opacus views
    @property
    def history(self) -> list[tuple[float, float, int]]:
        """``(noise_multiplier, sample_rate, num_steps)`` per run of equal steps: the effective
        noise multiplier σ/sensitivity of each Gaussian, its sampling rate (1 for an unsampled
        Gaussian, the nominal ``1/len(data_loader)`` for a fixed-size batch), and the number of
        steps. No-op events are left out; σ = 0 stands for a non-private event.

        The rows of fixed-size-batch steps (``poisson_sampling=False``) are
        :class:`FixedSizeHistoryRow`: they unpack and compare as the 3-tuple, and carry the pass
        length and where passes start, so that assigning the history back (the Opacus idiom
        ``acc2.history = acc.history``) restores those steps exactly, not as Poisson steps."""
        out: list[tuple[float, float, int]] = []
        prev_m = None  # steps_per_epoch of the previous leaf if it was a fixed-size step
        for event, n in flatten(self.events):
            m, prev_m = prev_m, getattr(event, "steps_per_epoch", None)
            if isinstance(event, NoOpEvent):
                continue
            if isinstance(event, FixedSizeBatchEvent):
                sigma = _gaussian_sigma(event.event)
                if sigma is None or math.isinf(sigma):
                    raise ValueError(f"{event!r} has no (sigma, q) form; use .events instead.")
                row = FixedSizeHistoryRow(sigma, event.sample_rate, n, event.steps_per_epoch,
                                          new_pass=m != event.steps_per_epoch)
                last = out[-1] if out else None
                if (isinstance(last, FixedSizeHistoryRow) and not row.new_pass
                        and last[:2] == row[:2] and last.steps_per_epoch == row.steps_per_epoch):
                    out[-1] = FixedSizeHistoryRow(*last[:2], last[2] + n, last.steps_per_epoch,
                                                  new_pass=last.new_pass)
                else:
                    out.append(row)
                continue
            if isinstance(event, NonPrivateEvent):
                row = (0.0, 1.0)
            elif isinstance(event, GaussianEvent):
                row = (event.effective_noise_multiplier, 1.0)
            elif isinstance(event, PoissonSampledEvent):
                sigma = _gaussian_sigma(event.event)
                if sigma is None:
                    raise ValueError(f"{event!r} has no (sigma, q) form; use .events instead.")
                if math.isinf(sigma):  # releases nothing
                    continue
                row = (sigma, event.sampling_probability)
            else:
                raise ValueError(f"{event!r} has no (sigma, q) form; use .events instead.")
            if out and not isinstance(out[-1], FixedSizeHistoryRow) and out[-1][:2] == row:
                out[-1] = (*row, out[-1][2] + n)
            else:
                out.append((*row, n))
        return out

    @history.setter
    def history(self, history: Sequence[tuple[float, float, int]]) -> None:
        """Replaces the events: a plain ``(σ, q, n)`` row (Opacus) is ``n`` Poisson-sampled
        Gaussian steps; a :class:`FixedSizeHistoryRow`, or its plain form ``(σ, q, n,
        {"fixed_size_batches": m, "new_pass": b})`` (``state_dict()``), is ``n`` fixed-size-batch
        steps with passes of ``m`` steps. Anything else raises ``ValueError``. A fixed-size
        row reduced to its 3-tuple (``tuple(row)``, JSON without the dict) cannot be told from
        a Poisson row and is read as one, which under-reports ε: keep ``state_dict()``'s form."""
        events: list[tuple[PrivacyEvent, int]] = []
        for row in history:
            sigma, q, n, fixed = _history_row(row)
            _check_step(sigma, q)
            if n < 0:
                raise ValueError(f"num_steps must be >= 0, got {n}.")
            if fixed is None:
                events.append((dpsgd_event(sigma, q), n))
                continue
            m, new_pass = fixed
            if new_pass and n:
                events.append((NoOpEvent(), 1))  # ends the previous run: a new pass starts
            events.append((FixedSizeBatchEvent(GaussianEvent(sigma), m, q), n))
        self._events = []
        for e, n in events:
            self.compose(e, n)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Records one step with noise multiplier σ ≥ 0 and sampling rate q in [0, 1]:
        ``compose(PoissonSampledEvent(q, GaussianEvent(σ)))``."""
        _check_step(noise_multiplier, sample_rate)
        self.compose(dpsgd_event(float(noise_multiplier), float(sample_rate)))

    @abc.abstractmethod
    def get_epsilon(self, delta: float, *args: Any, **kwargs: Any) -> float:
        """The ε spent so far at the given δ."""

    def get_delta(self, epsilon: float, **kwargs: Any) -> float:
        """The δ spent so far at the given ε (an upper bound)."""
        raise NotImplementedError(f"{type(self).__name__} does not compute delta(epsilon).")

    def get_tradeoff_curve(self, alpha: Any, **kwargs: Any) -> np.ndarray:
        """f-DP: a lower bound on the type-II error β(α) of the best test, at level α, between
        the outputs on any two neighbouring data sets (in either order). A curve that stays
        above it is what an audit must not beat.

        The default converts the privacy profile: ``β(α) ≥ max(0, 1 − δ(ε) − e^ε α,
        e^{−ε}(1 − δ(ε) − α))`` for every ε, on a grid of ε."""
        alpha = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
        if not self._events:
            return 1.0 - alpha
        eps_max = max(1.0, self.get_epsilon(1e-12) if hasattr(self, "get_epsilon") else 1.0)
        if not math.isfinite(eps_max):
            return np.zeros_like(alpha)
        beta = np.zeros_like(alpha)
        for eps in np.linspace(0.0, eps_max, 161):
            d = min(self.get_delta(float(eps), **kwargs), 1.0)
            b = np.maximum(1.0 - d - math.exp(eps) * alpha, math.exp(-eps) * (1.0 - d - alpha))
            beta = np.maximum(beta, b)
        return np.clip(beta, 0.0, 1.0)

    def get_mu(self, **kwargs: Any) -> float:
        """The smallest μ such that the Gaussian trade-off curve ``Φ(Φ⁻¹(1 − α) − μ)`` lies
        below :meth:`get_tradeoff_curve` (scanned on α ∈ [1e-12, 0.5]; the curves are
        symmetric): the accounted training is then μ-GDP. Tight when the accounted curve is
        GDP-like (many steps); warns (``UserWarning``) when it is not, i.e. when μ fitted at
        different α differ by more than 10 %."""
        alpha = _MU_ALPHAS
        beta = self.get_tradeoff_curve(alpha, **kwargs)
        if np.any(beta <= 0.0):
            return math.inf
        mus = ndtri(1.0 - alpha) - ndtri(beta)
        mu = max(float(np.max(mus)), 0.0)
        mid = mus[(alpha >= 1e-6) & (alpha <= 0.5)]
        if mu > 0 and float(np.min(mid)) < 0.9 * mu:
            warnings.warn(
                f"the accounted trade-off curve is not Gaussian-like (mu fitted at different "
                f"alpha ranges from {float(np.min(mid)):.3g} to {mu:.3g}); mu = {mu:.3g} is a "
                "valid but loose summary: use get_tradeoff_curve().",
                UserWarning,
                stacklevel=2,
            )
        return mu

    def __len__(self) -> int:
        """Number of steps recorded (no-op events are not steps)."""
        return sum(n for e, n in self._events if not isinstance(e, NoOpEvent))

    @classmethod
    @abc.abstractmethod
    def mechanism(cls) -> str:
        """Short name of the accounting method (the registry key)."""

    # ------------------------------------------------------------------ training
    def get_optimizer_hook_fn(
        self, sample_rate: float, *, steps_per_epoch: int | None = None
    ) -> Callable[[Any], None]:
        """A ``DPOptimizer`` step hook composing the event of each optimizer step.

        The event is ``optim.privacy_event(sample_rate, steps_per_epoch)``: a Poisson-sampled
        Gaussian at rate ``sample_rate`` for a release of one Poisson batch (the physical
        batches of BatchMemoryManager or DPTrainer are parts of one). A release that sums
        several independently drawn Poisson batches (gradient accumulation) raises
        ``ValueError``: a record's multiplicity in the sum is Binomial(k, q), which one
        Poisson-sampled step of sensitivity 1 does not bound (at rate ``k·q`` or any other).
        With ``steps_per_epoch``
        (fixed-size batches, ``poisson_sampling=False``) it is a
        :class:`~.events.FixedSizeBatchEvent` (``k`` accumulated batches: passes of
        ``steps_per_epoch // k`` releases), and the hook's first step starts a new pass (a
        :class:`~.events.NoOpEvent` ends any earlier run). See :func:`release_event`.

        The hook's ``check_release(optim)`` raises that ``ValueError`` without composing
        anything; ``DPOptimizer`` calls it before the noise is drawn.
        """
        started = False

        def event_of(optim: Any) -> PrivacyEvent:
            make = getattr(optim, "privacy_event", None)
            if callable(make):
                return make(sample_rate, steps_per_epoch)
            # an optimizer-like object without events
            return release_event(GaussianEvent(optim.noise_multiplier), sample_rate,
                                 batches=optim.accumulated_iterations,
                                 steps_per_epoch=steps_per_epoch)

        def hook_fn(optim: Any) -> None:
            nonlocal started
            event = event_of(optim)
            if steps_per_epoch is not None and not started:
                self.compose(NoOpEvent())
            started = True
            self.compose(event)

        hook_fn.check_release = event_of  # type: ignore[attr-defined]
        return hook_fn

    # ------------------------------------------------------------------ state
    def state_dict(self, destination: T_state_dict | None = None) -> T_state_dict:
        """The accountant state into ``destination`` if given: ``events`` (plain dicts with
        counts), ``neighboring_relation``, ``mechanism`` and the ``history`` view (for
        Opacus-style readers; a fixed-size-batch row in its plain 4-tuple form, see
        :class:`FixedSizeHistoryRow`). Only built-in types: ``torch.load(weights_only=True)``
        reads it."""
        if destination is None:
            destination = OrderedDict()  # type: ignore[assignment]
        destination["history"] = [  # type: ignore[index]
            r.plain() if isinstance(r, FixedSizeHistoryRow) else r for r in self.history]
        destination["mechanism"] = self.mechanism()  # type: ignore[index]
        destination["events"] = [[event_to_dict(e), n] for e, n in self._events]  # type: ignore[index]
        destination["neighboring_relation"] = self.neighboring_relation  # type: ignore[index]
        t = self.truncation
        destination["truncation"] = None if t is None else [  # type: ignore[index]
            t.num_records, t.max_batch_size, t.world_size]
        return destination  # type: ignore[return-value]

    def check_state_dict(self, state_dict: T_state_dict) -> None:
        """Raises ``ValueError`` unless :meth:`load_state_dict` can load ``state_dict`` (a state
        of this mechanism), without loading anything."""
        if not state_dict:
            raise ValueError("state_dict is None or empty; pass the output of state_dict().")
        for key in ("history", "mechanism"):
            if key not in state_dict and not (key == "history" and "events" in state_dict):
                raise ValueError(f"state_dict has no key {key!r}; pass the output of state_dict().")
        if state_dict["mechanism"] != self.mechanism():
            raise ValueError(
                f"state_dict of mechanism {state_dict['mechanism']!r} cannot be loaded into an "
                f"accountant of mechanism {self.mechanism()!r}; create_accountant("
                f"{state_dict['mechanism']!r}) instead."
            )

    def load_state_dict(self, state_dict: T_state_dict) -> None:
        """Restores a state produced by :meth:`state_dict` of the same mechanism (events when
        present, else the ``history``: Opacus rows are Poisson steps, fixed-size-batch rows
        stay fixed-size; see the :attr:`history` setter)."""
        self.check_state_dict(state_dict)
        if "neighboring_relation" in state_dict:
            self.neighboring_relation = check_relation(state_dict["neighboring_relation"])
        if state_dict.get("truncation") is not None:
            saved = Truncation(*(int(v) for v in state_dict["truncation"]))
            if self.truncation is not None and saved != self.truncation:
                raise ValueError(
                    f"state_dict's steps were sampled with truncation {saved}, this accountant "
                    f"charges {self.truncation}: one accountant charges one truncation. Load it "
                    "into an accountant of the same sampling (make_private with the same "
                    "max_batch_size, world size and data set)."
                )
            self.truncation = saved
        if "events" in state_dict:
            self._events = []
            for d, n in state_dict["events"]:
                self.compose(event_from_dict(d), int(n))
        else:  # the setter keeps fixed-size rows fixed-size (plain 3-tuples are Poisson)
            self.history = state_dict["history"]


def _with_truncation(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` (an accountant's method ``name`` for the Poisson run) with the truncation cost τ of
    :attr:`IAccountant.truncation` included: ε is the fixed point of ``ε = ε_P(δ − (1 +
    e^ε)·τ)``, δ is ``δ_P(ε) + (1 + e^ε)·τ``, the trade-off curve ``β_P(α + τ) − τ`` (each output
    distribution is within total variation τ of the Poisson one), μ is fitted to that curve.
    Applied once per call (a method calling another sees the Poisson run)."""

    @functools.wraps(f)
    def wrapped(self: IAccountant, *args: Any, **kwargs: Any) -> Any:
        tau = 0.0 if getattr(self, "_in_truncation", False) else self.truncation_tau()
        if tau == 0.0:
            return f(self, *args, **kwargs)
        if name == "get_mu":  # from the truncated curve (a subclass's closed form is Poisson)
            bound = inspect.signature(f).bind(self, *args, **kwargs)
            named = {k: v for k, v in bound.arguments.items() if k != "self"}
            named.update(named.pop("kwargs", {}))
            return IAccountant.get_mu(self, **named)
        self._in_truncation = True
        try:
            if name == "get_tradeoff_curve":
                # within TV τ of the Poisson run on both data sets: β(α) ≥ β_P(α + τ) − τ
                alpha, rest = (args[0], args[1:]) if args else (kwargs.pop("alpha"), ())
                shifted = np.minimum(np.asarray(alpha, dtype=np.float64) + tau, 1.0)
                return np.maximum(np.asarray(f(self, shifted, *rest, **kwargs)) - tau, 0.0)
            if name == "get_privacy_spent":  # (*, delta, ...) -> (ε, order)
                delta = kwargs.pop("delta")
                eps = epsilon_with_truncation(lambda d: f(self, delta=d, **kwargs)[0], delta, tau)
                return eps, f(self, delta=delta - (1.0 + math.exp(eps)) * tau, **kwargs)[1]
            key = "delta" if name == "get_epsilon" else "epsilon"
            first, rest = (args[0], args[1:]) if args else (kwargs.pop(key), ())
            if name == "get_delta":
                return min(1.0, truncated_delta(first, f(self, first, *rest, **kwargs), tau))
            return epsilon_with_truncation(lambda d: f(self, d, *rest, **kwargs), first, tau)
        finally:
            self._in_truncation = False

    return wrapped


def _check_step(noise_multiplier: float, sample_rate: float) -> None:
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}.")
    if not 0.0 <= sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in [0, 1], got {sample_rate}.")


#: key of the marker dict that ends the plain form of a :class:`FixedSizeHistoryRow`
FIXED_SIZE_KEY = "fixed_size_batches"


class FixedSizeHistoryRow(tuple):
    """A row ``(noise_multiplier, sample_rate, num_steps)`` of :attr:`IAccountant.history` for
    fixed-size-batch steps (``poisson_sampling=False``, :class:`~.events.FixedSizeBatchEvent`).

    It unpacks, indexes and compares as that 3-tuple (Opacus code reading the history keeps
    working) and carries what the accountant needs to charge the steps again exactly:
    ``steps_per_epoch`` (the pass length) and ``new_pass`` (whether the row's first step starts
    a pass, rather than continuing the previous row's). Assigned to ``history`` it gives
    fixed-size-batch events, never Poisson-sampled ones, which would under-report ε.
    :meth:`plain` is its form with built-in types only, ``(σ, q, n, {"fixed_size_batches": m,
    "new_pass": b})``, kept by ``state_dict()`` (``torch.load(weights_only=True)`` reads it) and
    read back by the ``history`` setter."""

    steps_per_epoch: int
    new_pass: bool

    def __new__(cls, noise_multiplier: float, sample_rate: float, num_steps: int,
                steps_per_epoch: int, new_pass: bool = True) -> FixedSizeHistoryRow:
        row = super().__new__(cls, (float(noise_multiplier), float(sample_rate), int(num_steps)))
        row.steps_per_epoch = int(steps_per_epoch)
        row.new_pass = bool(new_pass)
        return row

    def __reduce__(self) -> tuple:
        return (type(self), (*self, self.steps_per_epoch, self.new_pass))

    def plain(self) -> tuple:
        """``(σ, q, n, {"fixed_size_batches": steps_per_epoch, "new_pass": new_pass})``."""
        return (*self, {FIXED_SIZE_KEY: self.steps_per_epoch, "new_pass": self.new_pass})

    def __repr__(self) -> str:
        return (f"FixedSizeHistoryRow({self[0]!r}, {self[1]!r}, {self[2]!r}, "
                f"steps_per_epoch={self.steps_per_epoch}, new_pass={self.new_pass})")


# torch.load(weights_only=True), torch's default, may rebuild the rows of a saved history
if add_safe_globals is not None:
    add_safe_globals([FixedSizeHistoryRow])


def _history_row(row: Any) -> tuple[float, float, int, tuple[int, bool] | None]:
    """``(σ, q, n, (steps_per_epoch, new_pass) or None)`` of a history row (``None``: a plain
    Opacus row, Poisson-sampled steps)."""
    if isinstance(row, FixedSizeHistoryRow):
        return row[0], row[1], row[2], (row.steps_per_epoch, row.new_pass)
    try:
        items = tuple(row)
    except TypeError:
        items = ()
    marker = items[3] if len(items) == 4 else None
    if len(items) == 3 or (isinstance(marker, Mapping) and FIXED_SIZE_KEY in marker):
        try:
            sigma, q, n = float(items[0]), float(items[1]), int(items[2])
        except (TypeError, ValueError):
            pass
        else:
            if marker is None:
                return sigma, q, n, None
            m = marker[FIXED_SIZE_KEY]
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"steps_per_epoch of history row {row!r} must be an integer >= 1.")
            return sigma, q, n, (m, bool(marker.get("new_pass", True)))
    raise ValueError(
        f"A history row is (noise_multiplier, sample_rate, num_steps) (Poisson-sampled steps, "
        f"as in Opacus) or a FixedSizeHistoryRow / its plain form (noise_multiplier, "
        f"sample_rate, num_steps, {{{FIXED_SIZE_KEY!r}: steps_per_epoch, 'new_pass': bool}}) "
        f"(fixed-size batches); got {row!r}. Pass rows of accountant.history or "
        "accountant.state_dict()['history']."
    )


def release_event(gaussian: PrivacyEvent, sample_rate: float, *, batches: int = 1,
                  steps_per_epoch: int | None = None) -> PrivacyEvent:
    """The event of one optimizer release of ``gaussian`` on the clipped sum of ``batches``
    batches drawn by the data loader.

    * Poisson batches (``steps_per_epoch`` ``None``): ``PoissonSampledEvent(sample_rate,
      gaussian)`` for one batch. Several batches raise ``ValueError``: they are independent
      Poisson draws, so a record is in ``Binomial(k, q)`` of them and moves the sum by up to
      ``k`` clipped units, which one Poisson-sampled step of sensitivity 1 does not bound (at
      rate ``k·q`` ε is under-reported: 17.9 for 25.4 at q = 1/2, k = 2, σ = 1, 10 releases).
    * fixed-size batches: ``FixedSizeBatchEvent(gaussian, steps_per_epoch // batches,
      min(batches · sample_rate, 1))`` (a pass of ``steps_per_epoch`` batches is
      ``steps_per_epoch // batches`` releases; ``batches`` must divide ``steps_per_epoch``, or
      releases would span two passes and hold a record twice: ``ValueError``).
      ``steps_per_epoch = 1`` (a loader not known to
      use each record at most once per pass, or a pass of one batch) charges each release as
      one Gaussian in which a record appears at most once, which several batches do not
      ensure: ``ValueError``.
    """
    if batches <= 1:
        if steps_per_epoch is None:
            return PoissonSampledEvent(sample_rate, gaussian)
        return FixedSizeBatchEvent(gaussian, steps_per_epoch, sample_rate)
    if steps_per_epoch is None:
        raise ValueError(
            f"This optimizer step would release the sum of {batches} Poisson batches (gradient "
            "accumulation: several backward passes, or signal_skip_step across the data "
            "loader's batches, after allow_grad_accumulation()). Each is an independent Poisson "
            f"draw, so a record can be in several of them (Binomial({batches}, q) times) and "
            "move the sum by several clipped gradients, which one Poisson-sampled step of one "
            f"clipped gradient's sensitivity does not bound (charged as one step at rate "
            f"{batches}·q, epsilon would be under-reported), so it is not "
            "released. Fix: draw one Poisson batch of the combined expected size (a data loader "
            f"with a {batches} times larger batch_size, i.e. sample rate {batches}·q) and bound "
            "memory with dptorch.utils.batch_memory_manager.BatchMemoryManager("
            "max_physical_batch_size=...), which splits that one batch into physical batches; or "
            "use fixed-size batches (poisson_sampling=False), whose accumulation is charged "
            "per pass."
        )
    if steps_per_epoch == 1:
        raise ValueError(
            f"This optimizer step would release the sum of {batches} fixed-size batches "
            "(poisson_sampling=False) of a data loader whose passes are not known to use each "
            "record at most once in several batches (a sampler dptorch cannot identify, or a "
            "pass of one batch): every release is charged as one Gaussian in which a record "
            "appears at most once, which the summed batches do not ensure, so it is not "
            "released. Fix: step after every batch (BatchMemoryManager bounds memory for large "
            "batches), use a sampler dptorch understands (shuffle=True, SequentialSampler, "
            "RandomSampler without replacement, SubsetRandomSampler) over several batches per "
            "pass, or poisson_sampling=True with one Poisson batch per step."
        )
    if steps_per_epoch % batches:
        raise ValueError(
            f"This optimizer step would release the sum of {batches} fixed-size batches "
            f"(poisson_sampling=False) while a pass over the data has {steps_per_epoch} "
            f"batches, which {batches} does not divide: releases then span the end of one pass "
            "and the start of the next, where a record can appear twice, and the accountant "
            "(which charges each record once per pass) would under-report epsilon, so it is not "
            f"released. Fix: accumulate a number of batches that divides {steps_per_epoch} "
            "(a divisor of len(data_loader), with drop_last=True if needed), or step after "
            "every batch and bound memory with BatchMemoryManager, which splits one batch."
        )
    return FixedSizeBatchEvent(gaussian, steps_per_epoch // batches,
                               min(sample_rate * batches, 1.0))
