"""One-run audit of a training run (Steinke, Nasr, Jagielski 2023, "Privacy auditing with one
(1) training run").

``m`` canaries are each put in the training set independently with probability ½; after (or
during) training, the auditor scores every canary, guesses "in" for the ``k₊`` highest scores
and "out" for the ``k₋`` lowest, and counts its correct guesses. An ``(ε, δ)``-DP training run
cannot let the guesses be right much more often than ``e^ε / (1 + e^ε)``
(:func:`~dptorch.auditing.stats.one_run_p_value`), which turns the count into a lower bound on
ε with a chosen confidence. The run is the user's own training loop:

.. code-block:: python

    auditor = OneRunAuditor(canary_x, canary_y, seed=0)
    train_set = auditor.training_set(train_set)        # the canaries drawn "in" are added
    model, optimizer, loader = engine.make_private(module=..., data_loader=DataLoader(train_set, ...), ...)
    with auditor.observe(model, optimizer, loss_fn):   # white-box: gradient alignment per step
        for x, y in loader: ...                         # the usual loop, unchanged
    result = auditor.audit(auditor.white_box_scores, epsilon=engine.get_epsilon(delta), delta=delta)
    print(result.report())

Black-box scores (``auditor.black_box_scores(model, loss_fn)``: minus each canary's loss under
the final model) need no observation at all.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from .mechanism import VERDICT_CONSISTENT, VERDICT_INCONCLUSIVE, VERDICT_VIOLATION
from .stats import one_run_epsilon_lower_bound

__all__ = ["OneRunAuditor", "OneRunResult", "GUESS_FRACTIONS"]

#: fractions of ``m`` guessed "in" (and, in a second family, also "out"); the bound is taken
#: over all of them with a Bonferroni correction, so choosing the best one is allowed
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)

#: ``loss_fn(output, target) -> scalar``, e.g. ``torch.nn.functional.cross_entropy``
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class OneRunResult:
    """What :meth:`OneRunAuditor.audit` found.

    Attributes:
        canaries: m.
        included: how many canaries were in the training set.
        guesses_in, guesses_out: ``k₊``, ``k₋`` of the best guess family.
        correct: correct guesses of that family.
        epsilon_lb: the lower bound on ε at ``delta`` (holds with ``confidence`` over the
            canaries' inclusion, after the Bonferroni correction over the guess families).
        ceiling: the largest ``epsilon_lb`` any family could have given (all guesses right):
            the audit cannot detect more than this.
        epsilon: the ε the training run reports at ``delta``.
        delta, confidence: as given.
        verdict: ``"violation: ..."`` if ``epsilon_lb > epsilon``; ``"inconclusive: ..."`` if
            ``ceiling <= epsilon`` (no outcome could have shown a violation) or nothing was
            detected (``epsilon_lb == 0``); else ``"consistent"``.
        scores: the ``(m,)`` membership scores that were audited.
        details: other numbers worth printing (e.g. the model's test accuracy).
    """

    canaries: int
    included: int
    guesses_in: int
    guesses_out: int
    correct: int
    epsilon_lb: float
    ceiling: float
    epsilon: float
    delta: float
    confidence: float
    verdict: str
    scores: np.ndarray
    details: dict[str, float] = field(default_factory=dict)

    def report(self) -> str:
        """A few lines for a terminal."""
        r = self.guesses_in + self.guesses_out
        return "\n".join(
            [
                f"dptorch audit: one-run audit (Steinke, Nasr, Jagielski 2023), {self.canaries} "
                f"canaries, {self.included} in the training set",
                f"  accounted: epsilon = {self.epsilon:.3f} at delta = {self.delta:g}",
                f"  audited:   epsilon_lb = {self.epsilon_lb:.3f} at delta = {self.delta:g} "
                f"({100 * self.confidence:g}% confidence; {self.correct} of {r} guesses right: "
                f"{self.guesses_in} 'in', {self.guesses_out} 'out'); at most {self.ceiling:.3f} "
                "was detectable",
                *(f"  {k}: {v:.4g}" for k, v in self.details.items()),
                f"  verdict:   {self.verdict}",
            ]
        )


def _inner(model: nn.Module) -> nn.Module:
    """The user's module inside dptorch's wrapper (and DistributedDataParallel), if any."""
    inner = getattr(model, "_module", model)
    return getattr(inner, "module", inner) if isinstance(inner, nn.parallel.DistributedDataParallel) else inner


@contextmanager
def _hooks_off(model: nn.Module) -> Iterator[None]:
    """Calls into the model that dptorch's per-sample hooks must not record."""
    if not hasattr(model, "disable_hooks"):
        yield
        return
    was = getattr(model, "hooks_enabled", True)
    model.disable_hooks()
    try:
        yield
    finally:
        if was:
            model.enable_hooks()


class OneRunAuditor:
    """Canaries for a one-run audit, their random inclusion, and their membership scores.

    Args:
        inputs: ``(m, ...)`` canary inputs.
        targets: ``(m, ...)`` canary targets.
        seed: seeds the inclusion draw (each canary in with probability ½).
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, *, seed: int = 0):
        if len(inputs) != len(targets) or len(inputs) < 2:
            raise ValueError("need m >= 2 canaries and one target per input")
        self.inputs = inputs
        self.targets = targets
        gen = torch.Generator().manual_seed(seed)
        #: ``(m,)`` bool: which canaries are in the training set
        self.included = torch.rand(len(inputs), generator=gen) < 0.5
        #: ``(m,)`` float64: white-box scores accumulated by :meth:`observe`
        self.white_box_scores = torch.zeros(len(inputs), dtype=torch.float64)
        self.observed_steps = 0

    @property
    def m(self) -> int:
        """The number of canaries."""
        return len(self.inputs)

    def training_set(self, dataset: Dataset) -> Dataset:
        """``dataset`` followed by the included canaries as ``(input, target)`` records."""
        idx = self.included.nonzero().flatten()
        return ConcatDataset([dataset, TensorDataset(self.inputs[idx], self.targets[idx])])

    # ------------------------------------------------------------------ scores
    def _functional(self, model: nn.Module, loss_fn: LossFn):
        """``(per-sample loss function of the trainable parameters, those parameters)``:
        ``losses(params) -> (m,)``, the canaries' losses, evaluated functionally (dptorch's
        hooks must be off while it runs)."""
        inner = _inner(model)
        params = {n: p.detach() for n, p in inner.named_parameters() if p.requires_grad}
        fixed = {n: p.detach() for n, p in inner.named_parameters() if not p.requires_grad}
        fixed.update(dict(inner.named_buffers()))

        def loss_one(ps: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(inner, {**ps, **fixed}, (x.unsqueeze(0),))
            return loss_fn(out, y.unsqueeze(0))

        def losses(ps: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.vmap(loss_one, in_dims=(None, 0, 0))(ps, self.inputs, self.targets)

        return loss_one, losses, params

    def _gradient_norms(self, model: nn.Module, loss_fn: LossFn, chunk: int = 256) -> torch.Tensor:
        """``(m,)``: the L2 norm of each canary's loss gradient at the current parameters
        (per-sample gradients materialised ``chunk`` canaries at a time)."""
        loss_one, _, params = self._functional(model, loss_fn)
        per_sample = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))
        out = []
        with _hooks_off(model):
            for i in range(0, self.m, chunk):
                g = per_sample(params, self.inputs[i : i + chunk], self.targets[i : i + chunk])
                out.append(sum(v.reshape(v.shape[0], -1).double().pow(2).sum(1) for v in g.values()))
        return torch.cat(out).sqrt()

    def _alignments(
        self, model: nn.Module, loss_fn: LossFn, direction: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``(m,)``: ``⟨direction, ∇ℓ_i⟩`` for every canary ``i`` at the current parameters, by
        one forward-mode product (no per-sample gradient is materialised). ``direction`` maps
        trainable parameter names to tensors of their shapes (missing: zero)."""
        _, losses, params = self._functional(model, loss_fn)
        tangent = {n: direction.get(n, torch.zeros_like(p)).to(p.dtype) for n, p in params.items()}
        with _hooks_off(model), warnings.catch_warnings():
            # torch's first forward-mode call loads decompositions through torch.jit.script
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
            _, dots = torch.func.jvp(losses, (params,), (tangent,))
        return dots.double()

    @contextmanager
    def observe(
        self, model: nn.Module, optimizer: Any, loss_fn: LossFn, *, norm_every: int = 10
    ) -> Iterator[OneRunAuditor]:
        """White-box observation of every DP step of the ``with`` block.

        At each released step (the DP optimizer's step hook: after clipping, noise and scaling,
        before the parameters move) adds to canary ``i``'s score the alignment
        ``⟨g_t, ∇ℓ_i(θ_t)⟩ / ‖∇ℓ_i‖`` of the released gradient ``g_t`` (``p.grad``) with its own
        loss gradient at the current parameters: an included canary's clipped gradient is part
        of ``g_t``, so its score drifts upwards. The alignments cost one forward-mode pass over
        the canaries per step; the norms (per-sample gradients) are recomputed every
        ``norm_every`` steps. The optimizer's existing step hook (the accountant) still runs
        first; it is restored on exit.
        """
        inner = _inner(model)
        names = {id(p): n for n, p in inner.named_parameters()}
        previous = getattr(optimizer, "step_hook", None)
        norms: list[torch.Tensor] = []

        def hook(opt: Any) -> None:
            if previous is not None:
                previous(opt)
            if self.observed_steps % norm_every == 0 or not norms:
                norms[:] = [self._gradient_norms(model, loss_fn).clamp_min(1e-12)]
            released = {names[id(p)]: p.grad.detach() for p in opt.params if p.grad is not None}
            self.white_box_scores += self._alignments(model, loss_fn, released) / norms[0]
            self.observed_steps += 1

        optimizer.step_hook = hook
        try:
            yield self
        finally:
            optimizer.step_hook = previous

    def black_box_scores(self, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        """``(m,)``: minus each canary's loss under ``model`` as it is now (members tend to have
        a lower loss)."""
        inner = _inner(model)
        was_training = inner.training
        inner.eval()
        try:
            with torch.no_grad(), _hooks_off(model):
                out = inner(self.inputs)
                losses = torch.stack(
                    [loss_fn(out[i : i + 1], self.targets[i : i + 1]) for i in range(self.m)]
                )
        finally:
            inner.train(was_training)
        return -losses.double()

    # ------------------------------------------------------------------ the bound
    def audit(
        self,
        scores: torch.Tensor | np.ndarray,
        *,
        epsilon: float,
        delta: float,
        confidence: float = 0.95,
        fractions: tuple[float, ...] = GUESS_FRACTIONS,
    ) -> OneRunResult:
        """The ε lower bound from ``scores`` (``(m,)``, higher means "more likely in").

        For every fraction ``f`` two guess families are tried: "in" for the ``⌈f m⌉`` highest
        scores; and that plus "out" for the ``⌈f m⌉`` lowest. Each family's bound is computed
        at confidence ``1 − (1 − confidence)/F`` (``F`` families), so the best of them holds with
        ``confidence``. ``epsilon`` is the ε the run reports at ``delta``."""
        s = np.asarray(scores, dtype=np.float64).reshape(-1)
        if s.shape[0] != self.m:
            raise ValueError(f"expected {self.m} scores, got {s.shape[0]}")
        inc = self.included.numpy()
        order = np.argsort(-s, kind="stable")
        families = []
        for f in fractions:
            k = max(1, math.ceil(f * self.m))
            if k > self.m // 2:
                continue
            families.append((k, 0))
            families.append((k, k))
        level = 1.0 - (1.0 - confidence) / len(families)
        best = (0.0, 0, 0, 0)
        ceiling = 0.0
        for k_in, k_out in families:
            right = int(inc[order[:k_in]].sum()) + (int((~inc[order[-k_out:]]).sum()) if k_out else 0)
            r = k_in + k_out
            lb = one_run_epsilon_lower_bound(self.m, r, right, delta, level)
            ceiling = max(ceiling, one_run_epsilon_lower_bound(self.m, r, r, delta, level))
            if lb > best[0] or best[1] == 0:
                best = (lb, k_in, k_out, right)
        lb, k_in, k_out, right = best
        if lb > epsilon:
            verdict = VERDICT_VIOLATION
        elif ceiling <= epsilon or lb == 0.0:
            verdict = VERDICT_INCONCLUSIVE
        else:
            verdict = VERDICT_CONSISTENT
        return OneRunResult(
            canaries=self.m,
            included=int(inc.sum()),
            guesses_in=k_in,
            guesses_out=k_out,
            correct=right,
            epsilon_lb=lb,
            ceiling=ceiling,
            epsilon=epsilon,
            delta=delta,
            confidence=confidence,
            verdict=verdict,
            scores=s,
        )
