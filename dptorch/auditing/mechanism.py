"""White-box audit of DP-SGD steps through the real ``make_private`` pipeline.

:func:`audit_mechanism` builds a :class:`~dptorch.auditing.canary.CanaryProbe` on
:class:`~dptorch.auditing.canary.CanarySlots`, calls ``PrivacyEngine.make_private`` once (the
chosen ``grad_sample_mode``, clipping, multi-pass or distributed setting) with an SGD optimizer
of learning rate 0, and runs ordinary training steps: Poisson batch from the returned data
loader, forward, ``backward``, ``optimizer.step()``. Nothing of the mechanism is
re-implemented: the released update is read from ``p.grad`` after each step.

A *trial* is one canary slot over ``T`` consecutive steps. Before each block of ``T`` steps
every slot is independently set to "canary present" (``D'``) or "absent" (``D``) with
probability ½. With learning rate 0 the steps of a block compose exactly (each step sees the same
model), and the real Poisson sampler decides at each step whether a present canary is in the
batch. A trial's score is the log-likelihood ratio of the claimed mechanism (per-step shift
``1/σ`` with probability ``q``) evaluated on the normalised projections of the ``T`` released
updates on the canary direction: the optimal test if the implementation is what it claims.

Half of the trials choose three thresholds (the best for ``ε`` at ``δ``, for ``μ``, and for a
violation of the accountant's curve); the other half measures their error rates. Clopper–Pearson bounds at a Bonferroni-split level make every
reported bound hold simultaneously with the requested confidence. See docs/auditing.md.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from scipy.special import ndtri
from torch.utils.data import DataLoader, DistributedSampler

from ..accountants import create_accountant
from ..privacy_engine import PrivacyEngine
from .canary import CanaryProbe, CanarySlots, ProbeLoss
from .stats import (
    TradeoffCurve,
    clopper_pearson_lower,
    clopper_pearson_upper,
    epsilon_from_rates,
    error_counts,
    gdp_tradeoff,
    mu_from_rates,
)

__all__ = [
    "MechanismAuditConfig",
    "MechanismAuditResult",
    "ThresholdTest",
    "analyse",
    "audit_mechanism",
    "batches_per_epoch",
    "VERDICT_CONSISTENT",
    "VERDICT_VIOLATION",
    "VERDICT_INCONCLUSIVE",
]

VERDICT_CONSISTENT = "consistent"
VERDICT_VIOLATION = "violation: the implementation leaks more than it reports"
VERDICT_INCONCLUSIVE = "inconclusive: audit too weak"

#: δ values at which the accountant's privacy profile is evaluated to build its trade-off curve
_PROFILE_DELTAS = tuple(float(d) for d in np.logspace(-10, math.log10(0.9), 31))
#: the probe's number of linear maps (2: per-layer clipping has two bounds to split C into)
_LAYERS = 2
#: background records and their coordinates
_BACKGROUND, _BACKGROUND_DIMS = 24, 8

#: ``after_make_private(module, optimizer, data_loader, criterion)``; may return replacements
AfterMakePrivate = Callable[[Any, Any, Any, Any], "tuple[Any, Any, Any, Any] | None"]


@dataclass(frozen=True)
class MechanismAuditConfig:
    """What :func:`audit_mechanism` audits and how hard.

    Attributes:
        grad_sample_mode: ``make_private``'s mode (``"hooks"``, ``"functorch"``, ``"ew"``,
            ``"ghost"``, ``"bk"`` or a registered one).
        noise_multiplier: σ (> 0).
        sample_rate: q, of the form ``1/k`` (``make_private`` sets ``q = 1/len(data_loader)``).
        steps: T, steps per trial (they compose: learning rate 0).
        max_grad_norm: C (split equally over the probe's two weights for ``"per_layer"``).
        clipping: ``"flat"``, ``"per_layer"`` or ``"adaptive"`` (AdaClip; its arguments in
            ``make_private_kwargs``, default ones are filled in).
        multi_pass: ``None``, ``"sum"`` (``accum_passes=True``) or ``"split"``
            (``accum_passes=False, num_private_passes=2``); two backward passes per step on
            the same batch.
        world_size: processes (> 1: a gloo group on this machine, ``DistributedDataParallel``).
        max_physical_batch_size: run every logical (Poisson) batch through
            ``BatchMemoryManager`` in physical batches of at most this size (skipped steps
            accumulate, the last one releases).
        trials: number of trials (half choose thresholds, half measure).
        canaries_per_step: K, trials per block of T steps.
        canary_norm: a canary's gradient norm as a multiple of C (≥ 1: always clipped).
        loss_reduction: ``"mean"`` or ``"sum"``.
        accountant: the accountant whose ε is compared (``"prv"``, ``"pld"``, ``"rdp"``,
            ``"gdp"``).
        delta: δ of the reported ε and ε lower bound.
        confidence: joint confidence of every reported bound.
        tolerance: "consistent" needs the μ interval to reach ``(1 − tolerance) μ``.
        seed: seeds data, noise, sampling and the trial split (the audit is deterministic).
        make_private_kwargs: extra arguments of ``make_private``.
        after_make_private: called once with ``(module, optimizer, data_loader, criterion)``
            after ``make_private``; may return the four objects to use instead (a test can
            inject a broken component here; a user can attach a scheduler).
    """

    grad_sample_mode: str = "hooks"
    noise_multiplier: float = 1.0
    sample_rate: float = 1.0
    steps: int = 1
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    multi_pass: str | None = None
    world_size: int = 1
    max_physical_batch_size: int | None = None
    trials: int = 20_000
    canaries_per_step: int = 500
    canary_norm: float = 2.0
    loss_reduction: str = "mean"
    accountant: str = "prv"
    delta: float = 1e-5
    confidence: float = 0.95
    tolerance: float = 0.1
    seed: int = 0
    make_private_kwargs: Mapping[str, Any] = field(default_factory=dict)
    after_make_private: AfterMakePrivate | None = None

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {self.noise_multiplier}")
        batches_per_epoch(self.sample_rate)
        for name in ("steps", "world_size", "trials", "canaries_per_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_physical_batch_size is not None and not (
            isinstance(self.max_physical_batch_size, int) and self.max_physical_batch_size >= 1
        ):
            raise ValueError(
                f"max_physical_batch_size must be None or an integer >= 1, got {self.max_physical_batch_size!r}"
            )
        if self.trials < 100:
            raise ValueError(f"trials must be >= 100 for a meaningful audit, got {self.trials}")
        if self.canary_norm < 1:
            raise ValueError(f"canary_norm must be >= 1 (a canary must be clipped), got {self.canary_norm}")
        if self.multi_pass not in (None, "sum", "split"):
            raise ValueError(f"multi_pass must be None, 'sum' or 'split', got {self.multi_pass!r}")
        if not 0 < self.delta < 1 or not 0 < self.confidence < 1:
            raise ValueError("delta and confidence must lie in (0, 1)")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must lie in [0, 1), got {self.tolerance}")


def batches_per_epoch(sample_rate: float) -> int:
    """``k`` with ``sample_rate == 1/k``; ``ValueError`` otherwise (dptorch's sample rate is
    ``1/len(data_loader)``)."""
    if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    k = round(1 / sample_rate)
    if abs(k * sample_rate - 1) > 1e-9:
        raise ValueError(
            f"sample_rate must be 1/k for an integer k (make_private uses q = 1/len(data_loader)), "
            f"got {sample_rate}; e.g. {1 / k:.6g}"
        )
    return k


@dataclass(frozen=True)
class ThresholdTest:
    """One threshold test measured on the evaluation half.

    Attributes:
        threshold: "canary in" iff score > threshold.
        fpr, fnr: measured false-positive / false-negative rates.
        fpr_upper, fnr_upper: Clopper–Pearson upper bounds (Bonferroni-split level).
        fpr_lower, fnr_lower: lower bounds at the same level.
    """

    threshold: float
    fpr: float
    fnr: float
    fpr_upper: float
    fnr_upper: float
    fpr_lower: float
    fnr_lower: float


@dataclass
class MechanismAuditResult:
    """What :func:`audit_mechanism` found.

    Attributes:
        config: the audited configuration.
        noise_multiplier, sample_rate, steps: what the engine's accountant recorded per trial.
        epsilon: the accountant's ε for one trial's steps at ``config.delta``.
        epsilon_lb: the audit's lower bound on ε at ``config.delta`` (holds with
            ``config.confidence``, jointly with ``mu_lower`` and the violation check).
        mu: the accountant's μ: exact (``√T/σ``) when q = 1 (``mu_exact``), else the GDP μ of
            the accountant's trade-off curve at the best test's false-positive rate (the
            subsampled mechanism is not GDP: its local μ depends on where it is read).
        mu_hat, mu_hat_low, mu_hat_high: the audited μ and its interval. q = 1: the GDP μ
            fitted to the whole measured trade-off curve, with a bootstrap interval at
            ``config.confidence``. q < 1: the μ of the best test (``mu_test``), with its
            Clopper–Pearson interval.
        mu_lower: a rigorous lower bound on the GDP μ of the implementation (the best test's
            upper confidence corner; joint with ``epsilon_lb``).
        eps_test, mu_test, gap_test: the three threshold tests, chosen on the selection half to
            maximise ε_lb at ``config.delta``, the proven μ, and the distance below the
            accountant's curve.
        violation: ``curve_violation or mu_violation``.
        curve_violation: whether a test's upper confidence corner lies below the accountant's
            trade-off curve.
        mu_violation: q = 1 only: whether the proven ``mu_lower`` exceeds the exact ``mu``.
        violation_delta, violation_epsilon_lb, violation_epsilon: the δ among the accountant's
            profile points where a test comes closest to (or furthest past) the curve, the ε
            the test proves there and the accountant's ε there.
        verdict: one of :data:`VERDICT_CONSISTENT`, :data:`VERDICT_VIOLATION`,
            :data:`VERDICT_INCONCLUSIVE`.
        scores_out, scores_in: evaluation-half scores of ``D`` and ``D'`` trials.
        curve: the accountant's trade-off curve.
        seconds: wall time of the whole audit.
    """

    config: MechanismAuditConfig
    noise_multiplier: float
    sample_rate: float
    steps: int
    epsilon: float
    epsilon_lb: float
    mu: float
    mu_exact: bool
    mu_hat: float
    mu_hat_low: float
    mu_hat_high: float
    mu_lower: float
    eps_test: ThresholdTest
    mu_test: ThresholdTest
    gap_test: ThresholdTest
    violation: bool
    curve_violation: bool
    mu_violation: bool
    violation_delta: float
    violation_epsilon_lb: float
    violation_epsilon: float
    verdict: str
    scores_out: np.ndarray
    scores_in: np.ndarray
    curve: TradeoffCurve
    seconds: float

    @property
    def trials(self) -> int:
        """Trials run (both halves)."""
        return self.config.trials

    def report(self) -> str:
        """A few lines for a terminal: setting, accounted ε and μ, audited bounds, verdict."""
        c = self.config
        conf = f"{100 * c.confidence:g}%"
        mp = f", multi-pass {c.multi_pass}" if c.multi_pass else ""
        world = f", {c.world_size} processes" if c.world_size > 1 else ""
        mu_note, hat_note = (
            ("exact: Gaussian mechanism, q = 1", "GDP fit of the whole curve, bootstrap")
            if self.mu_exact
            else (
                f"of the accountant's curve at FPR {max(self.mu_test.fpr, 0.5 / len(self.scores_out)):.3g}",
                "of the best test, Clopper-Pearson",
            )
        )
        n_eval = len(self.scores_out) + len(self.scores_in)
        lines = [
            f"dptorch audit: white-box mechanism audit, Dirac canary, {c.trials} trials "
            f"({c.trials - n_eval} choose the tests, {n_eval} measure them)",
            f"  setting:   mode {c.grad_sample_mode}, clipping {c.clipping}{mp}{world}, "
            f"sigma {self.noise_multiplier:g}, q {self.sample_rate:g}, steps {self.steps}, "
            f"C {c.max_grad_norm:g}, loss_reduction {c.loss_reduction}",
            f"  accounted: epsilon = {self.epsilon:.3f} at delta = {c.delta:g} ({c.accountant}); "
            f"mu = {self.mu:.3f} ({mu_note})",
            f"  audited:   epsilon_lb = {self.epsilon_lb:.3f} at delta = {c.delta:g} "
            f"({conf} confidence; FPR <= {self.eps_test.fpr_upper:.4g}, "
            f"FNR <= {self.eps_test.fnr_upper:.4g})",
            f"             mu_hat = {self.mu_hat:.3f}, {conf} interval "
            f"[{self.mu_hat_low:.3f}, {self.mu_hat_high:.3f}] ({hat_note}); "
            f"mu_hat / mu = {self.mu_hat / self.mu:.3f}; proven mu >= {self.mu_lower:.3f}",
        ]
        if self.curve_violation:
            lines.append(
                f"  violation: at delta = {self.violation_delta:.3g} the audit proves epsilon >= "
                f"{self.violation_epsilon_lb:.3f}; the accountant reports "
                f"{self.violation_epsilon:.3f} there"
            )
        if self.mu_violation:
            lines.append(f"  violation: proven mu >= {self.mu_lower:.3f} > mu = {self.mu:.3f}")
        lines.append(f"  verdict:   {self.verdict}")
        lines.append(f"  ({self.seconds:.1f} s)")
        return "\n".join(lines)

    def plot(self, path: str) -> bool:
        """Writes a PNG of the empirical trade-off curve (evaluation half), the three tests' upper
        confidence corners, the accountant's curve and the GDP curves of ``mu`` and
        ``mu_hat``. Returns False (and writes nothing) if matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        s = np.unique(np.concatenate([self.scores_out, self.scores_in]))
        t = np.concatenate([[-np.inf], s])
        fp, fn = error_counts(self.scores_out, self.scores_in, t)
        fpr, fnr = fp / len(self.scores_out), fn / len(self.scores_in)
        grid = np.logspace(-5, 0, 400)
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
        for ax, log in zip(axes, (False, True)):
            ax.plot(fpr, fnr, lw=1.2, label="audit (evaluation half)")
            ax.plot(grid, self.curve(grid), "k--", lw=1, label=f"accountant ({self.config.accountant})")
            ax.plot(grid, gdp_tradeoff(grid, self.mu), ":", lw=1, label=f"GDP mu = {self.mu:.3f}")
            ax.plot(grid, gdp_tradeoff(grid, self.mu_hat), "-.", lw=1, label=f"GDP mu_hat = {self.mu_hat:.3f}")
            for test, mark in ((self.eps_test, "o"), (self.mu_test, "s"), (self.gap_test, "^")):
                ax.plot([test.fpr_upper], [test.fnr_upper], mark, ms=5, mfc="none")
            ax.set_xlabel("false-positive rate")
            ax.set_ylabel("false-negative rate")
            if log:
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xlim(1e-4, 1)
                ax.set_ylim(1e-4, 1)
            else:
                ax.set_xlim(0, 1)
                ax.set_ylim(0, 1)
        axes[0].legend(fontsize=7)
        c = self.config
        fig.suptitle(
            f"{c.grad_sample_mode}, sigma {self.noise_multiplier:g}, q {self.sample_rate:g}, "
            f"T {self.steps}: {self.verdict}",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return True


# --------------------------------------------------------------------------- the trials
def _layout(cfg: MechanismAuditConfig, canaries: int) -> tuple[int, int]:
    """``(N, physical batch size per process)``: ``N ≥ canaries + background`` records such that
    the loader has exactly ``1/q`` batches on every process."""
    k = batches_per_epoch(cfg.sample_rate)
    unit = k * cfg.world_size
    n = unit * math.ceil((canaries + _BACKGROUND) / unit)
    return n, n // unit


def _make_private_args(cfg: MechanismAuditConfig) -> dict[str, Any]:
    """``make_private`` arguments that depend on the configuration (clipping, multi-pass)."""
    kw: dict[str, Any] = dict(cfg.make_private_kwargs)
    c = cfg.max_grad_norm
    kw["max_grad_norm"] = [c / math.sqrt(_LAYERS)] * _LAYERS if cfg.clipping == "per_layer" else c
    if cfg.clipping == "adaptive":
        # C may only shrink, so a canary (norm canary_norm · C) is always clipped
        kw.setdefault("target_unclipped_quantile", 0.5)
        kw.setdefault("clipbound_learning_rate", 0.2)
        kw.setdefault("max_clipbound", c)
        kw.setdefault("min_clipbound", c / 10)
        kw.setdefault("unclipped_num_std", 50.0 * cfg.noise_multiplier)
    if cfg.multi_pass == "sum":
        kw.update(multi_pass=True, accum_passes=True)
    elif cfg.multi_pass == "split":
        kw.update(multi_pass=True, accum_passes=False, num_private_passes=2)
    return kw


def _log_lr(z: torch.Tensor, mu: float, q: float) -> torch.Tensor:
    """Per-step log-likelihood ratio of the claimed mechanism, ``log(1 − q + q e^{μ z − μ²/2})``,
    for normalised projections ``z`` (any shape, float64)."""
    shifted = mu * z - 0.5 * mu * mu
    if q >= 1:
        return shifted
    return torch.logaddexp(torch.full_like(z, math.log1p(-q)), shifted + math.log(q))


def _run_trials(
    cfg: MechanismAuditConfig, rank: int = 0
) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float, int]]]:
    """Runs the audit's training steps on this process.

    Returns ``(labels (n,) bool, scores (n,) float64, accountant history)``: for every trial,
    whether the canary was in the dataset and the trial's score (``n = blocks · K`` ≥
    ``cfg.trials``)."""
    canaries = min(cfg.canaries_per_step, cfg.trials)
    blocks = math.ceil(cfg.trials / canaries)
    n, batch = _layout(cfg, canaries)
    gen = torch.Generator().manual_seed(cfg.seed)
    data = CanarySlots(
        canaries,
        n - canaries,
        background_dims=_BACKGROUND_DIMS,
        canary_norm=cfg.canary_norm * cfg.max_grad_norm,
        background_norm=cfg.max_grad_norm,
        layers=_LAYERS,
        generator=gen,
    )
    probe = CanaryProbe(data.dims, _LAYERS)
    weights = probe.weights
    module: Any = probe
    sampler = None
    if cfg.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(probe)
        sampler = DistributedSampler(data, num_replicas=cfg.world_size, rank=rank, shuffle=False)
    loader = DataLoader(
        data,
        batch_size=batch,
        sampler=sampler,
        collate_fn=data.collate,
        generator=torch.Generator().manual_seed(cfg.seed + 1),
    )
    criterion = ProbeLoss(cfg.loss_reduction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GDP accountant warns that it approximates
        engine = PrivacyEngine(accountant=cfg.accountant)
    out = engine.make_private(
        module=module,
        optimizer=torch.optim.SGD(probe.parameters(), lr=0.0),
        data_loader=loader,
        noise_multiplier=cfg.noise_multiplier,
        grad_sample_mode=cfg.grad_sample_mode,
        clipping=cfg.clipping,
        loss_reduction=cfg.loss_reduction,
        criterion=criterion,
        noise_generator=torch.Generator().manual_seed(cfg.seed + 2),
        **_make_private_args(cfg),
    )
    if len(out) == 4:
        model, optimizer, criterion, loader = out
    else:
        model, optimizer, loader = out
    if cfg.after_make_private is not None:
        replaced = cfg.after_make_private(model, optimizer, loader, criterion)
        if replaced is not None:
            model, optimizer, loader, criterion = replaced
    passes = 2 if cfg.multi_pass else 1
    mu_step, q = 1.0 / cfg.noise_multiplier, cfg.sample_rate
    rng = np.random.default_rng(cfg.seed)
    labels = np.zeros((blocks, canaries), dtype=bool)
    scores = np.zeros((blocks, canaries), dtype=np.float64)
    with contextlib.ExitStack() as stack:
        if cfg.max_physical_batch_size is not None:
            from ..batch_memory_manager import BatchMemoryManager

            loader = stack.enter_context(
                BatchMemoryManager(
                    data_loader=loader,
                    max_physical_batch_size=cfg.max_physical_batch_size,
                    optimizer=optimizer,
                )
            )
        batches = iter(loader)

        def next_batch() -> torch.Tensor:
            nonlocal batches
            try:
                return next(batches)[0]
            except StopIteration:
                batches = iter(loader)
                return next(batches)[0]

        for b in range(blocks):
            present = rng.random(canaries) < 0.5
            labels[b] = present
            data.set_canaries(torch.from_numpy(present))
            score = torch.zeros(canaries, dtype=torch.float64)
            for _ in range(cfg.steps):
                done = len(engine.accountant)
                while len(engine.accountant) == done:  # physical batches of one logical step
                    x = next_batch()
                    optimizer.zero_grad()
                    for _ in range(passes):
                        criterion(model(x)).backward()
                    std = float(optimizer.noise_std)
                    optimizer.step()
                denom = 1.0
                if cfg.loss_reduction == "mean":
                    denom = float(optimizer.expected_batch_size) * cfg.world_size
                proj = sum(w.grad[0, :canaries].double() for w in weights) / math.sqrt(_LAYERS)
                score += _log_lr(proj * (denom / std), mu_step, q)
            scores[b] = score.numpy()
    return labels.reshape(-1), scores.reshape(-1), list(engine.accountant.history)


def _distributed_entry(rank: int, cfg: MechanismAuditConfig, port: int, out_dir: str) -> None:
    """One process of a distributed audit: joins the gloo group, runs the trials, and (rank 0)
    saves the result to ``out_dir``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.world_size
    )
    try:
        result = _run_trials(cfg, rank)  # the DDP model and its reducer are freed on return
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "result.pt"))
        gc.collect()
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def _run_distributed(
    cfg: MechanismAuditConfig,
) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float, int]]]:
    """:func:`_run_trials` on ``cfg.world_size`` spawned processes joined by gloo on
    127.0.0.1; the result of rank 0 (every rank releases the same update)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_distributed_entry, args=(cfg, port, out_dir), nprocs=cfg.world_size, join=True)
        return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)


