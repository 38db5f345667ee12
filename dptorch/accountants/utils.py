"""Calibration of the noise multiplier to a privacy budget."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, Optional

from ..utils._poisson import robust_floor
from .accountant import IAccountant
from .events import (
    FixedSizeBatchEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
    flatten,
)
from .registry import create_accountant

MAX_SIGMA = 1e6


def _is_real(x: Any) -> bool:
    """A real number (``int``, ``float``, numpy scalars), not ``bool``."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
    neighboring_relation: str = "add_remove",
    **kwargs: Any,
) -> float:
    """Smallest noise multiplier σ (within ``epsilon_tolerance``) with ε(σ) ≤ ``target_epsilon``
    under ``neighboring_relation`` (``"add_remove"`` or ``"replace_one"``).

    Runs ``steps`` (or ``epochs / sample_rate``, rounded down, round-off aside) steps at ``sample_rate``. σ is bracketed by
    doubling, then bisected until the bracket is narrower than ``epsilon_tolerance`` *and*
    ``target_epsilon − ε(σ) ≤ epsilon_tolerance``; so the result ``σ`` satisfies
    ``ε(σ) ≤ target`` and ``ε(σ − epsilon_tolerance) > target``. ``kwargs`` go to
    ``get_epsilon`` (e.g. ``eps_error``).

    Raises:
        ValueError: on out-of-range arguments, or when the target needs σ > 1e6.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("pass exactly one of epochs and steps to get_noise_multiplier.")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}.")
    if not (_is_real(target_delta) and 0.0 < target_delta < 1.0):
        raise ValueError(f"target_delta must be a number in (0, 1), got {target_delta!r}.")
    if not (_is_real(target_epsilon) and 0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
    if not (_is_real(epsilon_tolerance) and 0 < epsilon_tolerance < math.inf):
        raise ValueError(
            "epsilon_tolerance must be a finite number > 0 (how far below target_epsilon the "
            f"reached epsilon may be), got {epsilon_tolerance!r}."
        )
    if steps is None:
        if not epochs > 0:
            raise ValueError(f"epochs must be > 0, got {epochs}.")
        steps = robust_floor(epochs / sample_rate)  # the loader's count, not one short
    if steps < 1:
        raise ValueError(f"the number of steps must be >= 1, got {steps}; raise epochs or steps.")

    relation = {} if neighboring_relation == "add_remove" else {"neighboring_relation": neighboring_relation}
    acc = create_accountant(accountant, **relation)

    def eps_at(sigma: float) -> float:
        acc.history = [(sigma, sample_rate, steps)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RDP boundary-order warnings during the search
            return acc.get_epsilon(delta=target_delta, **kwargs)

    if accountant in _CHEAP:
        return _bisect(eps_at, target_epsilon, epsilon_tolerance)
    # an expensive accountant: start from the RDP calibration (RDP's ε is an upper bound, so its
    # σ is slightly above the answer) and its local slope, then interpolate on the real ε
    rdp = create_accountant("rdp", **relation)

    def rdp_at(sigma: float) -> float:
        rdp.history = [(sigma, sample_rate, steps)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return rdp.get_epsilon(delta=target_delta)

    try:
        guess = _bisect(rdp_at, target_epsilon, epsilon_tolerance)
    except ValueError:  # RDP cannot reach the target: search with the accountant itself
        return _bisect(eps_at, target_epsilon, epsilon_tolerance)
    slope = math.log(rdp_at(1.01 * guess) / rdp_at(guess)) / math.log(1.01)
    return _interpolation_search(eps_at, target_epsilon, epsilon_tolerance, guess, slope)


_CHEAP = ("rdp", "gdp")

#: A calibrated noise multiplier above this is almost certainly a mistake (target_epsilon far
#: too small for the data set size and the number of steps): the model learns next to nothing.
EXTREME_NOISE_MULTIPLIER = 50.0


def warn_if_weak_delta(
    delta: Any, num_records: int | None, name: str = "delta", meaning: str = "", stacklevel: int = 3
) -> None:
    """Warns (``UserWarning``) when ``delta >= 1/N`` (N = ``num_records``): a mechanism that
    publishes one random record in full satisfies such a δ, so it does not mean privacy."""
    if num_records is None or not _is_real(delta) or delta < 1 / num_records:
        return
    warnings.warn(
        f"{name}={delta:g} is >= 1/N = {1 / num_records:g} (N = {num_records} records): a "
        f"mechanism that publishes one random record in full satisfies such a delta{meaning}. "
        "Use delta well below 1/N (e.g. 1/N^1.1 or 1e-5 for N < 100000).",
        UserWarning,
        stacklevel=stacklevel,
    )


def calibrate_noise_multiplier(
    accountant: IAccountant,
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: int,
    epsilon_tolerance: float = 0.001,
    num_records: int | None = None,
    steps_per_epoch: int | None = None,
) -> float:
    """:func:`get_noise_multiplier` under ``accountant``'s mechanism and neighbouring relation
    (the reached ε is at most ``epsilon_tolerance`` below the target, never above), warning (``UserWarning``)
    when ``target_delta >= 1/N`` (N = ``num_records``), when ``accountant`` already accounted
    steps (the total ε will exceed the target) and when σ exceeds
    :data:`EXTREME_NOISE_MULTIPLIER`.

    With ``steps_per_epoch`` (fixed-size batches, ``poisson_sampling=False``) σ is calibrated
    to the ε that :func:`engine_epsilon` reports for them: ``epochs`` passes of ``1 /
    sample_rate`` steps, each pass one Gaussian mechanism per record, no amplification by
    sampling, under replace-one."""
    if steps_per_epoch is None:
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            epochs=epochs,
            accountant=accountant.mechanism(),
            epsilon_tolerance=epsilon_tolerance,
            neighboring_relation=getattr(accountant, "neighboring_relation", "add_remove"),
        )
    else:
        steps = robust_floor(epochs / sample_rate)

        def eps_at(sigma: float) -> float:
            event = FixedSizeBatchEvent(GaussianEvent(sigma), steps_per_epoch, sample_rate)
            acc = _clone(accountant, accountant.neighboring_relation, [])
            acc.compose(event, steps)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return engine_epsilon(acc, target_delta)

        sigma = _bisect(eps_at, target_epsilon, epsilon_tolerance)
    warn_if_weak_delta(target_delta, num_records, "target_delta", stacklevel=5)
    if len(accountant) > 0:
        warnings.warn(
            "Calibrating the noise with an accountant that already accounted steps: the noise "
            "reaches target_epsilon for this training alone, and the total epsilon will exceed "
            "it (make_private_with_epsilon on a used PrivacyEngine).",
            stacklevel=4,
        )
    if sigma > EXTREME_NOISE_MULTIPLIER:
        warnings.warn(
            f"target_epsilon={target_epsilon:g} needs noise_multiplier={sigma:.4g} (sample rate "
            f"{sample_rate:.4g}, {epochs} epochs): the noise is more than "
            f"{EXTREME_NOISE_MULTIPLIER:g} times the clipping norm, so the model will learn "
            "next to nothing. Check target_epsilon (typical values 1-10), or use more data, "
            "larger batches or fewer epochs.",
            UserWarning,
            stacklevel=4,
        )
    return sigma


def _bisect(eps_at: Callable[[float], float], target: float, tol: float) -> float:
    """Doubling, then bisection until the bracket is narrower than ``tol`` and the upper end's
    ε is within ``tol`` of the target; returns the upper end."""
    sigma_low, sigma_high = 0.0, 1.0
    eps_high = eps_at(sigma_high)
    while eps_high > target:
        sigma_low, sigma_high = sigma_high, 2.0 * sigma_high
        if sigma_high > MAX_SIGMA:
            raise ValueError(
                f"target_epsilon={target} is unreachable (needs noise_multiplier > "
                f"{MAX_SIGMA:g}); raise target_epsilon or target_delta, or take fewer steps."
            )
        eps_high = eps_at(sigma_high)
    while sigma_high - sigma_low > tol or target - eps_high > tol:
        if sigma_high - sigma_low < 1e-12:
            break
        sigma = 0.5 * (sigma_low + sigma_high)
        eps = eps_at(sigma)
        if eps <= target:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


def _interpolation_search(
    eps_at: Callable[[float], float], target: float, tol: float, guess: float, slope: float,
    max_evals: int = 40,
) -> float:
    """σ with ``ε(σ) ≤ target``, ``target − ε(σ) ≤ tol`` and ``ε(σ − tol) > target``.

    ``log ε`` is interpolated linearly in ``log σ`` (secant, starting from ``guess`` and the
    log-log ``slope``) to aim just above the root, by a margin small enough for both tolerance
    conditions; then ``σ − tol`` is evaluated to certify the answer. Falls back to bisection.
    """
    pts: dict[float, float] = {}

    def ev(sigma: float) -> float:
        if sigma not in pts:
            pts[sigma] = eps_at(sigma) if sigma > 0 else math.inf
        return pts[sigma]

    sigma = guess
    for _ in range(max_evals):
        ev(sigma)
        lo = max((s for s, e in pts.items() if e > target), default=0.0)
        hi = min((s for s, e in pts.items() if e <= target), default=math.inf)
        if hi < math.inf and target - pts[hi] <= tol:  # a valid answer, if certified
            if lo >= hi - tol:
                return hi
        # root estimate from the two points closest to the target (in log ε), bracket first
        usable = [(s, e) for s, e in pts.items() if 0 < e < math.inf]
        near = sorted(usable, key=lambda p: abs(math.log(p[1] / target)))
        pair = [p for p in near if p[1] > target][:1] + [p for p in near if p[1] <= target][:1]
        if len(pair) < 2:
            pair = near[:2]
        if len(pair) == 2 and pair[0][0] != pair[1][0] and pair[0][1] != pair[1][1]:
            (s0, e0), (s1, e1) = pair
            slope = math.log(e1 / e0) / math.log(s1 / s0)
        s0, e0 = near[0] if near else (sigma, math.inf)
        root = s0 * math.exp(math.log(target / e0) / slope) if slope < 0 and near else math.nan
        # margin: below tol in σ, and below tol in ε (|dε/dσ| ≈ |slope|·ε/σ)
        dedsigma = abs(slope) * target / root if root == root and root > 0 else math.inf
        margin = 0.3 * min(tol, tol / dedsigma) if dedsigma > 0 else 0.3 * tol
        if hi < math.inf and target - pts[hi] <= tol and hi - tol <= root:
            sigma = hi - tol  # certify: ε(hi − tol) should exceed the target
        else:
            sigma = root + margin
        if not (lo < sigma < hi) or sigma != sigma or sigma in pts:
            sigma = 0.5 * (lo + hi) if hi < math.inf else 2.0 * max(lo, guess)
        if sigma > MAX_SIGMA:
            break
    return _bisect(eps_at, target, tol)


def _clone(accountant: IAccountant, relation: str, events: list) -> IAccountant:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GDP accountant's construction warning
        acc = type(accountant)(neighboring_relation=relation)
    acc.events = events
    acc.truncation = accountant.truncation
    return acc


def engine_epsilon(accountant: IAccountant, delta: float) -> float:
    """The ε that ``PrivacyEngine.get_epsilon`` reports.

    For Poisson-sampled steps: ``accountant.get_epsilon(delta)``. For fixed-size batches
    (``poisson_sampling=False``: :class:`~.events.FixedSizeBatchEvent` in the history) the
    Poisson figure is not a guarantee, so it returns the sound bound instead: no amplification
    by sampling (each pass over the data loader is one Gaussian mechanism for each record),
    under the replace-one relation (the data set size is public), and warns
    (``UserWarning``) with these assumptions, the pass length and the Poisson figure beside it.
    """
    leaves = flatten(accountant.events)
    fixed = [e for e, _ in leaves if isinstance(e, FixedSizeBatchEvent)]
    if not fixed:
        return accountant.get_epsilon(delta=delta)
    sound = accountant
    if accountant.neighboring_relation != "replace_one":
        sound = _clone(accountant, "replace_one", accountant.events)
    eps = sound.get_epsilon(delta=delta)
    nominal = [
        SelfComposedEvent(
            PoissonSampledEvent(e.sample_rate, e.event) if isinstance(e, FixedSizeBatchEvent) else e, n
        )
        for e, n in leaves
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        poisson = _clone(accountant, accountant.neighboring_relation, nominal).get_epsilon(delta=delta)
    poisson_note = (
        f" Accounted as Poisson sampling at q = {fixed[-1].sample_rate:.4g} (what "
        f"poisson_sampling=True would draw) it would be {poisson:.4g}, which is not a guarantee "
        "for these batches."
    )
    m = fixed[-1].steps_per_epoch
    if m > 1:
        usage = (f"each record is used in at most one optimizer step of each pass over the data "
                 f"loader ({m} steps), and every pass runs to its end (a pass cut short and "
                 "restarted without a checkpoint is not seen)")
    else:
        usage = ("the data loader's sampler is not known to use each record at most once per "
                 "pass, so every step is charged as if it used every record, each at most once "
                 "(the loader make_private returned refuses a batch that holds a record twice, "
                 "and the optimizer a release of several batches)")
    warnings.warn(
        f"poisson_sampling=False: epsilon = {eps:.4g} at delta = {delta:g} is a proven bound "
        "under the replace-one relation (the data set size is public; neighbours differ in one "
        f"record's value) with no amplification by sampling: {usage}.{poisson_note}",
        UserWarning,
        stacklevel=3,
    )
    return eps