# --------------------------------------------------------------------------- the analysis
def _accounted(
    cfg: MechanismAuditConfig, history: list[tuple[float, float, int]], total_steps: int
) -> tuple[float, float]:
    """``(σ, q)`` the engine's accountant recorded, checked to be one ``(σ, q)`` for all
    ``total_steps`` steps."""
    steps = sum(n for _, _, n in history)
    if steps != total_steps or len({(s, q) for s, q, _ in history}) != 1:
        raise ValueError(
            f"The accountant recorded {history} for {total_steps} optimizer steps; the audit "
            "needs one accountant step per optimizer step, all with the same (sigma, q)."
        )
    return float(history[0][0]), float(history[0][1])


def _accountant_for(name: str, sigma: float, q: float, steps: int):
    """A fresh accountant of kind ``name`` holding ``steps`` steps of ``(σ, q)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = create_accountant(name)
    acc.history = [(sigma, q, steps)]
    return acc


def _select(
    s_out: np.ndarray, s_in: np.ndarray, level: float, objective: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> float:
    """The threshold, among the selection half's scores, that maximises ``objective(FPR upper
    bound, FNR upper bound)`` computed on the selection half."""
    cands = np.unique(np.concatenate([s_out, s_in]))
    if len(cands) > 2000:
        cands = np.quantile(cands, np.linspace(0, 1, 2000))
    fp, fn = error_counts(s_out, s_in, cands)
    a = clopper_pearson_upper(fp, len(s_out), level)
    b = clopper_pearson_upper(fn, len(s_in), level)
    return float(cands[int(np.argmax(objective(a, b)))])


def _measure(s_out: np.ndarray, s_in: np.ndarray, t: float, level: float) -> ThresholdTest:
    """The test "score > t" measured on the evaluation half, with bounds at ``level``."""
    fp, fn = error_counts(s_out, s_in, np.array([t]))
    n0, n1 = len(s_out), len(s_in)
    return ThresholdTest(
        threshold=t,
        fpr=float(fp[0] / n0),
        fnr=float(fn[0] / n1),
        fpr_upper=float(clopper_pearson_upper(fp, n0, level)[0]),
        fnr_upper=float(clopper_pearson_upper(fn, n1, level)[0]),
        fpr_lower=float(clopper_pearson_lower(fp, n0, level)[0]),
        fnr_lower=float(clopper_pearson_lower(fn, n1, level)[0]),
    )


def _probit_points(
    s_out: np.ndarray, s_in: np.ndarray, grid: np.ndarray, min_errors: int = 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(FPR, local μ, weight)`` of the tests "score > t" for the ``t`` in ``grid`` that
    have at least ``min_errors`` errors of each kind and of each correct answer; the weight is
    the inverse delta-method variance of the local μ. ``None`` if no threshold qualifies."""
    n0, n1 = len(s_out), len(s_in)
    fp, fn = error_counts(s_out, s_in, grid)
    ok = (fp >= min_errors) & (fn >= min_errors) & (n0 - fp >= min_errors) & (n1 - fn >= min_errors)
    if not ok.any():
        return None
    a, b = fp[ok] / n0, fn[ok] / n1
    dens = lambda p: np.exp(-0.5 * ndtri(p) ** 2) / math.sqrt(2 * math.pi)  # noqa: E731
    var = a * (1 - a) / (n0 * dens(a) ** 2) + b * (1 - b) / (n1 * dens(b) ** 2)
    return a, mu_from_rates(a, b), 1.0 / var


def _gdp_fit(s_out: np.ndarray, s_in: np.ndarray, grid: np.ndarray) -> float | None:
    """μ̂, the GDP μ fitted to the empirical trade-off curve: the inverse-variance weighted
    mean of the local μ ``Φ⁻¹(1 − FPR) − Φ⁻¹(FNR)`` over the thresholds ``grid`` (``(k,)``);
    ``None`` if no threshold has enough errors of both kinds."""
    pts = _probit_points(s_out, s_in, grid)
    if pts is None:
        return None
    _, m, w = pts
    return float(np.sum(w * m) / np.sum(w))


def _bootstrap_interval(
    s_out: np.ndarray,
    s_in: np.ndarray,
    grid: np.ndarray,
    confidence: float,
    rng: np.random.Generator,
    resamples: int = 100,
) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`_gdp_fit`'s μ̂ (trials resampled with
    replacement within each class; the thresholds stay fixed)."""
    fits = []
    for _ in range(resamples):
        f = _gdp_fit(
            s_out[rng.integers(0, len(s_out), len(s_out))],
            s_in[rng.integers(0, len(s_in), len(s_in))],
            grid,
        )
        if f is not None:
            fits.append(f)
    if not fits:
        return float("nan"), float("nan")
    tail = 50 * (1 - confidence)
    lo, hi = np.percentile(fits, [tail, 100 - tail])
    return float(lo), float(hi)


def analyse(
    cfg: MechanismAuditConfig,
    labels: np.ndarray,
    scores: np.ndarray,
    history: list[tuple[float, float, int]],
    seconds: float = 0.0,
) -> MechanismAuditResult:
    """The audit's statistics from the trials' ``labels`` (``(n,)`` bool, canary in) and
    ``scores`` (``(n,)``), and the engine's accountant ``history`` (one entry per distinct
    ``(σ, q)``)."""
    blocks = len(labels) // min(cfg.canaries_per_step, cfg.trials)
    sigma, q = _accounted(cfg, history, blocks * cfg.steps)
    rng = np.random.default_rng([cfg.seed, 1])
    order = rng.permutation(len(labels))
    sel, ev = order[: len(order) // 2], order[len(order) // 2 :]
    # eight one-sided bounds hold jointly: the upper bounds on both rates of the three tests,
    # and the lower bounds of the μ test
    level = (1.0 - cfg.confidence) / 8.0

    def split(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return scores[idx][~labels[idx]], scores[idx][labels[idx]]

    acc = _accountant_for(cfg.accountant, sigma, q, cfg.steps)
    epsilon = float(acc.get_epsilon(cfg.delta))
    curve = TradeoffCurve.from_epsilon_fn(acc.get_epsilon, (*_PROFILE_DELTAS, cfg.delta))

    def gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """How far above the accountant's profile the rates prove ε: ``max_j ε_lb(δ_j) − ε_j``."""
        lb = epsilon_from_rates(a[:, None], b[:, None], curve.deltas[None, :])
        return (lb - curve.epsilons[None, :]).max(1)

    sel_out, sel_in = split(sel)
    ev_out, ev_in = split(ev)
    t_eps = _select(sel_out, sel_in, level, lambda a, b: epsilon_from_rates(a, b, cfg.delta))
    t_mu = _select(sel_out, sel_in, level, mu_from_rates)
    t_gap = _select(sel_out, sel_in, level, gap)
    eps_test = _measure(ev_out, ev_in, t_eps, level)
    mu_test = _measure(ev_out, ev_in, t_mu, level)
    gap_test = _measure(ev_out, ev_in, t_gap, level)

    epsilon_lb = float(epsilon_from_rates(eps_test.fpr_upper, eps_test.fnr_upper, cfg.delta))
    mu_lower = float(mu_from_rates(mu_test.fpr_upper, mu_test.fnr_upper))

    mu_upper = float(mu_from_rates(mu_test.fpr_lower, mu_test.fnr_lower))
    fpr_hat = max(mu_test.fpr, 0.5 / len(ev_out))
    mu_test_hat = float(mu_from_rates(fpr_hat, max(mu_test.fnr, 0.5 / len(ev_in))))
    mu_exact = q >= 1.0
    fit = None
    if mu_exact:  # exactly GDP: one μ for the whole curve, fitted
        mu = math.sqrt(cfg.steps) / sigma
        grid = np.quantile(np.concatenate([sel_out, sel_in]), np.linspace(0.0025, 0.9975, 399))
        fit = _gdp_fit(ev_out, ev_in, grid)
    else:  # not GDP: the accountant's curve at the best test's operating point
        mu = float(mu_from_rates(fpr_hat, curve(fpr_hat)))
    if fit is not None:
        mu_hat, mu_hat_low, mu_hat_high = fit, *_bootstrap_interval(
            ev_out, ev_in, grid, cfg.confidence, np.random.default_rng([cfg.seed, 2])
        )
    else:
        mu_hat, mu_hat_low, mu_hat_high = mu_test_hat, mu_lower, mu_upper

    checks = [curve.violated_by(t.fpr_upper, t.fnr_upper) for t in (eps_test, mu_test, gap_test)]
    curve_violation, v_delta, v_eps_lb, v_eps = max(checks, key=lambda c: c[2] - c[3])
    mu_violation = mu_exact and mu_lower > mu
    violation = curve_violation or mu_violation
    if violation:
        verdict = VERDICT_VIOLATION
    elif mu_hat_high >= (1.0 - cfg.tolerance) * mu:
        verdict = VERDICT_CONSISTENT
    else:
        verdict = VERDICT_INCONCLUSIVE
    return MechanismAuditResult(
        config=cfg,
        noise_multiplier=sigma,
        sample_rate=q,
        steps=cfg.steps,
        epsilon=epsilon,
        epsilon_lb=epsilon_lb,
        mu=mu,
        mu_exact=mu_exact,
        mu_hat=mu_hat,
        mu_hat_low=mu_hat_low,
        mu_hat_high=mu_hat_high,
        mu_lower=mu_lower,
        eps_test=eps_test,
        mu_test=mu_test,
        gap_test=gap_test,
        violation=violation,
        curve_violation=curve_violation,
        mu_violation=mu_violation,
        violation_delta=v_delta,
        violation_epsilon_lb=v_eps_lb,
        violation_epsilon=v_eps,
        verdict=verdict,
        scores_out=ev_out,
        scores_in=ev_in,
        curve=curve,
        seconds=seconds,
    )


def audit_mechanism(config: MechanismAuditConfig | None = None, **settings: Any) -> MechanismAuditResult:
    """Audits DP-SGD steps of dptorch's real pipeline with a white-box Dirac canary.

    Pass a :class:`MechanismAuditConfig` or its fields as keyword arguments
    (``audit_mechanism(grad_sample_mode="bk", noise_multiplier=1.0, sample_rate=1.0,
    steps=1)``). Runs ``ceil(trials / canaries_per_step) · steps`` optimizer steps of one
    ``make_private`` (on ``world_size`` processes), then compares the measured trade-off with
    the accountant's. ``result.report()`` prints the outcome; ``result.verdict`` is one of
    :data:`VERDICT_CONSISTENT`, :data:`VERDICT_VIOLATION`, :data:`VERDICT_INCONCLUSIVE`.
    """
    cfg = replace(config, **settings) if config is not None else MechanismAuditConfig(**settings)
    start = time.perf_counter()
    if cfg.world_size > 1:
        labels, scores, history = _run_distributed(cfg)
    else:
        labels, scores, history = _run_trials(cfg)
    return analyse(cfg, labels, scores, history, seconds=time.perf_counter() - start)
